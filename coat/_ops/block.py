"""The FP8 layer block as two custom ops, ``coat::block_fwd`` and ``coat::block_bwd``
(csrc/bindings/block.cpp): the forward or backward of [RMSNorm | SwiGLU ->] per-tensor quantize ->
FP8 GEMM in one core call, on CPU and CUDA tensors of every shape. They are coat's layers' only
path (``coat.nn.block``); eager calls on plain tensors skip the dispatcher (``_util.custom_op``),
everything else (torch.compile, FakeTensor) sees the schemas and the fake implementations below.

The weight is either its separate row blocks (``weights``, quantized inside the call) or FP8 codes
the caller holds (``w_codes`` + ``w_scale`` forward, ``w_codes_t`` backward). The kinds of the
pre-ops are trailing arguments, the Llama kinds by default: ``unit_offset`` (the norm's weight
applies as Gemma's 1 + w, as in ``norm.rmsnorm_fwd``) and ``act`` (the gate's activation,
``swiglu.SILU`` or ``swiglu.GELU_TANH``). A backward takes the kinds of its forward.

Outputs a call does not make come back from the ops as empty [0] tensors (a custom op returns
tensors only); ``forward`` and ``backward`` below turn them into None from the arguments, never
from shapes. Their eager calls on plain tensors call the binding directly (no placeholders made).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from .. import _C
from . import gemm as _gemm
from ._util import custom_op, dev_ctx, eager_plain
from ._util import stream as _stream
from .enums import BLOCK_PRE, DTYPE_IDS, FP8_DTYPE_IDS as _FMT, NORM_KINDS
from .norm import GROUP
from .quantize import scale_count
from .swiglu import SILU

NONE, NORM, SWIGLU = BLOCK_PRE["none"], BLOCK_PRE["norm"], BLOCK_PRE["swiglu"]  # the pre-op of a block
#: The block op's granularity ids (csrc/bindings/block.cpp) by recipe name, and the scale modes of
#: the finer ones (``quantize.SCALE_MODES``: activations and gradients, weight).
GRANULARITY_IDS = {"tensor": 0, "row": 1, "block": 2}
MODES = {"row": ("row", "row"), "block": ("1x128", "128x128")}
_MODES = {GRANULARITY_IDS[g]: m for g, m in MODES.items()}
#: Group scaling (per-tensor granularity): the RMSNorm and SwiGLU kernels write the amax of the GEMM
#: inputs and gradients they produce in the same pass, so no amax pass re-reads them. False runs an
#: amax pass per operand instead: the same codes and scales bit for bit, kept for A/B measurement
#: (benchmarks/bench_layer.py) and the tests that hold the two equal.
PRODUCER_AMAX = True
_U8, _F32, _E4M3 = torch.uint8, torch.float32, torch.float8_e4m3fn
_FP8 = {i: dt for dt, i in _FMT.items()}  # the core's format id -> torch FP8 dtype


def _ws(t: torch.Tensor, stream: int) -> Optional[torch.Tensor]:
    """cuBLASLt's workspace of t's device and ``stream`` (the CPU reference reads none)."""
    return _gemm._workspace(t.get_device(), stream) if t.is_cuda else None


def _dtype_id(dtype: torch.dtype, arg: str) -> int:
    """_util.dtype_id with torch's short dtype names in the message, as the core's messages write them
    (a layer's forward in float64 is refused with the same words as the core's checks)."""
    i = DTYPE_IDS.get(dtype)
    if i is None:
        raise ValueError(f"{arg} must be float32, bfloat16 or float16, got {str(dtype).removeprefix('torch.')}")
    return i


def _or_empty(t: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if t is None else t


def _group_scales(shape, e8m0: bool, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((*shape[:-1], shape[-1] // GROUP), dtype=_U8 if e8m0 else _F32)


@custom_op("coat::block_fwd", mutates_args=())
def block_fwd(x: torch.Tensor, pre: int, norm_weight: Optional[torch.Tensor], eps: float, e8m0: bool,
              weights: list[torch.Tensor], w_codes: Optional[torch.Tensor], w_scale: Optional[torch.Tensor],
              save_input_t: bool, out_dtype: torch.dtype, fast_accum: bool, norm_kind: int, act: int,
              want_stats: bool, act_fmt: int, granularity: int,
              w_amax: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor]:
    """(out, w_scale or empty, s0, s1, s2, stat_in, stat_scale), block.cpp's block_fwd; ``w_amax``
    empty: none given (an amax pass)."""
    r = _fwd(x, pre, norm_weight, eps, e8m0, weights, w_codes, w_scale, save_input_t, out_dtype, fast_accum, norm_kind,
             act, want_stats, act_fmt, granularity, w_amax)
    return tuple(_or_empty(t, x) for t in r)


def _fwd(x, pre, norm_weight, eps, e8m0, weights, w_codes, w_scale, save_input_t, out_dtype, fast_accum, norm_kind,
         act, want_stats, act_fmt, granularity=0, w_amax=()):
    """The binding's call: None where block_fwd returns an empty tensor."""
    with dev_ctx(x):
        st = _stream(x)
        return _C.block_fwd(x, pre, norm_weight, eps, e8m0, weights, w_codes, w_scale, save_input_t,
                            _dtype_id(out_dtype, "out_dtype"), fast_accum, _ws(x, st), _gemm.forced_bf16(), st,
                            norm_kind, act, want_stats, act_fmt, granularity, PRODUCER_AMAX, list(w_amax) or None)


