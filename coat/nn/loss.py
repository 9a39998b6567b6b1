"""Hugging Face causal LMs whose loss runs through ``fused_lm_head_loss``: the fused final RMSNorm +
LM head + cross-entropy, chunked over the tokens so the logits never exist whole
(coat/nn/lm_head_loss.py holds it, with its arithmetic, memory and precision).

For a Hugging Face model, ``install_fused_loss(model)`` makes ``model(..., labels=...)`` take this
path; the returned output then has ``logits=None``. To get logits, call the model without
``labels`` (and compute the loss yourself), or set ``model.coat_fused_loss = False`` (Hugging
Face's own path: logits and loss, at its memory cost).

The installed classes are subclasses made at install time and named as the originals; this
module's ``__getattr__`` makes them again by name, so a pickled model loads in a fresh process.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import models
from . import adapters
from ..integrations import transformers as hf
from ..integrations.packed_check import _UnpackedPositions
from ._cache import cache_name, pop_cache
from .lm_head_loss import DEFAULT_CHUNK_MIB, fused_lm_head_loss
from .norm import norm_eps
from .recipe import DEFAULT, Fp8Recipe, resolve

__all__ = ["DEFAULT_CHUNK_MIB", "fused_lm_head_loss", "install_fused_loss", "FusedCausalLMLossMixin"]

def _slice_to_keep(hidden: torch.Tensor, logits_to_keep) -> torch.Tensor:
    try:  # transformers >= 5 (also takes boolean / per-sample position tensors)
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:
        slice_logits_to_keep = None
    if slice_logits_to_keep is not None:
        return slice_logits_to_keep(hidden, logits_to_keep)
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden[:, keep, :]


class _DeferrableNormMixin:
    """The final norm of a model with the fused loss: while the loss is computed fused, it passes
    its input through (the fused op applies it), so its output and saved tensors never exist."""

    def forward(self, hidden_states):
        if self.__dict__.get("_coat_deferred", False):
            return hidden_states
        return super().forward(hidden_states)


class _Deferred:
    def __init__(self, norm: nn.Module, on: bool):
        self.norm, self.on = norm, on

    def __enter__(self):
        if self.on:
            self.norm._coat_deferred = True

    def __exit__(self, *exc):
        if self.on:
            self.norm._coat_deferred = False


class FusedCausalLMLossMixin:
    """forward() of a Hugging Face ``*ForCausalLM`` whose loss runs through ``fused_lm_head_loss``
    when ``labels`` are given (``logits`` is then None; with ``return_dict=False`` the tuple is
    ``(loss, ...)`` without logits). Without labels, with ``coat_fused_loss = False``, a custom
    ``loss_function``, or a wrapped or hooked ``lm_head``, it is Hugging Face's forward. Either
    way a forward whose positions the model derives itself skips Hugging Face's host-synchronizing
    check for packed sequences (``_UnpackedPositions``)."""

    coat_fused_loss: bool = True
    coat_loss_chunk_mib: float = DEFAULT_CHUNK_MIB
    coat_loss_fp8_backward: bool = False
    coat_loss_recipe: Fp8Recipe = DEFAULT  # the formats of the FP8 backward
    coat_norm_unit_offset: bool = False  # the final norm is Gemma's (set by install_fused_loss)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        cache = pop_cache(kwargs, cache)  # ``cache`` or ``past_key_values``: passed on as transformers names it
        loss_type = getattr(self, "loss_type", None)
        head = self.lm_head
        derived = _UnpackedPositions(position_ids is None and attention_mask is None and cache is None
                                     and kwargs.get("cache_position") is None)
        # A custom loss, a head something wraps (PEFT's adapters or modules_to_save, FSDP2
        # sharding the head on its own) or hooks on the head: theirs to see, on HF's path.
        if (labels is None or not self.coat_fused_loss or "_loss_function" in self.__dict__
                or loss_type not in (None, "ForCausalLM") or type(head) is not nn.Linear
                or head.bias is not None or head._forward_hooks or head._forward_pre_hooks):
            kwargs[self._coat_cache_kw] = cache
            with derived:
                return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                       inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                       logits_to_keep=logits_to_keep, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            cfg = self.config
            return_dict = cfg.return_dict if hasattr(cfg, "return_dict") else getattr(cfg, "use_return_dict", True)
        norm = self.model.norm
        # The norm runs in the model (and the fused op takes its output) when its output is
        # wanted: hidden_states[-1] is the normed state; hooks on the norm; a norm replaced since.
        want_hidden = kwargs.get("output_hidden_states")
        if want_hidden is None:
            want_hidden = getattr(self.config, "output_hidden_states", False)
        fuse_norm = (not want_hidden and isinstance(norm, _DeferrableNormMixin) and not norm._forward_hooks
                     and not norm._forward_pre_hooks)
        name = self._coat_cache_kw  # the model's forward takes it under the same name
        with _Deferred(norm, fuse_norm), derived:
            outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 inputs_embeds=inputs_embeds, use_cache=use_cache, **{name: cache}, **kwargs)
        hidden = _slice_to_keep(outputs.last_hidden_state, logits_to_keep)
        loss = fused_lm_head_loss(
            hidden, self.lm_head.weight, labels,
            norm_weight=norm.weight if fuse_norm else None, eps=norm_eps(norm), norm_unit_offset=self.coat_norm_unit_offset,
            ignore_index=kwargs.get("ignore_index", -100),
            num_items_in_batch=kwargs.get("num_items_in_batch"),
            shift_labels=kwargs.get("shift_labels"),
            chunk_mib=self.coat_loss_chunk_mib,
            fp8_backward=self.coat_loss_fp8_backward,
            recipe=self.coat_loss_recipe,
        )
        out = CausalLMOutputWithPast(loss=loss, logits=None, **{name: getattr(outputs, name, None)},
                                     hidden_states=getattr(outputs, "hidden_states", None),
                                     attentions=getattr(outputs, "attentions", None))
        return out if return_dict else out.to_tuple()


def _parse(name: str):
    """An installed class's name -> (its transformers class name, mixin, class attributes)."""
    if name.startswith("Deferrable"):
        return name[len("Deferrable"):], _DeferrableNormMixin, None
    if name.endswith("ForCausalLM"):
        return name, FusedCausalLMLossMixin, lambda base: {"_coat_cache_kw": cache_name(base.forward)}
    return None


