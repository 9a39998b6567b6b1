"""Custom ops of the quantize family (FP8 per-tensor, per-group and DRE quantization).

FP8 codes are uint8 tensors here and the format is the core's int (``enums.FP8_FORMATS``): torch's
op checkers cannot compare FP8 tensors, and the core takes uint8 anyway. coat.functional views the
codes as torch.float8_* for users.
"""

from __future__ import annotations

import torch

from .. import _C
from ._util import custom_op
from ._util import dev_ctx, dtype_id, stream
from .enums import SCALE_KINDS

_DRE_GROUP = _C.DRE_GROUP_SIZE
#: The core's DRE group size and, per FP8 format, the log2 of its dynamic range (what DRE expands to).
DRE_GROUP_SIZE: int = _C.DRE_GROUP_SIZE
DRE_LOG2_RANGE: dict[str, float] = {"e4m3": _C.DRE_LOG2_RANGE_E4M3, "e5m2": _C.DRE_LOG2_RANGE_E5M2}
_U8 = torch.uint8


def _t_shape(x: torch.Tensor) -> tuple[int, int]:
    cols = x.shape[-1] if x.dim() else 1
    return (cols, x.numel() // cols if cols else 0)


def _new(shape, dtype, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=like.device)


# ---- per-tensor -------------------------------------------------------------------------------


@custom_op("coat::quantize_per_tensor", mutates_args=())
def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor, fmt: int) -> torch.Tensor:
    with dev_ctx(x):
        return _C.quantize_per_tensor(x, scale, fmt, False, stream(x))[0]


@quantize_per_tensor.register_fake
def _(x, scale, fmt):
    return _new(x.shape, _U8, x)


@custom_op("coat::quantize_per_tensor_t", mutates_args=())
def quantize_per_tensor_t(x: torch.Tensor, scale: torch.Tensor, fmt: int) -> tuple[torch.Tensor, torch.Tensor]:
    with dev_ctx(x):
        return _C.quantize_per_tensor(x, scale, fmt, True, stream(x))


@quantize_per_tensor_t.register_fake
def _(x, scale, fmt):
    return _new(x.shape, _U8, x), _new(_t_shape(x), _U8, x)


