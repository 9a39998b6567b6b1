"""FP8 linear layer: per-tensor E4M3 forward GEMM, E5M2 gradients, FP8-only saved activations.

``y = x W^T + b`` is the fused block of ``fused.py`` without a norm: x is quantized per tensor to
E4M3 (amax computed in the same call, the transposed codes for the weight gradient written in the
same pass), W takes coat's one weight path (``weights.py``: FP8 codes made for the forward GEMM and
again, transposed, for the backward one, never kept in between unless the recipe caches them),
and the GEMMs accumulate in fp32. Backward: dY is quantized per tensor to E5M2 (with its
transpose), ``dX = dY8 @ W8`` and ``dW = dY8^T @ x8``; ``db = dY.sum(0)``. Only FP8 activations
are saved for backward (x8^T, 1 byte per element), never the bf16 input.

Shapes that cuBLASLt's FP8 GEMM does not take (dimensions not multiples of 16) are zero-padded on
the GPU; on the CPU every shape runs through the emulated FP8 product.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from .adapters import register_plain_linear
from .fused import norm_linear
from .recipe import Fp8Recipe, resolve
from .weights import invalidate_weight_cache

__all__ = ["Fp8Linear", "fp8_linear", "invalidate_weight_cache"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    recipe: Fp8Recipe | str | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with FP8 GEMMs (autograd-aware); x may have any leading dims.

    Output dtype: the autocast dtype when autocast is on for x's device, else x's dtype.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        raise ValueError(f"x must be a float32, bfloat16 or float16 tensor, got {getattr(x, 'dtype', type(x))}")
    if not isinstance(weight, torch.Tensor) or weight.dtype not in _FLOATS:
        raise ValueError(
            f"weight must be a float32, bfloat16 or float16 tensor, got {getattr(weight, 'dtype', type(weight))}"
        )
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x's last dimension must equal weight.shape[1]: x is {list(x.shape)}, weight is {list(weight.shape)}"
        )
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"weight and bias must be on x's device {x.device}")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"coat's FP8 GEMMs run on CPU and CUDA tensors, got a {x.device.type} tensor")
    return norm_linear(x, None, 0.0, [weight], [] if bias is None else [bias], resolve(recipe))


class Fp8Linear(nn.Linear):
    """``nn.Linear`` with FP8 GEMMs; same parameters and state-dict keys."""

    coat_recipe: Fp8Recipe | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.coat_recipe)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Fp8Recipe | str | None = None) -> "Fp8Linear":
        """Turns ``linear`` into an Fp8Linear in place (same parameter objects, nothing copied)."""
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        linear.__class__ = cls
        linear.coat_recipe = resolve(recipe)
        return linear


register_plain_linear(Fp8Linear)
