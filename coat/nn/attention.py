"""Attention glue for Hugging Face Llama-family attention modules with the FP8 precision flow.

- Q, K and V come from ONE FP8 GEMM over [W_q; W_k; W_v] (+ the concatenated biases of Qwen2),
  with the input RMSNorm fused in front (``fused.norm_linear``): nothing of the norm or the QKV
  input is saved beyond the FP8 norm input.
- Per-head q/k norms (Qwen3, Gemma 3) use the FP8-saved RMSNorm.
- RoPE saves nothing: one kernel reads q and k from the fused QKV output, rotates them and writes
  them (and v) as the contiguous tensors attention takes; its backward is the inverse rotation,
  from the shared cos/sin tensors the model's rotary embedding passes in as
  ``position_embeddings``, written straight into the fused QKV gradient.
- Attention itself stays BF16 through the model's configured attention function (torch SDPA by
  default), which handles GQA, padding masks, sliding windows and KV caches as Hugging Face does.
- o_proj is an FP8 GEMM that saves its input in FP8 (transposed).
Parameter names are HF's (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch
from torch import nn

from .._ops import rope as rops
from . import adapters as A
from ._cache import pop_cache
from .fused import norm_linear
from .mlp import _bias_list
from .norm import norm_eps, rms_norm
from .recipe import DEFAULT, Fp8Recipe


class _RopeQKVFn(torch.autograd.Function):
    """The fused QKV output -> (RoPE'd q, RoPE'd k, v), contiguous [B, S, heads, D], in one kernel;
    backward writes the fused QKV gradient in one kernel. Saves only cos and sin (shared by every
    layer)."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, hq, hk, dim):
        q, k, v = rops.rope_qkv(qkv, cos, sin, hq, hk, dim)
        ctx.save_for_backward(cos, sin)
        ctx.shapes = tuple((t.shape, t.dtype) for t in (q, k, v))
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        grads = []
        for g, like in zip((dq, dk, dv), ctx.shapes):
            grads.append(torch.zeros(like[0], dtype=like[1], device=cos.device) if g is None else g.contiguous())
        return rops.rope_qkv_bwd(*grads, cos, sin), None, None, None, None, None


class _RopeFn(torch.autograd.Function):
    """RoPE on one [B, S, heads, D] tensor (Qwen3's q and k come out of their own norms first)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rops.rope(x.contiguous(), cos, sin, False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return rops.rope(dy.contiguous(), cos, sin, True), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` over [B, S, heads, D] with cos/sin [B or 1, S, D]."""
    return _RopeFn.apply(x, cos, sin)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hk: int, dim: int):
    """(q, k, v) with RoPE on q and k, from the fused QKV output [B, S, (hq + 2 hk) dim]."""
    return _RopeQKVFn.apply(qkv, cos, sin, hq, hk, dim)


def _attention_fn(module: nn.Module):
    """The attention function the HF module would use (sdpa, eager, flash, ...)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = getattr(module.config, "_attn_implementation", None) or "sdpa"
    if impl == "eager":
        return sys.modules[module._coat_hf_module].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[impl]


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

# Hugging Face leaves the causal mask out (SDPA's is_causal instead) only where it can see that
# nothing is padded, which some versions (5.17) do not try while a CUDA graph is captured: the
# captured step then ran SDPA with a materialized causal mask, 2.7x slower on an H200
# (benchmarks/RESULTS.md section 48). coat.CudaGraphStep knows when no padding can exist and says so
# here. Process-wide, not per thread: autograd recomputes checkpointed layers on its own device
# threads inside the same capture, and a recompute must take the forward's path.
_plain = {"on": False}


@contextlib.contextmanager
def plain_causal(on: bool) -> Iterator[None]:
    """Within (with ``on``): the attention masks Hugging Face passes are pure causal masks (no
    padding, no packed documents, no earlier tokens in a cache); a full-length, full-window SDPA
    call then drops it for SDPA's ``is_causal``, the path an eager step takes."""
    old = _plain["on"]
    _plain["on"] = on
    try:
        yield
    finally:
        _plain["on"] = old