def _pad(n: int, t: torch.Tensor) -> int:
    """A scaled operand's padded extent (block.cpp scaled_pad): multiples of 16 on CUDA."""
    return -(-n // 16) * 16 if t.device.type == "cuda" else n


@block_fwd.register_fake
def _(x, pre, norm_weight, eps, e8m0, weights, w_codes, w_scale, save_input_t, out_dtype, fast_accum, norm_kind,
      act, want_stats, act_fmt, granularity, w_amax):
    m, k = x.shape
    gk = k // 2 if pre == SWIGLU else k  # the GEMM's K
    n = w_codes.shape[0] if w_codes is not None else sum(w.shape[0] for w in weights)
    if granularity:
        act_mode, w_mode = _MODES[granularity]
        mp, kp, np_ = _pad(m, x), _pad(gk, x), _pad(n, x)
        ws = x.new_empty(scale_count(w_mode, np_, kp), dtype=_F32)
        if pre == NONE:
            s = ((x.new_empty((kp, mp), dtype=_U8), x.new_empty(scale_count(act_mode, kp, mp), dtype=_F32))
                 if save_input_t else (x.new_empty(0), x.new_empty(0))) + (x.new_empty(0),)
        else:
            s = (x.new_empty((m, k), dtype=_FP8[act_fmt]), _group_scales((m, k), e8m0, x),
                 x.new_empty(m, dtype=_F32) if pre == NORM else x.new_empty(0))
        stat_in = x.new_empty((m, gk)) if want_stats and pre != NONE else x.new_empty(0)
        return (x.new_empty((m, n), dtype=out_dtype), ws, *s, stat_in, x.new_empty(0))
    stats = want_stats and pre != NONE
    ws = x.new_empty(0) if w_codes is not None else x.new_empty(1, dtype=_F32)
    stat_in = x.new_empty((m, gk)) if stats else x.new_empty(0)
    stat_scale = x.new_empty(1, dtype=_F32) if stats else x.new_empty(0)
    if pre == NONE:
        s = (x.new_empty((k, m), dtype=_U8) if save_input_t else x.new_empty(0), x.new_empty(1, dtype=_F32),
             x.new_empty(0))
    else:
        s = (x.new_empty((m, k), dtype=_FP8[act_fmt]), _group_scales((m, k), e8m0, x),
             x.new_empty(m, dtype=_F32) if pre == NORM else x.new_empty(0))
    return (x.new_empty((m, n), dtype=out_dtype), ws, *s, stat_in, stat_scale)


@custom_op("coat::block_bwd", mutates_args=())
def block_bwd(dout: torch.Tensor, pre: int, need_w: bool, weights: list[torch.Tensor], w_scale: torch.Tensor,
              w_codes_t: Optional[torch.Tensor], s0: Optional[torch.Tensor], s1: Optional[torch.Tensor],
              s2: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor], wgrad_input: Optional[torch.Tensor],
              y_dtype: torch.dtype, wgrad_dtype: torch.dtype, norm_kind: int, act: int, want_stats: bool,
              act_fmt: int, grad_fmt: int, granularity: int = 0,
              dout_amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    """(dx, dnorm or empty, dw or empty, d_scale or empty, stat_in, stat_scale, dx_amax or empty),
    block.cpp's block_bwd."""
    r = _bwd(dout, pre, need_w, weights, w_scale, w_codes_t, s0, s1, s2, norm_weight, wgrad_input, y_dtype,
             wgrad_dtype, norm_kind, act, want_stats, act_fmt, grad_fmt, granularity, dout_amax)
    return tuple(_or_empty(t, dout) for t in r)


def _bwd(dout, pre, need_w, weights, w_scale, w_codes_t, s0, s1, s2, norm_weight, wgrad_input, y_dtype, wgrad_dtype,
         norm_kind, act, want_stats, act_fmt, grad_fmt, granularity=0, dout_amax=None):
    """The binding's call: None where block_bwd returns an empty tensor."""
    with dev_ctx(dout):
        st = _stream(dout)
        return _C.block_bwd(dout, pre, need_w, weights, w_scale, w_codes_t, s0, s1, s2, norm_weight, wgrad_input,
                            _dtype_id(y_dtype, "y_dtype"), _dtype_id(wgrad_dtype, "wgrad_dtype"), _ws(dout, st),
                            _gemm.forced_bf16(), st, norm_kind, act, want_stats, act_fmt, grad_fmt, granularity,
                            PRODUCER_AMAX, dout_amax)


@block_bwd.register_fake
def _(dout, pre, need_w, weights, w_scale, w_codes_t, s0, s1, s2, norm_weight, wgrad_input, y_dtype, wgrad_dtype,
      norm_kind, act, want_stats, act_fmt, grad_fmt, granularity=0, dout_amax=None):
    m, n = dout.shape
    k = w_codes_t.shape[0] if w_codes_t is not None else weights[0].shape[1]  # the GEMM's K
    dx = dout.new_empty((m, 2 * k) if pre == SWIGLU else (m, k))
    # outputs a call does not make are empty placeholders of dout's dtype (_or_empty), as the real op's
    dnorm = dout.new_empty(k, dtype=_F32) if pre == NORM else dout.new_empty(0)
    dw = dout.new_empty((n, k) if need_w else 0, dtype=wgrad_dtype)
    stats = want_stats and need_w
    # the recomputed GEMM input: the norm's in y_dtype, SwiGLU's in the gradient's dtype
    stat_in = dout.new_empty((m, k) if stats and pre != NONE else 0, dtype=y_dtype if pre == NORM else dout.dtype)
    stat_scale = (dout.new_empty(1, dtype=_F32) if stats and not granularity and (pre != NONE or wgrad_input is not None)
                  else dout.new_empty(0))
    d_scale = dout.new_empty(0) if granularity else dout.new_empty(1, dtype=_F32)
    dx_amax = dout.new_empty(1, dtype=_F32) if pre == SWIGLU and PRODUCER_AMAX and not granularity else dout.new_empty(0)
    return dx, dnorm, dw, d_scale, stat_in, stat_scale, dx_amax


def _plain(t: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether a call may skip the dispatcher: eager, and the weights plain tensors too (a tensor
    subclass gets its say through the op)."""
    if not eager_plain(t):
        return False
    for w in weights:  # a loop, not all(...): this runs twice per block call
        if type(w) is not torch.Tensor and type(w) is not torch.nn.Parameter:
            return False
    return True


class Fwd(NamedTuple):
    out: torch.Tensor
    w_scale: Optional[torch.Tensor]  # the scale of the codes made inside (None with the caller's codes)
    saved: tuple  # what backward reads: (s0, s1, s2), None where nothing is saved
    stat_in: Optional[torch.Tensor]  # with stats and a pre-op: the GEMM input and (per tensor) its scale
    stat_scale: Optional[torch.Tensor]


def forward(x2: torch.Tensor, pre: int, norm_weight: Optional[torch.Tensor], eps: float, e8m0: bool,
            weights: Sequence[torch.Tensor], w_codes: Optional[torch.Tensor], w_scale: Optional[torch.Tensor],
            save_input_t: bool, out_dtype: torch.dtype, fast_accum: bool, unit_offset: bool = False,
            act: int = SILU, want_stats: bool = False, act_dtype: torch.dtype = _E4M3, granularity: int = 0,
            w_amax: Optional[Sequence[torch.Tensor]] = None) -> Fwd:
    """The forward of a block; ``act_dtype``: the FP8 format of its activations and weight;
    ``granularity``: ``GRANULARITY_IDS``' id of the recipe's scaling; ``w_amax``: one fp32 [1]
    per weight, its amax from the optimizer step that wrote it (``coat.nn.weight_amax``), or None
    (an amax pass)."""
    kind = NORM_KINDS["unit_offset" if unit_offset else "scaled"]
    op = _fwd if _plain(x2, weights) else block_fwd  # eager: no dispatcher, no empty placeholders
    out, ws, s0, s1, s2, st_in, st_scale = op(x2, pre, norm_weight, eps, e8m0, list(weights), w_codes, w_scale,
                                              save_input_t, out_dtype, fast_accum, kind, act, want_stats,
                                              _FMT[act_dtype], granularity, list(w_amax or ()))
    stats = want_stats and pre != NONE
    if pre == NONE:  # the transposed input codes come as bytes: saved as what they are
        s0 = s0.view(act_dtype) if save_input_t else None
        s1 = s1 if save_input_t or not granularity else None
    saved = (s0, s1, s2 if pre == NORM else None)
    return Fwd(out, None if w_codes is not None else ws, saved, st_in if stats else None,
               st_scale if stats and not granularity else None)


class Bwd(NamedTuple):
    dx: torch.Tensor
    dnorm: Optional[torch.Tensor]  # fp32, with a norm
    dw: Optional[torch.Tensor]
    d_scale: Optional[torch.Tensor]  # the output gradient's per-tensor scale (None with row/block scaling)
    stat_in: Optional[torch.Tensor]  # with stats and dW: the recomputed GEMM input (pre-ops only)
    stat_scale: Optional[torch.Tensor]  # ... and (per tensor) its scale
    dx_amax: Optional[torch.Tensor] = None  # dx's amax from the SwiGLU backward that wrote it (group scaling)


def backward(d2: torch.Tensor, pre: int, need_w: bool, weights: Sequence[torch.Tensor], w_scale: torch.Tensor,
             w_codes_t: Optional[torch.Tensor], saved: Sequence[Optional[torch.Tensor]],
             norm_weight: Optional[torch.Tensor], wgrad_input: Optional[torch.Tensor], y_dtype: torch.dtype,
             wgrad_dtype: torch.dtype, unit_offset: bool = False, act: int = SILU, want_stats: bool = False,
             act_dtype: torch.dtype = _E4M3, grad_dtype: torch.dtype = torch.float8_e5m2, granularity: int = 0,
             dout_amax: Optional[torch.Tensor] = None) -> Bwd:
    """The backward of a block; ``act_dtype``, ``grad_dtype``: the FP8 formats of its forward's
    activations and weight, and of its output gradient; ``dout_amax``: d2's amax as its producer
    wrote it (``Bwd.dx_amax`` of the block downstream), or None."""
    kind = NORM_KINDS["unit_offset" if unit_offset else "scaled"]
    s0, s1, s2 = saved
    op = _bwd if _plain(d2, weights) else block_bwd
    dx, dnorm, dw, ds, st_in, st_scale, dx_amax = op(d2, pre, need_w, list(weights), w_scale, w_codes_t, s0, s1, s2,
                                                     norm_weight, wgrad_input, y_dtype, wgrad_dtype, kind, act,
                                                     want_stats, _FMT[act_dtype], _FMT[grad_dtype], granularity,
                                                     dout_amax)
    stats = want_stats and need_w
    return Bwd(dx, dnorm if pre == NORM else None, dw if need_w else None, None if granularity else ds,
               st_in if stats and pre != NONE else None,
               st_scale if stats and not granularity and (pre != NONE or wgrad_input is not None) else None,
               dx_amax if dx_amax is not None and dx_amax.numel() else None)
