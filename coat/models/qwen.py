"""Qwen2 (q/k/v biases: the projections carry them) and Qwen3 (per-head q/k RMSNorms)."""

from .family import Family

QWEN2 = Family("Qwen2", ("qwen2",), "qwen2", "Qwen2DecoderLayer")
QWEN3 = Family("Qwen3", ("qwen3",), "qwen3", "Qwen3DecoderLayer", qk_norm=True)
