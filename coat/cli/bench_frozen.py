"""The model of ``coat bench``'s side-tuning setup: a random causal LM whose decoder layers are made,
frozen and stored in FP8 one at a time, so the model never exists whole in bf16 (Llama-2-70B: 128
GiB of bf16 weights, more than an 80 GB card and most of an H200; 64 GiB as FP8 codes)."""

from __future__ import annotations

import copy

import torch

from coat import memory, models


def _init_layer(layer: torch.nn.Module, std: float, unit_offset: bool) -> None:
    """Random weights as Hugging Face's init draws them (normal, ``std``); norms at their identity
    (1, or 0 for Gemma's 1 + w), biases 0."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, std)
            elif "norm" in name.rsplit(".", 2)[-2]:
                p.fill_(0.0 if unit_offset else 1.0)
            else:
                p.zero_()


def build_frozen_fp8(shape: memory.ModelShape, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A random ``shape`` causal LM in ``dtype`` on ``device`` whose decoder layers are frozen and
    converted (``coat.convert(recipe="coat", frozen_weights="fp8")``) as each is made: at most one
    layer exists in ``dtype`` at a time. The rest (embeddings, final norm, LM head, rotary tables)
    is built as usual, with no decoder layer, and the layers are put in afterwards."""
    import coat
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**shape.hf_config())
    empty = copy.deepcopy(cfg)
    empty.num_hidden_layers = 0  # (layer_types stay whole: the rotary tables are made for each type in it)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(empty, attn_implementation="sdpa")
        with torch.device("meta"):  # the layers' structure only: no memory
            layers = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").model.layers
    finally:
        torch.set_default_dtype(prev)
    fam = models.by_model_type(cfg.model_type)
    for layer in layers:
        layer.to_empty(device=device)
        _init_layer(layer, float(getattr(cfg, "initializer_range", 0.02)), fam.unit_offset)
        layer.requires_grad_(False)
        coat.convert(layer, recipe="coat", frozen_weights="fp8")
    model.model.layers = layers
    for key in ("num_hidden_layers", "layer_types"):  # the real model's (the forward reads them)
        if getattr(cfg, key, None) is not None:
            setattr(model.config, key, getattr(cfg, key))
    return model.train()
