"""Decoder-layer glue: the HF decoder layer's forward with each pre-block RMSNorm fused into the GEMM
that consumes it (the family's ``attn_norm`` -> QKV, ``mlp_norm`` -> gate/up), and the family's
sandwich norms (Gemma 3: on each block's output before the residual add) as FP8-saved norms. Which
norm is which comes from the layer's family (``coat.models``), set at convert. The residual stream
stays in its own dtype; residual adds save nothing."""

from __future__ import annotations

import functools

import torch

from ..models import LLAMA
from ._cache import pop_cache
from .norm import norm_eps, rms_norm


@functools.cache
def _fsdp_module_type():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return ()
    return FSDPModule


def _out_norm(layer, name: str | None, h: torch.Tensor, unit_offset: bool) -> torch.Tensor:
    """A sandwich norm on a block's output (none: h itself)."""
    if name is None:
        return h
    norm = getattr(layer, name)
    return rms_norm(h, norm.weight, norm_eps(norm), layer.self_attn.coat_recipe, unit_offset)


def refuse_bypassed_hooks(layer) -> None:
    """The converted layer reads its projections', norms' and LoRA adapters' weights without calling
    those modules, so hooks on them would silently never run (activation capture or steering,
    ``torch.nn.utils.prune``'s reparametrization, PEFT's per-row ``adapter_names`` routing). Only the
    layer, its ``self_attn`` and its ``mlp`` are called as modules."""
    called = (layer, layer.self_attn, layer.mlp)
    # every forward of every layer: a bare walk over _modules (half of named_modules' cost), names
    # only for the error
    stack = [m for m in layer._modules.values() if m is not None]
    while stack:
        m = stack.pop()
        if (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks) \
                and not any(m is c for c in called):
            name = next(n for n, sub in layer.named_modules() if sub is m)
            raise RuntimeError(
                f"a hook is registered on {name} inside a coat-converted decoder layer ({type(layer).__name__}), "
                "whose fused kernels read that module's weights without calling it: the hook would never run. "
                "Register it on the decoder layer, its self_attn or its mlp, or remove it before the forward "
                "(PEFT's adapter_names= routes rows through such hooks: mixed-adapter batches are not "
                "supported by converted layers)")
        stack.extend(c for c in m._modules.values() if c is not None)


class Fp8DecoderLayerMixin:
    coat_family = LLAMA

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
        cache = pop_cache(kwargs, cache)  # transformers' name for it: ``cache`` or ``past_key_values``
        refuse_bypassed_hooks(self)
        fam = self.coat_family
        if self.self_attn.coat_recipe.weight_cache and isinstance(self, _fsdp_module_type()):
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
            norm=getattr(self, fam.attn_norm),
            **kwargs,
        )
        h = residual + _out_norm(self, fam.attn_out_norm, h, fam.unit_offset)
        return h + _out_norm(self, fam.mlp_out_norm, self.mlp(h, norm=getattr(self, fam.mlp_norm)), fam.unit_offset)
