"""Custom ops of the swiglu family: h = act(gate) * up over a fused [.., 2I] gate/up output, with
the pre-activations saved in FP8 (1 x 16 groups).

``act`` is the gate's activation, one of the core's GatedAct ids (csrc/include/coat/swiglu.h has the
formulas and roundings): ``SILU`` (SwiGLU, the default) or ``GELU_TANH`` (GeGLU with torch's
``gelu(approximate="tanh")``, transformers' "gelu_pytorch_tanh"). The backward takes the act of the
forward that saved its input.
"""

from __future__ import annotations

import torch

from .. import _C
from ._util import custom_op
from ._util import dev_ctx as _dev_ctx
from ._util import fmt_id as _fmt_id
from ._util import stream as _stream
from .enums import GATED_ACTS

GROUP = 16
SILU, GELU_TANH = GATED_ACTS["silu"], GATED_ACTS["gelu_tanh"]  # the gate's activation (``act``)


def _h_shape(gu: torch.Tensor) -> tuple[int, ...]:
    return (*gu.shape[:-1], gu.shape[-1] // 2)


def _scales(shape, e8m0: bool, device) -> torch.Tensor:
    return torch.empty((*shape[:-1], shape[-1] // GROUP), dtype=torch.uint8 if e8m0 else torch.float32, device=device)


@custom_op("coat::swiglu_fwd", mutates_args=())
def swiglu_fwd(
    gate_up: torch.Tensor, quantize: bool, fp8_dtype: torch.dtype, e8m0: bool, act: int = SILU
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (h, q, scales); q and scales are empty unless ``quantize``."""
    with _dev_ctx(gate_up):
        return _C.swiglu_fwd(gate_up, quantize, _fmt_id(fp8_dtype), e8m0, act, _stream(gate_up))


@swiglu_fwd.register_fake
def _(gate_up, quantize, fp8_dtype, e8m0, act=SILU):
    return (
        gate_up.new_empty(_h_shape(gate_up)),
        gate_up.new_empty(gate_up.shape if quantize else (0,), dtype=fp8_dtype),
        _scales(gate_up.shape, e8m0, gate_up.device) if quantize else gate_up.new_empty(0, dtype=torch.float32),
    )


@custom_op("coat::swiglu_bwd", mutates_args=())
def swiglu_bwd(
    q: torch.Tensor, scales: torch.Tensor, dh: torch.Tensor, recompute_h: bool, act: int = SILU
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dgate_up, h); h (act(g) * u from the FP8 copy) is empty unless ``recompute_h``."""
    with _dev_ctx(q):
        return _C.swiglu_bwd(q, scales, dh, recompute_h, _fmt_id(q.dtype, "q"), act, _stream(q))


@swiglu_bwd.register_fake
def _(q, scales, dh, recompute_h, act=SILU):
    return dh.new_empty(q.shape), dh.new_empty(dh.shape if recompute_h else (0,))