@custom_op("coat::quantize_per_tensor_amax", mutates_args=())
def quantize_per_tensor_amax(
    x: torch.Tensor, fmt: int, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (q, q_t, scale, amax); q_t is empty unless transpose."""
    with dev_ctx(x):
        return _C.quantize_per_tensor_amax(x, fmt, transpose, stream(x))


@quantize_per_tensor_amax.register_fake
def _(x, fmt, transpose):
    return (
        _new(x.shape, _U8, x),
        _new(_t_shape(x) if transpose else (0,), _U8, x),
        _new(1, torch.float32, x),
        _new(1, torch.float32, x),
    )


# ---- stacked row blocks (fused projections' weights) -------------------------------------------


def _stacked_shapes(parts, rowmajor: bool, transpose: bool):
    rows = sum(p.shape[0] for p in parts)
    cols = parts[0].shape[1]
    return ((rows, cols) if rowmajor else (0,)), ((cols, rows) if transpose else (0,))


def _first(parts) -> torch.Tensor:
    """parts[0], whose device and stream the call runs on (the binding checks the rest)."""
    if not parts:
        raise ValueError("parts must hold at least one tensor")
    return parts[0]


def _check_stacked(parts, rowmajor: bool, transpose: bool) -> None:
    _first(parts)
    if not (rowmajor or transpose):
        raise ValueError("ask for rowmajor codes, transposed codes or both")
    for i, p in enumerate(parts):  # the bindings' messages, for the fake implementations
        if p.dim() != 2:
            raise ValueError(f"parts[{i}] must be 2-D, got shape {list(p.shape)}")
        if p.shape[1] != parts[0].shape[1]:
            raise ValueError(f"parts[{i}] has {p.shape[1]} columns but parts[0] has {parts[0].shape[1]}")


@custom_op("coat::quantize_stacked_amax", mutates_args=())
def quantize_stacked_amax(
    parts: list[torch.Tensor], fmt: int, rowmajor: bool, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 of X = cat(parts, 0), read where the parts lie (no concatenated copy), with
    its scale from max |X| computed on the device: (q [R, K] or empty, q_t [K, R] or empty, scale)."""
    x = _first(parts)
    with dev_ctx(x):
        return _C.quantize_stacked(parts, None, fmt, rowmajor, transpose, stream(x))


@quantize_stacked_amax.register_fake
def _(parts, fmt, rowmajor, transpose):
    _check_stacked(parts, rowmajor, transpose)
    qs, ts = _stacked_shapes(parts, rowmajor, transpose)
    return _new(qs, _U8, parts[0]), _new(ts, _U8, parts[0]), _new(1, torch.float32, parts[0])


@custom_op("coat::quantize_stacked", mutates_args=())
def quantize_stacked(
    parts: list[torch.Tensor], scale: torch.Tensor, fmt: int, rowmajor: bool, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """As quantize_stacked_amax with a given scale (no amax pass): (q or empty, q_t or empty)."""
    x = _first(parts)
    with dev_ctx(x):
        return _C.quantize_stacked(parts, scale, fmt, rowmajor, transpose, stream(x))


@quantize_stacked.register_fake
def _(parts, scale, fmt, rowmajor, transpose):
    _check_stacked(parts, rowmajor, transpose)
    qs, ts = _stacked_shapes(parts, rowmajor, transpose)
    return _new(qs, _U8, parts[0]), _new(ts, _U8, parts[0])


@custom_op("coat::transpose_stacked_codes", mutates_args=())
def transpose_stacked_codes(parts: list[torch.Tensor]) -> torch.Tensor:
    """The transpose [K, R] of stacked FP8 codes cat(parts, 0) (uint8 [rows_i, K] each), read where
    the parts lie: one pass, no concatenated copy."""
    x = _first(parts)
    with dev_ctx(x):
        return _C.transpose_stacked_codes(parts, stream(x))


@transpose_stacked_codes.register_fake
def _(parts):
    _check_stacked(parts, False, True)
    return _new(_stacked_shapes(parts, False, True)[1], _U8, parts[0])


@custom_op("coat::amax_stacked", mutates_args=())
def amax_stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """max |X| over the finite values of X = cat(parts, 0) (fp32 [1]), read where the parts lie:
    quantize_stacked_amax's amax pass alone."""
    x = _first(parts)
    with dev_ctx(x):
        return _C.amax_stacked(parts, stream(x))


@amax_stacked.register_fake
def _(parts):
    _first(parts)
    return _new(1, torch.float32, parts[0])


# FP8 all-gather's refresh of an FSDP2 unit runs eagerly inside FSDP2's hooks: these two take all
# of the unit's weight groups in one call each (no op per group; a list of lists is no op schema).


def amax_groups(groups: list[list[torch.Tensor]]) -> torch.Tensor:
    """amax_stacked of each group of parts: fp32 [len(groups)]. Eager only."""
    x = _first(_first(groups))
    with dev_ctx(x):
        return _C.amax_groups(groups, stream(x))


def quantize_groups_from_amax(groups: list[list[torch.Tensor]], amax: torch.Tensor,
                              fmt: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """quantize_stacked_from_amax of each group with amax[i]: [(q_i, scale_i)]. Eager only."""
    x = _first(_first(groups))
    with dev_ctx(x):
        return _C.quantize_groups_from_amax(groups, amax, fmt, stream(x))


@custom_op("coat::quantize_stacked_from_amax", mutates_args=())
def quantize_stacked_from_amax(parts: list[torch.Tensor], amax: torch.Tensor,
                               fmt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [R, K], scale) of X = cat(parts, 0) with the scale of a given amax (fp32 [1]): bit for bit
    what quantize_stacked_amax gives when amax is the one it would find (one pass, no amax pass)."""
    x = _first(parts)
    with dev_ctx(x):
        return _C.quantize_stacked_from_amax(parts, amax, fmt, stream(x))


@quantize_stacked_from_amax.register_fake
def _(parts, amax, fmt):
    _check_stacked(parts, True, False)
    return _new(_stacked_shapes(parts, True, False)[0], _U8, parts[0]), _new(1, torch.float32, parts[0])


def quantize_stacked_from_part_amax(parts: list[torch.Tensor], part_amax: list[torch.Tensor],
                                    fmt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [R, K], scale) of X = cat(parts, 0) with the scale of the max of ``part_amax`` (one fp32 [1]
    per part, its amax as the optimizer recorded it): the layer block's weight path with the
    optimizer's amax (``coat.nn.weight_amax``). A finite value above the largest given amax
    encodes as NaN. Eager only (tests and diagnostics)."""
    x = _first(parts)
    with dev_ctx(x):
        return _C.quantize_stacked_from_part_amax(parts, part_amax, fmt, stream(x))


@custom_op("coat::dequantize_per_tensor", mutates_args=())
def dequantize_per_tensor(q: torch.Tensor, scale: torch.Tensor, fmt: int, dtype: torch.dtype) -> torch.Tensor:
    with dev_ctx(q):
        return _C.dequantize_per_tensor(q, scale, fmt, dtype_id(dtype), stream(q))


@dequantize_per_tensor.register_fake
def _(q, scale, fmt, dtype):
    return _new(q.shape, dtype, q)


# ---- per-group --------------------------------------------------------------------------------


def _scales_shape(x: torch.Tensor, group_size: int) -> tuple[int, ...]:
    return (*x.shape[:-1], x.shape[-1] // group_size) if x.dim() else (0,)


@custom_op("coat::quantize_per_group", mutates_args=())
def quantize_per_group(x: torch.Tensor, group_size: int, fmt: int, e8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    with dev_ctx(x):
        return _C.quantize_per_group(x, group_size, fmt, SCALE_KINDS["e8m0" if e8m0 else "fp32"], stream(x))


@quantize_per_group.register_fake
def _(x, group_size, fmt, e8m0):
    return _new(x.shape, _U8, x), _new(_scales_shape(x, group_size), _U8 if e8m0 else torch.float32, x)


@custom_op("coat::dequantize_per_group", mutates_args=())
def dequantize_per_group(
    q: torch.Tensor, scales: torch.Tensor, group_size: int, fmt: int, dtype: torch.dtype
) -> torch.Tensor:
    with dev_ctx(q):
        return _C.dequantize_per_group(q, scales, group_size, fmt, dtype_id(dtype), stream(q))


@dequantize_per_group.register_fake
def _(q, scales, group_size, fmt, dtype):
    return _new(q.shape, dtype, q)


# ---- Dynamic Range Expansion ------------------------------------------------------------------


def _dre_groups(n: int) -> int:
    return (n + _DRE_GROUP - 1) // _DRE_GROUP


@custom_op("coat::dre_quantize", mutates_args=())
def dre_quantize(x: torch.Tensor, fmt: int, log2_range: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with dev_ctx(x):
        return _C.dre_quantize(x, fmt, log2_range, stream(x))


@dre_quantize.register_fake
def _(x, fmt, log2_range):
    g = _dre_groups(x.numel())
    return _new(x.shape, _U8, x), _new(g, torch.float32, x), _new(g, _U8, x)


@custom_op("coat::dre_dequantize", mutates_args=())
def dre_dequantize(q: torch.Tensor, gmax: torch.Tensor, k16: torch.Tensor, fmt: int) -> torch.Tensor:
    with dev_ctx(q):
        return _C.dre_dequantize(q, gmax, k16, fmt, stream(q))


@dre_dequantize.register_fake
def _(q, gmax, k16, fmt):
    return _new(q.shape, torch.float32, q)


@custom_op("coat::fp8_operand_stats", mutates_args=("counts", "amax"))
def fp8_operand_stats(x: torch.Tensor, scale: torch.Tensor, half_sub: float, clip: float, counts: torch.Tensor,
                      amax: torch.Tensor) -> None:
    """Adds x's FP8 statistics (coat/operand_stats.h) to ``counts`` (int64 [3]: non-zero, underflow,
    saturated) and ``amax`` (fp32, one value), in place, on x's device, without a sync."""
    with dev_ctx(x):
        _C.fp8_operand_stats(x, scale, half_sub, clip, counts, amax, stream(x))


@fp8_operand_stats.register_fake
def _(x, scale, half_sub, clip, counts, amax):
    return None


# ---- scaled GEMM operands (row and block granularity) ------------------------------------------

#: coat::ScaleMode by name: "tensor", "row", "1x128", "128x128" (layouts: csrc/include/coat/common.h).
SCALE_MODES: dict[str, int] = dict(_C.SCALE_MODES)
_BLOCK = 128


def scale_count(mode: str, rows: int, k: int) -> int:
    """The number of fp32 scales of an operand [rows, k] in ``mode`` (coat::scale_count)."""
    kb = -(-k // _BLOCK)
    return {"tensor": 1, "row": rows, "1x128": kb * rows, "128x128": -(-rows // _BLOCK) * (-(-kb // 4) * 4)}[mode]


def _scaled_shapes(rows_pad: int, cols_pad: int, mode: str | None, mode_t: str | None):
    return (((rows_pad, cols_pad), (scale_count(mode, rows_pad, cols_pad),)) if mode else (None, None),
            ((cols_pad, rows_pad), (scale_count(mode_t, cols_pad, rows_pad),)) if mode_t else (None, None))


def quantize_scaled(parts: list[torch.Tensor], rows_pad: int, cols_pad: int, fmt: int, mode: str | None,
                    mode_t: str | None):
    """(q, scale, q_t, scale_t): the stacked float ``parts`` ([R, cols] together) as a GEMM operand
    q [rows_pad, cols_pad] in ``mode`` and/or its transpose q_t [cols_pad, rows_pad] in ``mode_t``
    ("row", "1x128", "128x128"; None: not made, None returned), zero-padded; scales fp32 in the
    modes' layouts (``scale_count``). See coat::quantize_scaled."""
    for name, m in (("mode", mode), ("mode_t", mode_t)):
        if m is not None and m not in SCALE_MODES:
            raise ValueError(f"{name} must be one of {sorted(SCALE_MODES)} or None, got {m!r}")
    x = parts[0]
    with dev_ctx(x):
        return _C.quantize_scaled(list(parts), rows_pad, cols_pad, fmt, SCALE_MODES[mode] if mode else -1,
                                  SCALE_MODES[mode_t] if mode_t else -1, stream(x))
