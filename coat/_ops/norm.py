"""Custom ops of the norm family: RMSNorm whose saved input is FP8 (1 x 16 groups) plus rstd."""

from __future__ import annotations

import torch

from .. import _C
from ._util import custom_op
from ._util import dev_ctx as _dev_ctx
from ._util import dtype_id as _dtype_id
from ._util import fmt_id as _fmt_id
from ._util import stream as _stream

GROUP = 16


def _scales(shape, e8m0: bool, device) -> torch.Tensor:
    return torch.empty((*shape[:-1], shape[-1] // GROUP), dtype=torch.uint8 if e8m0 else torch.float32, device=device)


@custom_op("coat::rmsnorm_fwd", mutates_args=())
def rmsnorm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: bool, fp8_dtype: torch.dtype, e8m0: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, rstd, q, scales); q and scales are empty unless ``quantize``."""
    with _dev_ctx(x):
        return _C.rmsnorm_fwd(x, weight, eps, quantize, _fmt_id(fp8_dtype), e8m0, _stream(x))


@rmsnorm_fwd.register_fake
def _(x, weight, eps, quantize, fp8_dtype, e8m0):
    return (
        x.new_empty(x.shape),
        x.new_empty(x.shape[:-1], dtype=torch.float32),
        x.new_empty(x.shape if quantize else (0,), dtype=fp8_dtype),
        _scales(x.shape, e8m0, x.device) if quantize else x.new_empty(0, dtype=torch.float32),
    )


@custom_op("coat::rmsnorm_fwd_fp8", mutates_args=())
def rmsnorm_fwd_fp8(
    q: torch.Tensor, scales: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """y recomputed from the saved FP8 input: T(T(x~ * rstd) * weight)."""
    with _dev_ctx(q):
        return _C.rmsnorm_fwd_fp8(q, scales, rstd, weight, _dtype_id(dtype), _fmt_id(q.dtype, "q"), _stream(q))


@rmsnorm_fwd_fp8.register_fake
def _(q, scales, rstd, weight, dtype):
    return q.new_empty(q.shape, dtype=dtype)


@custom_op("coat::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd(
    q: torch.Tensor, scales: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx in dy's dtype, dweight in fp32), dweight reduced deterministically."""
    with _dev_ctx(q):
        return _C.rmsnorm_bwd(q, scales, rstd, weight, dy, _fmt_id(q.dtype, "q"), _stream(q))


@rmsnorm_bwd.register_fake
def _(q, scales, rstd, weight, dy):
    return dy.new_empty(dy.shape), q.new_empty(q.shape[-1], dtype=torch.float32)
