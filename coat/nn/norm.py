"""RMSNorm that keeps its input for backward in FP8 (1 x 16 groups, E4M3) plus one fp32 rstd per
row, instead of the BF16 input (and output) that autograd would keep. Two arithmetics
(``coat.models.family.NORM_KINDS``): Llama's ``w * T(h)`` and, with ``unit_offset``, Gemma's
``T(h * (1 + w))`` (its weight is stored as the offset from 1).

Widths that are not a multiple of 16 (the FP8 group) run a plain RMSNorm with Hugging Face's
rounding and autograd's saved tensors: same results, BF16 memory.
"""

from __future__ import annotations

import torch
from torch import nn

from .._ops import norm as nops
from .recipe import Fp8Recipe, resolve

GROUP = nops.GROUP


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """Hugging Face's RMSNorm arithmetic (the reference and the fallback): LlamaRMSNorm's, or with
    ``unit_offset`` Gemma3RMSNorm's."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def norm_eps(norm: nn.Module) -> float:
    """A Hugging Face RMSNorm module's epsilon (``variance_epsilon`` in Llama's, ``eps`` in Gemma's)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if eps is None:
        raise ValueError(f"{type(norm).__name__} has no variance_epsilon or eps: not an RMSNorm")
    return float(eps)


def fp8_norm_ok(cols: int) -> bool:
    return cols > 0 and cols % GROUP == 0


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, recipe, unit_offset):
        x2 = x.contiguous()
        y, rstd, q, s = nops.rmsnorm_fwd(x2, weight.contiguous(), eps, True, recipe.act_dtype, recipe.e8m0, unit_offset)
        ctx.save_for_backward(q, s, rstd, weight)
        ctx.x_dtype, ctx.unit_offset = x.dtype, unit_offset
        return y

    @staticmethod
    def backward(ctx, dy):
        q, s, rstd, weight = ctx.saved_tensors
        dx, dw = nops.rmsnorm_bwd(q, s, rstd, weight.contiguous(), dy.contiguous().to(ctx.x_dtype), ctx.unit_offset)
        return dx, dw.to(weight.dtype), None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, recipe: Fp8Recipe | str | None = None,
             unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension with an FP8 saved input. ``y`` has x's dtype."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() == 0 or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1] if x.dim() else '?'},), got {tuple(weight.shape)}")
    if not fp8_norm_ok(x.shape[-1]):
        return hf_rms_norm(x, weight, eps, unit_offset)
    return _RMSNormFn.apply(x, weight, float(eps), resolve(recipe), bool(unit_offset))


class Fp8RMSNorm(nn.Module):
    """Drop-in for LlamaRMSNorm (same parameter name ``weight`` and ``variance_epsilon``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, recipe: Fp8Recipe | str | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.coat_recipe = resolve(recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon, self.coat_recipe)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fp8 saved input"
