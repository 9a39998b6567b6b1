"""Custom ops of the quantize family (FP8 per-tensor, per-group and DRE quantization)."""

from __future__ import annotations

import torch

from .. import _C
from ._util import dev_ctx as _dev_ctx
from ._util import fmt_id as _fmt_id
from ._util import stream as _stream
from ._util import u8 as _u8

_DRE_GROUP = _C.DRE_GROUP_SIZE




# ---- per-tensor -------------------------------------------------------------------------------


@torch.library.custom_op("coat::quantize_per_tensor", mutates_args=())
def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    fmt = _fmt_id(fp8_dtype)
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    with _dev_ctx(x):
        _C.quantize_per_tensor(x.detach(), scale.detach(), _u8(q), None, fmt, _stream(x))
    return q


@quantize_per_tensor.register_fake
def _(x, scale, fp8_dtype):
    return torch.empty(x.shape, dtype=fp8_dtype, device=x.device)


@torch.library.custom_op("coat::quantize_per_tensor_t", mutates_args=())
def quantize_per_tensor_t(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = _fmt_id(fp8_dtype)
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    q_t = torch.empty(_t_shape(x), dtype=fp8_dtype, device=x.device)
    with _dev_ctx(x):
        _C.quantize_per_tensor(x.detach(), scale.detach(), _u8(q), _u8(q_t), fmt, _stream(x))
    return q, q_t


def _t_shape(x: torch.Tensor) -> tuple[int, int]:
    cols = x.shape[-1] if x.dim() else 1
    return (cols, x.numel() // cols if cols else 0)


@quantize_per_tensor_t.register_fake
def _(x, scale, fp8_dtype):
    return (
        torch.empty(x.shape, dtype=fp8_dtype, device=x.device),
        torch.empty(_t_shape(x), dtype=fp8_dtype, device=x.device),
    )


@torch.library.custom_op("coat::quantize_per_tensor_amax", mutates_args=())
def quantize_per_tensor_amax(
    x: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (q, q_t, scale, amax); q_t is an empty tensor unless transpose."""
    fmt = _fmt_id(fp8_dtype)
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    q_t = torch.empty(_t_shape(x) if transpose else (0,), dtype=fp8_dtype, device=x.device)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    amax = torch.empty(1, dtype=torch.float32, device=x.device)
    with _dev_ctx(x):
        _C.quantize_per_tensor_amax(
            x.detach(), amax, scale, _u8(q), _u8(q_t) if transpose else None, fmt, _stream(x)
        )
    return q, q_t, scale, amax


@quantize_per_tensor_amax.register_fake
def _(x, fp8_dtype, transpose):
    return (
        torch.empty(x.shape, dtype=fp8_dtype, device=x.device),
        torch.empty(_t_shape(x) if transpose else (0,), dtype=fp8_dtype, device=x.device),
        torch.empty(1, dtype=torch.float32, device=x.device),
        torch.empty(1, dtype=torch.float32, device=x.device),
    )


@torch.library.custom_op("coat::dequantize_per_tensor", mutates_args=())
def dequantize_per_tensor(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fmt = _fmt_id(q.dtype, "q")
    y = torch.empty(q.shape, dtype=dtype, device=q.device)
    with _dev_ctx(q):
        _C.dequantize_per_tensor(_u8(q.detach()), scale.detach(), y, fmt, _stream(q))
    return y


@dequantize_per_tensor.register_fake
def _(q, scale, dtype):
    return torch.empty(q.shape, dtype=dtype, device=q.device)


# ---- per-group --------------------------------------------------------------------------------


def _scales_shape(x: torch.Tensor, group_size: int) -> tuple[int, ...]:
    if x.dim() == 0:
        return (0,)
    return (*x.shape[:-1], x.shape[-1] // group_size)


@torch.library.custom_op("coat::quantize_per_group", mutates_args=())
def quantize_per_group(
    x: torch.Tensor, group_size: int, fp8_dtype: torch.dtype, e8m0: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = _fmt_id(fp8_dtype)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension for per-group quantization")
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scales = torch.empty(
        _scales_shape(x, group_size), dtype=torch.uint8 if e8m0 else torch.float32, device=x.device
    )
    with _dev_ctx(x):
        _C.quantize_per_group(x.detach(), scales, _u8(q), group_size, fmt, int(e8m0), _stream(x))
    return q, scales


@quantize_per_group.register_fake
def _(x, group_size, fp8_dtype, e8m0):
    return (
        torch.empty(x.shape, dtype=fp8_dtype, device=x.device),
        torch.empty(_scales_shape(x, group_size), dtype=torch.uint8 if e8m0 else torch.float32, device=x.device),
    )


@torch.library.custom_op("coat::dequantize_per_group", mutates_args=())
def dequantize_per_group(
    q: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    fmt = _fmt_id(q.dtype, "q")
    y = torch.empty(q.shape, dtype=dtype, device=q.device)
    kind = 1 if scales.dtype == torch.uint8 else 0
    with _dev_ctx(q):
        _C.dequantize_per_group(_u8(q.detach()), scales.detach(), y, group_size, fmt, kind, _stream(q))
    return y


@dequantize_per_group.register_fake
def _(q, scales, group_size, dtype):
    return torch.empty(q.shape, dtype=dtype, device=q.device)


# ---- Dynamic Range Expansion ------------------------------------------------------------------


def _dre_groups(n: int) -> int:
    return (n + _DRE_GROUP - 1) // _DRE_GROUP


@torch.library.custom_op("coat::dre_quantize", mutates_args=())
def dre_quantize(
    x: torch.Tensor, fp8_dtype: torch.dtype, log2_range: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fmt = _fmt_id(fp8_dtype)
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    g = _dre_groups(x.numel())
    gmax = torch.empty(g, dtype=torch.float32, device=x.device)
    k16 = torch.empty(g, dtype=torch.uint8, device=x.device)
    with _dev_ctx(x):
        _C.dre_quantize(x.detach(), _u8(q), gmax, k16, fmt, log2_range, _stream(x))
    return q, gmax, k16


@dre_quantize.register_fake
def _(x, fp8_dtype, log2_range):
    g = _dre_groups(x.numel())
    return (
        torch.empty(x.shape, dtype=fp8_dtype, device=x.device),
        torch.empty(g, dtype=torch.float32, device=x.device),
        torch.empty(g, dtype=torch.uint8, device=x.device),
    )


@torch.library.custom_op("coat::dre_dequantize", mutates_args=())
def dre_dequantize(q: torch.Tensor, gmax: torch.Tensor, k16: torch.Tensor) -> torch.Tensor:
    fmt = _fmt_id(q.dtype, "q")
    y = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    with _dev_ctx(q):
        _C.dre_dequantize(_u8(q.detach()), gmax.detach(), k16.detach(), y, fmt, _stream(q))
    return y


@dre_dequantize.register_fake
def _(q, gmax, k16):
    return torch.empty(q.shape, dtype=torch.float32, device=q.device)
