"""Autograd functions and modules with FP8 compute and FP8 saved activations."""

from .attention import Fp8AttentionMixin, apply_rope
from .layer import Fp8DecoderLayerMixin
from .linear import Fp8Linear, fp8_linear
from .mlp import Fp8SwiGLUMixin, Fp8SwiGLUMLP, swiglu_down
from .norm import Fp8RMSNorm, rms_norm
from .recipe import RECIPES, Fp8Recipe
from .stats import Fp8Stats, fp8_stats
from .frozen import dequantize_frozen
from .weights import cached_bytes, invalidate_weight_cache

__all__ = [
    "Fp8Linear",
    "fp8_linear",
    "Fp8Recipe",
    "RECIPES",
    "Fp8RMSNorm",
    "rms_norm",
    "Fp8SwiGLUMLP",
    "Fp8SwiGLUMixin",
    "swiglu_down",
    "Fp8AttentionMixin",
    "apply_rope",
    "Fp8DecoderLayerMixin",
    "invalidate_weight_cache",
    "cached_bytes",
    "dequantize_frozen",
    "Fp8Stats",
    "fp8_stats",
]
