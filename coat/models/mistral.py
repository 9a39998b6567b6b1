"""Mistral: Llama's layer; sliding-window attention is the attention function's business."""

from .family import Family

MISTRAL = Family("Mistral", ("mistral",), "mistral", "MistralDecoderLayer")