def __getattr__(name: str) -> type:
    """Rebuilds an installed class by name, so that ``torch.save(model)`` of a model with the fused
    loss loads in a process that has not installed it (``coat.integrations.transformers``)."""
    return hf.rebuild(__name__, name, _parse)


def _subclass(cls: type, mixin: type, name: str) -> type:
    attrs = {"_coat_cache_kw": cache_name(cls.forward)} if mixin is FusedCausalLMLossMixin else None
    return hf.subclass(cls, mixin, name, __name__, attrs)


def _head_linear(head: nn.Module) -> nn.Module:
    """The ``nn.Linear`` inside a PEFT wrapper of the LM head (a LoRA layer, ``modules_to_save``),
    or ``head`` itself. Such a wrapped head takes Hugging Face's path at every call (the forward
    checks the head's exact type), and the fused loss once the wrapper is gone (merged, unloaded)."""
    if adapters.is_lora(head):
        return head.base_layer
    try:
        from peft.utils import ModulesToSaveWrapper
    except ImportError:  # peft not installed: no PEFT wrappers exist
        return head
    return head.original_module if isinstance(head, ModulesToSaveWrapper) else head


def check_fused_loss(model: nn.Module) -> tuple[nn.Module, nn.Module, models.Family]:
    """Raises ValueError for a model ``install_fused_loss`` refuses, changing nothing; returns the
    causal LM (inside a PEFT wrapper), its final norm and its family. ``coat.convert`` calls it
    before it converts any layer."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):  # a PEFT model: the causal LM it wraps
        model = get_base()
    base = getattr(model, "model", None)
    head = _head_linear(getattr(model, "lm_head", None))
    norm = getattr(base, "norm", None)
    if type(head) is not nn.Linear or norm is None or not isinstance(getattr(norm, "weight", None), torch.Tensor):
        raise ValueError(
            f"install_fused_loss needs a causal LM with .model.norm and a plain nn.Linear .lm_head (or a PEFT "
            f"adapter or modules_to_save around one); {type(model).__name__} has not"
        )
    if head.bias is not None:
        raise ValueError("install_fused_loss supports LM heads without bias")
    if getattr(getattr(model, "config", None), "final_logit_softcapping", None) is not None:
        raise ValueError("install_fused_loss does not support final_logit_softcapping")
    norm_eps(norm)  # refuses a norm that is no RMSNorm
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    fam = models.by_model_type(model_type)
    if fam is None:  # the final norm's arithmetic is the family's: unknown, it could be computed wrong
        raise ValueError(f"install_fused_loss supports {models.names()} models; got {type(model).__name__}"
                         + (f" (model_type={model_type!r})" if model_type else ""))
    return model, norm, fam


def install_fused_loss(model: nn.Module, *, chunk_mib: float = DEFAULT_CHUNK_MIB,
                       fp8_backward: bool = False, recipe: Fp8Recipe | str | None = None) -> nn.Module:
    """Makes ``model(..., labels=...)`` of a Hugging Face causal LM of a family in ``coat.models`` (or
    a PEFT model around one) compute its loss with ``fused_lm_head_loss`` (final norm + LM head +
    cross-entropy, chunked), in place; returns the model. Parameters, state-dict keys and the class
    name (which ``save_pretrained`` records) stay as they were; ``torch.save(model)`` loads in a
    fresh process. A head something wraps at call time (a PEFT adapter or ``modules_to_save`` on
    ``lm_head``, wrapped before or after this call), a custom ``loss_function`` or forward hooks on
    ``lm_head`` take Hugging Face's path, and so does every call after ``model.coat_fused_loss =
    False``. Installing twice only updates the settings. A refused model is left as it was.
    ``chunk_mib``, ``fp8_backward`` and ``recipe``: see ``fused_lm_head_loss`` (the LM head's two
    gradient GEMMs in FP8, in the recipe's formats; ``coat.convert`` passes the model's)."""
    if not isinstance(chunk_mib, (int, float)) or isinstance(chunk_mib, bool) or not chunk_mib > 0:
        raise ValueError(f"chunk_mib must be a positive number, got {chunk_mib!r}")
    if not isinstance(fp8_backward, bool):
        raise ValueError(f"fp8_backward must be True or False, got {fp8_backward!r}")
    recipe = resolve(recipe)
    wrapper = model
    model, norm, fam = check_fused_loss(model)
    norm.__class__ = _subclass(type(norm), _DeferrableNormMixin, "Deferrable" + type(norm).__name__)
    model.__class__ = _subclass(type(model), FusedCausalLMLossMixin, type(model).__name__)
    model.coat_norm_unit_offset = fam.unit_offset
    model.coat_fused_loss = True
    model.coat_loss_chunk_mib = float(chunk_mib)
    model.coat_loss_fp8_backward = fp8_backward
    model.coat_loss_recipe = recipe
    return wrapper
