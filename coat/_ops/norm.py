"""Custom ops of the norm family: RMSNorm whose saved input is FP8 (1 x 16 groups) plus rstd.

``unit_offset`` picks how the weight applies (csrc/include/coat/norm.h): False, Llama's
``T(T(h) * w)``; True, Gemma's ``T(h * (1 + w))`` in fp32 with one rounding (its weight stored as an
offset from 1). The backward takes the same flag as the forward that saved its inputs.
"""

from __future__ import annotations

import torch

from .. import _C
from ._util import custom_op
from ._util import dev_ctx as _dev_ctx
from ._util import dtype_id as _dtype_id
from ._util import fmt_id as _fmt_id
from ._util import stream as _stream
from .enums import NORM_KINDS

GROUP = 16
SCALED, UNIT_OFFSET = NORM_KINDS["scaled"], NORM_KINDS["unit_offset"]  # the core's NormKind ids


def kind_id(unit_offset: bool) -> int:
    """The core's NormKind id for the ops' ``unit_offset`` flag."""
    return UNIT_OFFSET if unit_offset else SCALED


def _scales(shape, e8m0: bool, device) -> torch.Tensor:
    return torch.empty((*shape[:-1], shape[-1] // GROUP), dtype=torch.uint8 if e8m0 else torch.float32, device=device)


@custom_op("coat::rmsnorm_fwd", mutates_args=())
def rmsnorm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: bool, fp8_dtype: torch.dtype, e8m0: bool,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, rstd, q, scales); q and scales are empty unless ``quantize``."""
    with _dev_ctx(x):
        return _C.rmsnorm_fwd(x, weight, eps, quantize, _fmt_id(fp8_dtype), e8m0, kind_id(unit_offset), _stream(x))


@rmsnorm_fwd.register_fake
def _(x, weight, eps, quantize, fp8_dtype, e8m0, unit_offset=False):
    return (
        x.new_empty(x.shape),
        x.new_empty(x.shape[:-1], dtype=torch.float32),
        x.new_empty(x.shape if quantize else (0,), dtype=fp8_dtype),
        _scales(x.shape, e8m0, x.device) if quantize else x.new_empty(0, dtype=torch.float32),
    )


@custom_op("coat::rmsnorm_fwd_fp8", mutates_args=())
def rmsnorm_fwd_fp8(
    q: torch.Tensor, scales: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype,
    unit_offset: bool = False,
) -> torch.Tensor:
    """y recomputed from the saved FP8 input with the forward's formula: T(T(x~ * rstd) * weight),
    or T(x~ * rstd * (1 + weight)) with ``unit_offset``."""
    with _dev_ctx(q):
        return _C.rmsnorm_fwd_fp8(q, scales, rstd, weight, _dtype_id(dtype), _fmt_id(q.dtype, "q"),
                                  kind_id(unit_offset), _stream(q))


@rmsnorm_fwd_fp8.register_fake
def _(q, scales, rstd, weight, dtype, unit_offset=False):
    return q.new_empty(q.shape, dtype=dtype)


@custom_op("coat::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd(
    q: torch.Tensor, scales: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx in dy's dtype, dweight in fp32), dweight reduced deterministically; with
    ``unit_offset`` the effective weight is 1 + weight (dweight is the same sum of dy * x_hat)."""
    with _dev_ctx(q):
        return _C.rmsnorm_bwd(q, scales, rstd, weight, dy, _fmt_id(q.dtype, "q"), kind_id(unit_offset), _stream(q))


@rmsnorm_bwd.register_fake
def _(q, scales, rstd, weight, dy, unit_offset=False):
    return dy.new_empty(dy.shape), q.new_empty(q.shape[-1], dtype=torch.float32)
