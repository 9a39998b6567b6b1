"""Attention glue for Hugging Face Llama-family attention modules with the FP8 precision flow.

- Q, K and V come from ONE FP8 GEMM over [W_q; W_k; W_v] (+ the concatenated biases of Qwen2),
  with the input RMSNorm fused in front (``fused.norm_linear``): nothing of the norm or the QKV
  input is saved beyond the FP8 norm input.
- Qwen3's per-head q/k norms use the FP8-saved RMSNorm.
- RoPE saves nothing: its backward is the inverse rotation, from the shared cos/sin tensors the
  model's rotary embedding passes in as ``position_embeddings``.
- Attention itself stays BF16 through the model's configured attention function (torch SDPA by
  default), which handles GQA, padding masks, sliding windows and KV caches as Hugging Face does.
- o_proj is an FP8 GEMM that saves its input in FP8 (transposed).
Parameter names are HF's (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from .fused import norm_linear
from .mlp import _bias_list
from .norm import rms_norm
from .recipe import resolve


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_half_t(x: torch.Tensor) -> torch.Tensor:
    """The transpose of rotate_half: (z1, z2) -> (z2, -z1)."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x2, -x1), dim=-1)


class _RopeFn(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin over [B, S, H, D] with cos/sin [B or 1, S, D]; backward is
    the inverse rotation, so only cos and sin (shared by every layer) are kept."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        out = (x * c + _rotate_half(x) * s).to(x.dtype)
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        dx = dy * c + _rotate_half_t(dy * s)
        return dx.to(ctx.x_dtype), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _RopeFn.apply(x, cos, sin)


def _attention_fn(module: nn.Module):
    """The attention function the HF module would use (sdpa, eager, flash, ...)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = getattr(module.config, "_attn_implementation", None) or "sdpa"
    if impl == "eager":
        return sys.modules[module._coat_hf_module].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[impl]


class Fp8AttentionMixin:
    """forward() for HF Llama/Mistral/Qwen2/Qwen3 attention modules, same signature and return
    (attn_output, attn_weights), plus ``norm``: the input RMSNorm to fuse into the QKV GEMM."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                norm: nn.Module | None = None, **kwargs):
        recipe = getattr(self, "coat_recipe", None) or resolve(None)
        b_s = hidden_states.shape[:-1]
        d = self.head_dim
        nw = norm.weight if norm is not None else None
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)) if norm is not None else 0.0
        projs = (self.q_proj, self.k_proj, self.v_proj)
        qkv = norm_linear(hidden_states, nw, eps, [p.weight for p in projs], _bias_list(*projs), recipe)
        q, k, v = qkv.split([p.out_features for p in projs], dim=-1)
        q = q.view(*b_s, -1, d)
        k = k.view(*b_s, -1, d)
        if hasattr(self, "q_norm"):
            q = rms_norm(q, self.q_norm.weight, self.q_norm.variance_epsilon, recipe)
            k = rms_norm(k, self.k_norm.weight, self.k_norm.variance_epsilon, recipe)
        cos, sin = position_embeddings
        # New tensors (not views of qkv), so attention keeps q, k, v alive but not the QKV buffer.
        q = apply_rope(q, cos, sin).transpose(1, 2)
        k = apply_rope(k, cos, sin).transpose(1, 2)
        v = v.reshape(*b_s, -1, d).transpose(1, 2).contiguous()
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        kwargs.setdefault("sliding_window", getattr(self, "sliding_window", getattr(self.config, "sliding_window", None)))
        out, weights = _attention_fn(self)(
            self, q, k, v, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, **kwargs,
        )
        out = out.reshape(*b_s, -1).contiguous()
        o = norm_linear(out, None, 0.0, [self.o_proj.weight], [self.o_proj.bias] if self.o_proj.bias is not None else [],
                        recipe)
        return o, weights
