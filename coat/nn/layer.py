"""Decoder-layer glue: the HF decoder layer's forward with each RMSNorm fused into the GEMM that
consumes it (input_layernorm -> QKV, post_attention_layernorm -> gate/up). The residual stream
stays in its own dtype; residual adds save nothing."""

from __future__ import annotations

import torch


class Fp8DecoderLayerMixin:
    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
        residual = hidden_states
        h, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            norm=self.input_layernorm,
            **kwargs,
        )
        h = residual + h
        return h + self.mlp(h, norm=self.post_attention_layernorm)
