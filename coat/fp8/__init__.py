"""FP8 formats and containers for quantized tensors."""

from .formats import DTYPES, MAX, format_name
from .tensor import DreTensor, Fp8Tensor

__all__ = ["DTYPES", "MAX", "format_name", "Fp8Tensor", "DreTensor"]
