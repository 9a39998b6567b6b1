"""Custom ops of the quantize family (FP8 per-tensor, per-group and DRE quantization).

FP8 codes are uint8 tensors here and the format is an int (0 = e4m3, 1 = e5m2): torch's op
checkers cannot compare FP8 tensors, and the core takes uint8 anyway. coat.functional views the
codes as torch.float8_* for users.
"""

from __future__ import annotations

import torch

from .. import _C
from ._util import dev_ctx, stream

_DRE_GROUP = _C.DRE_GROUP_SIZE
_U8 = torch.uint8


def _t_shape(x: torch.Tensor) -> tuple[int, int]:
    cols = x.shape[-1] if x.dim() else 1
    return (cols, x.numel() // cols if cols else 0)


def _new(shape, dtype, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=like.device)


# ---- per-tensor -------------------------------------------------------------------------------


@torch.library.custom_op("coat::quantize_per_tensor", mutates_args=())
def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor, fmt: int) -> torch.Tensor:
    q = _new(x.shape, _U8, x)
    with dev_ctx(x):
        _C.quantize_per_tensor(x.detach(), scale.detach(), q, None, fmt, stream(x))
    return q


@quantize_per_tensor.register_fake
def _(x, scale, fmt):
    return _new(x.shape, _U8, x)


@torch.library.custom_op("coat::quantize_per_tensor_t", mutates_args=())
def quantize_per_tensor_t(x: torch.Tensor, scale: torch.Tensor, fmt: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, q_t = _new(x.shape, _U8, x), _new(_t_shape(x), _U8, x)
    with dev_ctx(x):
        _C.quantize_per_tensor(x.detach(), scale.detach(), q, q_t, fmt, stream(x))
    return q, q_t


@quantize_per_tensor_t.register_fake
def _(x, scale, fmt):
    return _new(x.shape, _U8, x), _new(_t_shape(x), _U8, x)


@torch.library.custom_op("coat::quantize_per_tensor_amax", mutates_args=())
def quantize_per_tensor_amax(
    x: torch.Tensor, fmt: int, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (q, q_t, scale, amax); q_t is empty unless transpose."""
    q = _new(x.shape, _U8, x)
    q_t = _new(_t_shape(x) if transpose else (0,), _U8, x)
    scale, amax = _new(1, torch.float32, x), _new(1, torch.float32, x)
    with dev_ctx(x):
        _C.quantize_per_tensor_amax(x.detach(), amax, scale, q, q_t if transpose else None, fmt, stream(x))
    return q, q_t, scale, amax


@quantize_per_tensor_amax.register_fake
def _(x, fmt, transpose):
    return (
        _new(x.shape, _U8, x),
        _new(_t_shape(x) if transpose else (0,), _U8, x),
        _new(1, torch.float32, x),
        _new(1, torch.float32, x),
    )


@torch.library.custom_op("coat::dequantize_per_tensor", mutates_args=())
def dequantize_per_tensor(q: torch.Tensor, scale: torch.Tensor, fmt: int, dtype: torch.dtype) -> torch.Tensor:
    y = _new(q.shape, dtype, q)
    with dev_ctx(q):
        _C.dequantize_per_tensor(q.detach(), scale.detach(), y, fmt, stream(q))
    return y


@dequantize_per_tensor.register_fake
def _(q, scale, fmt, dtype):
    return _new(q.shape, dtype, q)


# ---- per-group --------------------------------------------------------------------------------


def _scales_shape(x: torch.Tensor, group_size: int) -> tuple[int, ...]:
    return (*x.shape[:-1], x.shape[-1] // group_size) if x.dim() else (0,)


@torch.library.custom_op("coat::quantize_per_group", mutates_args=())
def quantize_per_group(x: torch.Tensor, group_size: int, fmt: int, e8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension for per-group quantization")
    q = _new(x.shape, _U8, x)
    scales = _new(_scales_shape(x, group_size), _U8 if e8m0 else torch.float32, x)
    with dev_ctx(x):
        _C.quantize_per_group(x.detach(), scales, q, group_size, fmt, int(e8m0), stream(x))
    return q, scales


@quantize_per_group.register_fake
def _(x, group_size, fmt, e8m0):
    return _new(x.shape, _U8, x), _new(_scales_shape(x, group_size), _U8 if e8m0 else torch.float32, x)


@torch.library.custom_op("coat::dequantize_per_group", mutates_args=())
def dequantize_per_group(
    q: torch.Tensor, scales: torch.Tensor, group_size: int, fmt: int, dtype: torch.dtype
) -> torch.Tensor:
    y = _new(q.shape, dtype, q)
    kind = 1 if scales.dtype == _U8 else 0
    with dev_ctx(q):
        _C.dequantize_per_group(q.detach(), scales.detach(), y, group_size, fmt, kind, stream(q))
    return y


@dequantize_per_group.register_fake
def _(q, scales, group_size, fmt, dtype):
    return _new(q.shape, dtype, q)


# ---- Dynamic Range Expansion ------------------------------------------------------------------


def _dre_groups(n: int) -> int:
    return (n + _DRE_GROUP - 1) // _DRE_GROUP


@torch.library.custom_op("coat::dre_quantize", mutates_args=())
def dre_quantize(x: torch.Tensor, fmt: int, log2_range: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _dre_groups(x.numel())
    q, gmax, k16 = _new(x.shape, _U8, x), _new(g, torch.float32, x), _new(g, _U8, x)
    with dev_ctx(x):
        _C.dre_quantize(x.detach(), q, gmax, k16, fmt, log2_range, stream(x))
    return q, gmax, k16


@dre_quantize.register_fake
def _(x, fmt, log2_range):
    g = _dre_groups(x.numel())
    return _new(x.shape, _U8, x), _new(g, torch.float32, x), _new(g, _U8, x)


@torch.library.custom_op("coat::dre_dequantize", mutates_args=())
def dre_dequantize(q: torch.Tensor, gmax: torch.Tensor, k16: torch.Tensor, fmt: int) -> torch.Tensor:
    y = _new(q.shape, torch.float32, q)
    with dev_ctx(q):
        _C.dre_dequantize(q.detach(), gmax.detach(), k16.detach(), y, fmt, stream(q))
    return y


@dre_dequantize.register_fake
def _(q, gmax, k16, fmt):
    return _new(q.shape, torch.float32, q)
