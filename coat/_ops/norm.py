"""Custom ops of the norm family: RMSNorm whose saved input is FP8 (1 x 16 groups) plus rstd."""

from __future__ import annotations

import torch

from .. import _C
from ._util import custom_op
from ._util import dev_ctx as _dev_ctx
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
    fmt = _fmt_id(fp8_dtype)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    q = torch.empty(x.shape if quantize else (0,), dtype=fp8_dtype, device=x.device)
    s = _scales(x.shape, e8m0, x.device) if quantize else torch.empty(0, device=x.device)
    with _dev_ctx(x):
        _C.rmsnorm_fwd(x, weight, float(eps), y, rstd, q if quantize else None,
                       s if quantize else None, fmt, _stream(x))
    return y, rstd, q, s


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
    fmt = _fmt_id(q.dtype, "q")
    y = torch.empty(q.shape, dtype=dtype, device=q.device)
    with _dev_ctx(q):
        _C.rmsnorm_fwd_fp8(q, scales, rstd, weight, y, fmt, _stream(q))
    return y


@rmsnorm_fwd_fp8.register_fake
def _(q, scales, rstd, weight, dtype):
    return q.new_empty(q.shape, dtype=dtype)


@custom_op("coat::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd(
    q: torch.Tensor, scales: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx in dy's dtype, dweight in fp32), dweight reduced deterministically."""
    fmt = _fmt_id(q.dtype, "q")
    cols = q.shape[-1]
    rows = q.numel() // cols if cols else 0
    dx = torch.empty(dy.shape, dtype=dy.dtype, device=dy.device)
    ws = torch.empty((_C.rmsnorm_bwd_parts(rows), cols), dtype=torch.float32, device=q.device)
    dw = torch.empty(cols, dtype=torch.float32, device=q.device)
    with _dev_ctx(q):
        _C.rmsnorm_bwd(q, scales, rstd, weight, dy, dx, ws, dw,
                       fmt, _stream(q))
    return dx, dw


@rmsnorm_bwd.register_fake
def _(q, scales, rstd, weight, dy):
    return dy.new_empty(dy.shape), q.new_empty(q.shape[-1], dtype=torch.float32)
