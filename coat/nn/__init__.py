"""Autograd functions and modules with FP8 compute and FP8 saved activations."""

from .linear import Fp8Linear, fp8_linear

__all__ = ["Fp8Linear", "fp8_linear"]
