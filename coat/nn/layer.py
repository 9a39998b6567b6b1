"""Decoder-layer glue: the HF decoder layer's forward with each RMSNorm fused into the GEMM that
consumes it (input_layernorm -> QKV, post_attention_layernorm -> gate/up). The residual stream
stays in its own dtype; residual adds save nothing."""

from __future__ import annotations

import functools

import torch

from ._cache import pop_cache


@functools.cache
def _fsdp_module_type():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return ()
    return FSDPModule


class Fp8DecoderLayerMixin:
    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
        cache = pop_cache(kwargs, cache)  # transformers' name for it: ``cache`` or ``past_key_values``
        recipe = getattr(self.self_attn, "coat_recipe", None)
        if recipe is not None and recipe.weight_cache and isinstance(self, _fsdp_module_type()):
            raise ValueError(
                "Fp8Recipe(weight_cache=True) cannot be used under FSDP2: it would keep FP8 copies of the "
                "unsharded weights on every rank; convert with weight_cache=False (the default)"
            )
        residual = hidden_states
        h, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            norm=self.input_layernorm,
            **kwargs,
        )
        h = residual + h
        return h + self.mlp(h, norm=self.post_attention_layernorm)
