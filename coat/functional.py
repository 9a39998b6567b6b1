"""Stateless FP8 functions over torch tensors (CPU and CUDA).

The numerics are specified in docs/numerics.md: scales are dequantization multipliers
(``x ~= q * scale``), rounding is to nearest even, values beyond the format's max saturate and NaN
stays NaN.
"""

from __future__ import annotations

import torch

from ._ops import quantize as _ops
from ._ops.enums import FP8_FORMATS
from .fp8.formats import DTYPES, GROUP_SIZES, MAX, SCALE_KINDS, format_name
from .fp8.tensor import DreTensor, Fp8Tensor

__all__ = [
    "quantize_per_tensor",
    "quantize_per_group",
    "dequantize",
    "dre_quantize",
    "dre_dequantize",
    "DRE_GROUP_SIZE",
]

DRE_GROUP_SIZE: int = _ops.DRE_GROUP_SIZE
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_input(x: torch.Tensor, arg: str = "x", dtypes=_FLOAT_DTYPES) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{arg} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{arg} must be {names}, got {str(x.dtype).replace('torch.', '')}")
    if not x.is_contiguous():
        raise ValueError(f"{arg} must be contiguous (call {arg}.contiguous() first)")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{arg} must be on a CPU or CUDA device, got {x.device}")


def _source(x: torch.Tensor) -> torch.Tensor | None:
    """x, when dequantizing its codes must be differentiable w.r.t. it (it requires grad, grad mode is on)."""
    return x if x.requires_grad and torch.is_grad_enabled() else None


def quantize_per_tensor(
    x: torch.Tensor,
    fmt: str | torch.dtype = "e4m3",
    *,
    scale: torch.Tensor | None = None,
    transpose: bool = False,
) -> Fp8Tensor:
    """Quantizes ``x`` with one scale for the whole tensor.

    With ``scale=None`` the amax is computed in the same call, on the device (no host sync), and
    ``scale = amax / fmt_max``. With ``transpose=True`` the result also carries ``data_t``, the
    codes of ``x.reshape(-1, K).T`` written in the same pass (the layout a weight-gradient GEMM
    reads).
    """
    _check_input(x)
    name = format_name(fmt)
    dt, fid = DTYPES[name], FP8_FORMATS[name]
    if scale is None:
        q, q_t, s, amax = _ops.quantize_per_tensor_amax(x.detach(), fid, transpose)
        return Fp8Tensor(q.view(dt), s, None, q_t.view(dt) if transpose else None, amax, source=_source(x))
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError("scale must be a float32 tensor with one element")
    if scale.device != x.device:
        raise ValueError(f"scale is on {scale.device} but x is on {x.device}")
    scale = scale.reshape(1)
    src = _source(x)
    limit = None if src is None else MAX[name] * scale.detach()
    if transpose:
        q, q_t = _ops.quantize_per_tensor_t(x.detach(), scale.detach(), fid)
        return Fp8Tensor(q.view(dt), scale, None, q_t.view(dt), source=src, grad_limit=limit)
    q = _ops.quantize_per_tensor(x.detach(), scale.detach(), fid)
    return Fp8Tensor(q.view(dt), scale, source=src, grad_limit=limit)


def quantize_per_group(
    x: torch.Tensor,
    group_size: int = 128,
    fmt: str | torch.dtype = "e4m3",
    *,
    scale_kind: str = "fp32",
) -> Fp8Tensor:
    """Quantizes ``x`` in groups of ``group_size`` consecutive elements along the last dimension,
    each with its own scale ``amax / fmt_max`` (``scale_kind="fp32"``) or the smallest power of two
    at least that (``"e8m0"``, one byte per group)."""
    _check_input(x)
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if scale_kind not in SCALE_KINDS:
        raise ValueError(f"scale_kind must be 'fp32' or 'e8m0', got {scale_kind!r}")
    if x.dim() == 0 or x.shape[-1] % group_size:
        last = x.shape[-1] if x.dim() else "a 0-d tensor"
        raise ValueError(f"group_size {group_size} does not divide the last dimension of x ({last})")
    name = format_name(fmt)
    q, s = _ops.quantize_per_group(x.detach(), group_size, FP8_FORMATS[name], scale_kind == "e8m0")
    return Fp8Tensor(q.view(DTYPES[name]), s, group_size, source=_source(x))


def dequantize(t: Fp8Tensor | DreTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of the quantize functions (DRE tensors always decode to fp32).

    Differentiable as a cast is: when the quantized ``x`` required grad (the quantized tensor then
    keeps a reference to it), the result's gradient flows to ``x`` straight through the rounding
    (not rounded itself), with the scale a constant; where a scale passed to
    ``quantize_per_tensor`` saturated ``x`` (``|x| > fmt_max * scale``) the gradient is 0."""
    if isinstance(t, DreTensor):
        return t.dequantize() if dtype == torch.float32 else t.dequantize().to(dtype)
    if not isinstance(t, Fp8Tensor):
        raise ValueError(f"t must be an Fp8Tensor or DreTensor, got {type(t).__name__}")
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    return t.dequantize(dtype)


def dre_quantize(x: torch.Tensor, fmt: str | torch.dtype = "e4m3", *, log2_range: float | None = None) -> DreTensor:
    """FP8 with Dynamic Range Expansion over groups of 128 consecutive elements of the flattened
    fp32 tensor (COAT's optimizer-state format). ``log2_range`` is log2 of the span of magnitudes
    expansion may fill within a group; the default depends on the format."""
    _check_input(x, dtypes=(torch.float32,))
    name = format_name(fmt)
    if log2_range is None:
        log2_range = _ops.DRE_LOG2_RANGE[name]
    if not (0.0 < float(log2_range) < 64.0):
        raise ValueError(f"log2_range must be in (0, 64), got {log2_range}")
    q, gmax, k16 = _ops.dre_quantize(x.detach(), FP8_FORMATS[name], float(log2_range))
    return DreTensor(q.view(DTYPES[name]), gmax, k16, source=_source(x))


def dre_dequantize(t: DreTensor) -> torch.Tensor:
    return t.dequantize()
