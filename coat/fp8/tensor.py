"""Containers for quantized tensors: the codes plus what it takes to dequantize them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .._ops import quantize as _ops
from .._ops._util import fmt_id, u8


class _StraightThrough(torch.autograd.Function):
    """dequantize(quantize(x)) as autograd sees it, as a cast: the rounding passes the gradient
    straight through (unrounded) and the scale is a constant; where a scale
    given by the caller saturated x (``|x| > fmt_max * scale``) the gradient is 0, as through a
    clamp. Scales computed from x itself saturate nothing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, decode: Callable[[], torch.Tensor], limit: torch.Tensor | None):
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(x if limit is not None else None, limit)
        return decode()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, limit = ctx.saved_tensors
        if x is not None:
            grad = grad * (x.abs() <= limit)
        return grad.to(ctx.x_dtype), None, None


def _decoded(t, decode: Callable[[], torch.Tensor]) -> torch.Tensor:
    src = t.source
    if src is None or not src.requires_grad or not torch.is_grad_enabled():
        return decode()
    return _StraightThrough.apply(src, decode, t.grad_limit)


@dataclass
class Fp8Tensor:
    """FP8 codes with per-tensor or per-group (1 x group_size along the last dim) scales.

    ``x ~= data.float() * scale`` (scales broadcast over their group). ``scale`` is fp32 ``[1]`` for
    per-tensor; ``[..., K / group_size]`` fp32 or uint8 E8M0 (``2 ** (b - 127)``) per group.
    """

    data: torch.Tensor
    scale: torch.Tensor
    group_size: int | None = None
    data_t: torch.Tensor | None = None  # [K, M] transpose of data, when asked for
    amax: torch.Tensor | None = None  # the amax the scale came from, when computed in the call
    #: the quantized tensor, when it required grad: dequantize() is then differentiable w.r.t. it
    source: torch.Tensor | None = field(default=None, repr=False, compare=False)
    #: |source| beyond which the codes saturated (a caller-given scale), else None
    grad_limit: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def fmt(self) -> str:
        return "e4m3" if self.data.dtype == torch.float8_e4m3fn else "e5m2"

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def scale_float(self) -> torch.Tensor:
        """The scales as fp32 (E8M0 bytes decoded)."""
        if self.scale.dtype == torch.uint8:
            return torch.ldexp(torch.ones_like(self.scale, dtype=torch.float32), self.scale.int() - 127)
        return self.scale

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values ``data * scale`` in ``dtype``; differentiable w.r.t. ``source`` (see
        coat.functional.dequantize)."""
        fmt = fmt_id(self.data.dtype, "data")
        if self.group_size is None:
            return _decoded(self, lambda: _ops.dequantize_per_tensor(u8(self.data), self.scale, fmt, dtype))
        return _decoded(self, lambda: _ops.dequantize_per_group(u8(self.data), self.scale, self.group_size, fmt,
                                                                 dtype))

    @property
    def nbytes(self) -> int:
        """Bytes of the codes and scales (a property, as ``torch.Tensor.nbytes`` is)."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale) if t is not None)


@dataclass
class DreTensor:
    """FP8 codes with Dynamic Range Expansion: per group of 128 consecutive elements its largest
    magnitude ``gmax`` (fp32) and exponent ``k = k16 / 16`` (uint8). 1 + 5/128 bytes per element.
    Decodes as ``sign(q) * gmax * (|q| / fmt_max) ** (1 / k)``; a group whose max is 16 or more times
    the rest keeps it apart and ``gmax`` holds a negative word instead (split groups,
    coat/quantize.h)."""

    data: torch.Tensor
    gmax: torch.Tensor
    k16: torch.Tensor
    #: the quantized tensor, when it required grad: dequantize() is then differentiable w.r.t. it
    source: torch.Tensor | None = field(default=None, repr=False, compare=False)
    grad_limit: torch.Tensor | None = field(default=None, repr=False, compare=False)  # never set: no saturation

    @property
    def fmt(self) -> str:
        return "e4m3" if self.data.dtype == torch.float8_e4m3fn else "e5m2"

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self) -> torch.Tensor:
        fmt = fmt_id(self.data.dtype, "data")
        return _decoded(self, lambda: _ops.dre_dequantize(u8(self.data), self.gmax, self.k16, fmt))

    @property
    def nbytes(self) -> int:
        """Bytes of the codes, group maxima and exponents (a property, as ``torch.Tensor.nbytes`` is)."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.gmax, self.k16))
