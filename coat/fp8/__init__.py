"""FP8 formats (coat.fp8.formats) and containers for quantized tensors (coat.fp8.tensor)."""

from .formats import DTYPES, MAX, format_name

__all__ = ["DTYPES", "MAX", "format_name"]
