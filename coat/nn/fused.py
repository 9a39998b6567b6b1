"""The fused FP8 block of a decoder layer: [RMSNorm ->] one GEMM over the stacked weights (fused
QKV, fused gate/up, or a single projection) [+ bias], on the block layer (``block.py``: what it
saves, its weight sources, its fallbacks).
"""

from __future__ import annotations

import torch

from . import block as B
from .block import compute_dtype, wgrad_dtype  # noqa: F401  (the layers' dtype rules, kept importable here)
from .recipe import Fp8Recipe


def norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor],
    recipe: Fp8Recipe,
    frozen_scales: list[torch.Tensor] | None = None,
    flat: bool = False,
    unit_offset: bool = False,
) -> torch.Tensor:
    """``[rms_norm(x)] @ cat(weights).T + cat(biases)`` with FP8 GEMMs and the memory plan of
    ``block.py``. ``unit_offset``: the norm is Gemma's, ``T(h * (1 + w))`` (``norm.hf_rms_norm``).
    ``biases`` is empty or has one entry per weight. ``frozen_scales``: the weights are FP8-frozen
    codes (``frozen.py``) with these scales. ``flat``: return the [tokens, N] output itself, not a
    view of it shaped like x (LoRA adapters then add into it in place)."""
    if biases and len(biases) != len(weights):
        raise ValueError("biases must be empty or one per weight")
    for w in weights:
        if w.dim() != 2 or w.shape[1] != x.shape[-1]:
            raise ValueError(f"weight of shape {tuple(w.shape)} does not take inputs of width {x.shape[-1]}")
        if w.dtype != weights[0].dtype:
            raise ValueError(f"fused weights must share one dtype, got {weights[0].dtype} and {w.dtype}")
    pre = B.NONE if norm_weight is None else B.NORM
    spec = B.make_spec(pre, recipe, x, weights, eps=eps, unit_offset=unit_offset, frozen_scales=frozen_scales,
                       flat=flat)
    return B.block(x, spec, norm_weight, weights, biases)
