"""Precision recipes of the FP8 layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fp8.formats import DTYPES, SCALE_KINDS


#: Scaling granularities of the GEMM operands (docs/scaling.md): "tensor", one scale per operand;
#: "row", one per token of activations and output gradients and one per output channel of the
#: weight; "block", DeepSeek-V3's 1 x 128 groups of activations and gradients and 128 x 128 tiles of
#: the weight. Row and block scaling run on sm_90 (Hopper) GPUs and on the CPU.
GRANULARITIES = ("tensor", "row", "block")


@dataclass(frozen=True)
class Fp8Recipe:
    """How a converted decoder layer computes and what it keeps for backward: the one source of the
    FP8 formats and scaling that every quantizer of a converted model reads (the block op, the
    standalone norm and SwiGLU, frozen FP8 weights, the LM head's FP8 backward).

    - GEMM operands: activations and weights in ``act_format``, output gradients in
      ``grad_format``, scaled at ``granularity`` (``GRANULARITIES``); fp32 accumulation
      (``fast_accum_fwd`` lets the forward GEMM use Hopper's faster accumulation, as
      TransformerEngine does for fprop; "block" GEMMs always accumulate in split fp32, cuBLASLt has
      no other). ``act_format`` must be "e4m3": the weights share it, and FP8 tensor cores do not
      multiply two E5M2 operands. ``grad_format`` "e5m2" (range) or "e4m3" (precision); by default
      "e5m2", and "e4m3" with "block" scaling (DeepSeek-V3's choice: a 1 x 128 group needs range
      less than precision; the default is resolved when the recipe is made, so
      ``dataclasses.replace(recipe, granularity=...)`` keeps the recipe's gradient format: pass
      ``grad_format`` too). Row and block scaling quantize the weight in each call:
      ``weight_cache`` and FP8-frozen weights need "tensor".
    - Saved activations: non-linear op inputs (RMSNorm, SwiGLU) in ``act_format`` with one scale
      per 1 x 16 group, ``act_scale`` = "fp32" (4 bytes per group) or "e8m0" (a power of two, 1 byte).
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
    act_format: str = "e4m3"
    grad_format: str | None = None
    granularity: str = "tensor"

    def __post_init__(self) -> None:
        for name in ("weight_cache", "fast_accum_fwd"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.act_scale not in SCALE_KINDS:
            raise ValueError(f"act_scale must be 'fp32' or 'e8m0', got {self.act_scale!r}")
        if self.act_format != "e4m3":
            raise ValueError(f"act_format must be 'e4m3', got {self.act_format!r}: the weights share the "
                             "activations' format and FP8 tensor cores do not multiply two E5M2 operands")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.grad_format is None:
            object.__setattr__(self, "grad_format", "e4m3" if self.granularity == "block" else "e5m2")
        if self.grad_format not in DTYPES:
            raise ValueError(f"grad_format must be 'e5m2' or 'e4m3', got {self.grad_format!r}")
        if self.weight_cache and self.granularity != "tensor":
            raise ValueError(f"weight_cache needs granularity 'tensor', got {self.granularity!r}: row and block "
                             "scaling quantize the weight in each call")

    @property
    def e8m0(self) -> bool:
        return self.act_scale == "e8m0"

    @property
    def act_dtype(self) -> torch.dtype:
        """The FP8 dtype of activations, weights and saved non-linear inputs."""
        return DTYPES[self.act_format]

    @property
    def grad_dtype(self) -> torch.dtype:
        """The FP8 dtype of output gradients."""
        return DTYPES[self.grad_format]


#: Recipe names ``coat.convert`` accepts. "coat" is COAT's full recipe: the layers are the same as
#: "fp8"; its FP8 optimizer states come from ``coat.optim``.
RECIPES = {"fp8": Fp8Recipe(), "coat": Fp8Recipe(), "fp8-e8m0": Fp8Recipe(act_scale="e8m0")}
#: The recipe of everything FP8 that is given none.
DEFAULT = RECIPES["fp8"]


def resolve(recipe: str | Fp8Recipe | None) -> Fp8Recipe:
    if recipe is None:
        return RECIPES["fp8"]
    if isinstance(recipe, Fp8Recipe):
        return recipe
    if isinstance(recipe, str) and recipe in RECIPES:
        return RECIPES[recipe]
    raise ValueError(f"recipe must be one of {sorted(RECIPES)} or an Fp8Recipe, got {recipe!r}")
