"""One call per FP8 layer block (csrc/bindings/block.cpp): the forward or backward of
[RMSNorm | SwiGLU ->] per-tensor quantize -> FP8 GEMM, with the weights quantized afresh from their
separate parts. It runs exactly the kernels of the single ops, in their order (bit-identical
results), for one host call instead of four to seven: on the 7B step that is ~900 fewer Python op
calls.

Not torch custom ops: ``coat.nn``'s autograd Functions call them only where the single ops' eager
fast path would run anyway (``usable``: plain CUDA tensors, nothing tracing, shapes the FP8 GEMM
takes as they are); everywhere else (CPU, torch.compile, FakeTensor, odd shapes) they run the
single ops, which carry the schemas and fake implementations.

The kinds of the pre-ops are trailing keyword arguments of ``forward`` and ``backward``, the
Llama kinds by default: ``unit_offset`` (the norm's weight applies as Gemma's 1 + w, as in
``norm.rmsnorm_fwd``) and ``act`` (the gate's activation, ``swiglu.SILU`` or ``swiglu.GELU_TANH``).
A backward takes the kinds of its forward; each is read only by the pre-op it belongs to.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import _C
from . import gemm as _gemm
from ._util import dtype_id, eager_plain
from ._util import stream as _stream
from .enums import BLOCK_PRE, GEMM_OUT_IDS
from .norm import kind_id as _norm_kind
from .swiglu import SILU

NONE, NORM, SWIGLU = BLOCK_PRE["none"], BLOCK_PRE["norm"], BLOCK_PRE["swiglu"]  # the pre-op of a block
_OUT = (torch.float32, torch.bfloat16)  # GEMM output dtypes a block writes itself


def usable(t: torch.Tensor, w: torch.Tensor, dims: Sequence[int], *dtypes: torch.dtype) -> bool:
    """Whether a block call on CUDA tensor ``t`` (weights like ``w``) may run as one call: eager,
    plain tensors, GEMM dimensions ``dims`` all non-zero multiples of 16 (cuBLASLt FP8 without
    padding) and GEMM output dtypes fp32/bf16."""
    if not (t.is_cuda and eager_plain(t)) or (type(w) is not torch.Tensor and type(w) is not torch.nn.Parameter):
        return False
    for d in dims:  # loops, not all(...): this runs twice per block call
        if d <= 0 or d % 16:
            return False
    for dt in dtypes:
        if dt not in _OUT:
            return False
    return True


def _ws(t: torch.Tensor, st: int) -> torch.Tensor:
    return _gemm._workspace(t.get_device(), st)


def forward(x2: torch.Tensor, pre: int, norm_weight: Optional[torch.Tensor], eps: float, e8m0: bool,
            weights: Sequence[torch.Tensor], save_input_t: bool, out_dtype: torch.dtype, fast_accum: bool,
            unit_offset: bool = False, act: int = SILU):
    """(out [M, N], weight scale, saved): ``saved`` is what the backward reads (see block.cpp)."""
    st = _stream(x2)
    out, w_scale, s0, s1, s2 = _C.block_fwd(x2, pre, norm_weight, eps, e8m0, list(weights), save_input_t,
                                            GEMM_OUT_IDS[out_dtype], fast_accum, _ws(x2, st), _gemm.forced_bf16(), st,
                                            _norm_kind(unit_offset), act)
    return out, w_scale, (s0, s1, s2)


def backward(d2: torch.Tensor, pre: int, need_w: bool, weights: Sequence[torch.Tensor], w_scale: torch.Tensor,
             saved: Sequence[Optional[torch.Tensor]], norm_weight: Optional[torch.Tensor], y_dtype: torch.dtype,
             wgrad_dtype: torch.dtype, unit_offset: bool = False, act: int = SILU):
    """(dx, dnorm_weight fp32 or None, dw or None) of a block."""
    st = _stream(d2)
    s0, s1, s2 = saved
    return _C.block_bwd(d2, pre, need_w, list(weights), w_scale, s0, s1, s2, norm_weight, dtype_id(y_dtype),
                        GEMM_OUT_IDS[wgrad_dtype], _ws(d2, st), _gemm.forced_bf16(), st, _norm_kind(unit_offset), act)
