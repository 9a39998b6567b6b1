"""Precision recipes of the FP8 layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Recipe:
    """How a converted decoder layer computes and what it keeps for backward.

    - GEMM operands: activations and weights per-tensor E4M3, output gradients per-tensor E5M2,
      fp32 accumulation (``fast_accum_fwd`` lets the forward GEMM use Hopper's faster accumulation,
      as TransformerEngine does for fprop).
    - Saved activations: non-linear op inputs (RMSNorm, SwiGLU) as E4M3 with one scale per 1 x 16
      group, ``act_scale`` = "fp32" (4 bytes per group) or "e8m0" (a power of two, 1 byte).
      Norm outputs, the SwiGLU output and RoPE are recomputed in backward, never saved.
    - ``weight_cache``: off (the default), the FP8 copy of a weight exists only while the GEMM that
      reads it runs (made in forward, made again transposed in backward), so a converted model holds
      no more memory between steps than the unconverted one. On, the codes and their transpose are
      made once per optimizer step and reused by every micro-batch of a gradient accumulation until
      the next ``optimizer.step()`` frees them: one quantization pass per step instead of two per
      micro-batch, for 2 bytes per parameter of the converted layers held meanwhile. See
      ``coat/nn/weights.py`` for what invalidates the cache.
    """

    act_scale: str = "fp32"
    fast_accum_fwd: bool = True
    weight_cache: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.weight_cache, bool):
            raise ValueError(f"weight_cache must be True or False, got {self.weight_cache!r}")
        if self.act_scale not in ("fp32", "e8m0"):
            raise ValueError(f"act_scale must be 'fp32' or 'e8m0', got {self.act_scale!r}")

    @property
    def e8m0(self) -> bool:
        return self.act_scale == "e8m0"

    @property
    def act_dtype(self) -> torch.dtype:
        """The FP8 format of activations, weights and saved non-linear inputs (the block op's)."""
        return ACT_DTYPE

    @property
    def grad_dtype(self) -> torch.dtype:
        """The FP8 format of output gradients."""
        return GRAD_DTYPE


ACT_DTYPE = torch.float8_e4m3fn
GRAD_DTYPE = torch.float8_e5m2

#: Recipe names ``coat.convert`` accepts. "coat" is COAT's full recipe: the layers are the same as
#: "fp8"; its FP8 optimizer states come from ``coat.optim``.
RECIPES = {"fp8": Fp8Recipe(), "coat": Fp8Recipe(), "fp8-e8m0": Fp8Recipe(act_scale="e8m0")}


def resolve(recipe: str | Fp8Recipe | None) -> Fp8Recipe:
    if recipe is None:
        return RECIPES["fp8"]
    if isinstance(recipe, Fp8Recipe):
        return recipe
    if isinstance(recipe, str) and recipe in RECIPES:
        return RECIPES[recipe]
    raise ValueError(f"recipe must be one of {sorted(RECIPES)} or an Fp8Recipe, got {recipe!r}")