def _plain_causal(module: nn.Module, q: torch.Tensor, k: torch.Tensor, kwargs: dict) -> bool:
    # q_len == kv_len after the cache update: no earlier tokens (an empty DynamicCache, which a
    # model with use_cache on makes for every training forward, holds none)
    if not _plain["on"]:
        return False
    n = k.shape[2]
    window = kwargs.get("sliding_window")
    return (q.shape[2] == n > 1 and getattr(module, "is_causal", True) and (window is None or window >= n)
            and (getattr(module.config, "_attn_implementation", None) or "sdpa") == "sdpa")


class Fp8AttentionMixin:
    """forward() for the attention modules of the families in ``coat.models``, same signature and
    return (attn_output, attn_weights), plus ``norm``: the input RMSNorm to fuse into the QKV GEMM.
    ``coat_unit_offset``: the family's norms are Gemma's (set at convert)."""

    coat_unit_offset = False
    coat_recipe: Fp8Recipe = DEFAULT  # convert sets the model's

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                norm: nn.Module | None = None, **kwargs):
        cache = pop_cache(kwargs, cache)  # transformers' name for it: ``cache`` or ``past_key_values``
        recipe = self.coat_recipe
        b_s = hidden_states.shape[:-1]
        d = self.head_dim
        uo = self.coat_unit_offset
        nw = norm.weight if norm is not None else None
        eps = norm_eps(norm) if norm is not None else 0.0
        projs = (self.q_proj, self.k_proj, self.v_proj)
        bases = [A.base_linear(p, n) for p, n in zip(projs, _QKV)]
        weights, biases, scales = [b.weight for b in bases], _bias_list(*bases), A.frozen_scales(bases)
        if A.any_delta(projs):  # LoRA: the adapters need the normed input itself (BF16, beside the FP8 GEMM)
            y = rms_norm(hidden_states, nw, eps, recipe, uo) if nw is not None else hidden_states
            qkv = A.add_deltas(norm_linear(y, None, 0.0, weights, biases, recipe, scales, flat=True), projs, _QKV, y)
        else:
            qkv = norm_linear(hidden_states, nw, eps, weights, biases, recipe, scales, unit_offset=uo)
        cos, sin = position_embeddings
        hq, hk = bases[0].out_features // d, bases[1].out_features // d
        if hasattr(self, "q_norm"):  # Qwen3, Gemma 3: per-head norms between the projection and RoPE
            q, k, v = qkv.split([b.out_features for b in bases], dim=-1)
            q = rms_norm(q.view(*b_s, hq, d), self.q_norm.weight, norm_eps(self.q_norm), recipe, uo)
            k = rms_norm(k.view(*b_s, hk, d), self.k_norm.weight, norm_eps(self.k_norm), recipe, uo)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = v.reshape(*b_s, hk, d).contiguous()
        else:  # new tensors (not views of qkv): attention keeps q, k, v alive but not the QKV buffer
            q, k, v = rope_qkv(qkv, cos, sin, hq, hk, d)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            # transformers 5.0's static caches place the new keys at cache_kwargs' cache_position;
            # later versions' caches track positions themselves and ignore extra arguments.
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": kwargs.get("cache_position")}
            k, v = cache.update(k, v, self.layer_idx, cache_kwargs)
        kwargs.setdefault("sliding_window", getattr(self, "sliding_window", getattr(self.config, "sliding_window", None)))
        if attention_mask is not None and _plain_causal(self, q, k, kwargs):
            attention_mask = None
        out, attn_weights = _attention_fn(self)(
            self, q, k, v, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, **kwargs,
        )
        out = out.reshape(*b_s, -1).contiguous()
        base_o = A.base_linear(self.o_proj, "self_attn.o_proj")
        o = norm_linear(out, None, 0.0, [base_o.weight], [base_o.bias] if base_o.bias is not None else [], recipe,
                        A.frozen_scales((base_o,)), flat=True)
        return A.add_deltas(o, (self.o_proj,), ("self_attn.o_proj",), out), attn_weights
