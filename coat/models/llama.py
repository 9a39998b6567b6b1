"""Llama (and models configured as Llama): pre-norm decoder layers, SwiGLU, Llama's RMSNorm."""

from .family import Family

LLAMA = Family("Llama", ("llama",), "llama", "LlamaDecoderLayer")
