"""``coat.convert``: switch a Hugging Face causal LM of a family in ``coat.models`` to the FP8
precision flow in place.

Each decoder layer, its attention and its MLP get a subclass of their own class whose forward runs
the FP8 blocks of ``coat.nn``, told by the model's family (``coat.models``) which norm feeds which
GEMM; every submodule and parameter stays where it was, so state-dict keys do not change and
``save_pretrained`` writes a checkpoint plain transformers loads. Models: Llama, Mistral, Qwen2
(q/k/v biases), Qwen3 (q/k norms), Gemma 3 text (GeGLU, (1 + w) norms, sandwich norms, q/k norms,
sliding-window layers), with GQA, any attention implementation the model is configured with (SDPA
by default), KV caches (``generate``), padding masks and gradient checkpointing. The final norm
and the LM head stay as they are.
"""

from __future__ import annotations

import functools
import importlib.util
import os

from torch import nn

from . import models
from .integrations import transformers as hf
from .models import GROUPS, Family
from .nn import adapters
from .nn.attention import Fp8AttentionMixin
from .nn.frozen import freeze_to_fp8
from .nn.loss import DEFAULT_CHUNK_MIB, FusedCausalLMLossMixin, check_fused_loss, install_fused_loss
from .nn.layer import Fp8DecoderLayerMixin
from .nn.mlp import Fp8SwiGLUMixin
from .nn.recipe import Fp8Recipe, resolve

#: model_type -> decoder layer class name.
SUPPORTED = {t: f.layer_class for f in models.FAMILIES for t in f.model_types}
_MIXIN_BY_SUFFIX = (("DecoderLayer", Fp8DecoderLayerMixin), ("Attention", Fp8AttentionMixin), ("MLP", Fp8SwiGLUMixin))


def _parse(name: str):
    """Fp8<transformers class> -> (its class name, the mixin its suffix calls for, attributes)."""
    if name.startswith("Fp8"):
        for suffix, mixin in _MIXIN_BY_SUFFIX:
            if name.endswith(suffix):
                return name[3:], mixin, lambda base: {"_coat_hf_module": base.__module__}
    return None


def __getattr__(name: str) -> type:
    """Rebuilds a converted class by name, so that ``torch.save(model)`` of a converted model loads in
    a process that has not converted anything yet (``coat.integrations.transformers``)."""
    return hf.rebuild(__name__, name, _parse)


def _subclass(cls: type, mixin: type) -> type:
    return hf.subclass(cls, mixin, "Fp8" + cls.__name__, __name__, {"_coat_hf_module": cls.__module__})


@functools.cache
def _transformers_dir() -> str:
    spec = importlib.util.find_spec("transformers")  # found, not imported
    return os.path.join(os.path.abspath(spec.submodule_search_locations[0]), "") if spec else "\0"


def _in_transformers(f: object) -> bool:
    """Whether function ``f``'s code is transformers' own (by the file it was compiled from)."""
    code = getattr(f, "__code__", None)
    return code is not None and os.path.abspath(code.co_filename).startswith(_transformers_dir())


def _unwrap(f: object) -> object:
    """``f`` without transformers' own wrappers (transformers 5.x wraps every decoder layer
    subclass's forward, and decorates forwards); another wrapper (a patch made with
    functools.wraps) is kept, so that it is not taken for the function it wraps."""
    while hasattr(f, "__wrapped__") and _in_transformers(f):
        f = f.__wrapped__
    return f


def _forward_of(cls: type) -> tuple[type | None, object]:
    """The class of ``cls``'s MRO whose ``forward`` an instance runs (coat's own classes skipped) and
    that function, without transformers' wrappers."""
    for c in cls.__mro__:
        if "forward" in c.__dict__ and not c.__module__.startswith("coat."):
            return c, _unwrap(c.__dict__["forward"])
    return None, None


def _check_forward(mod: nn.Module, name: str) -> None:
    """Refuses a module whose forward coat's would replace but which is not transformers' own: a
    subclass overriding it, a function patched onto the class, one set on the instance. Found by
    names, not by transformers' internals: the forward an instance runs must be the one of its first
    transformers class, and that one defined by a transformers class under its own name."""
    cls = type(mod)
    base = next((c for c in cls.__mro__ if c.__module__.startswith("transformers.")), None)
    _, runs = _forward_of(cls)
    owner, own = _forward_of(base) if base is not None else (None, None)
    if "forward" in mod.__dict__:
        why = "has a forward set on the instance"
    elif owner is None or runs is not own:
        why = f"overrides forward ({getattr(runs, '__qualname__', repr(runs))})"
    elif (getattr(own, "__module__", None), getattr(own, "__qualname__", None)) != (owner.__module__,
                                                                                    f"{owner.__qualname__}.forward") \
            or not _in_transformers(own):
        how = " with functools.wraps" if hasattr(own, "__wrapped__") else ""
        why = (f"has a forward that is not {owner.__qualname__}'s own: {owner.__qualname__}.forward was replaced "
               f"by {getattr(own, '__module__', '?')}.{getattr(own, '__qualname__', repr(own))} (patched onto the "
               f"class{how})")
    else:
        return
    raise ValueError(f"coat.convert: {name} is a {cls.__module__}.{cls.__qualname__} that {why}; coat replaces the "
                     f"forward of decoder layers, their attention, MLP and norms (and of the final norm, in its fused "
                     f"loss) with its own, so that forward would be lost silently. Keep transformers' forward (a forward hook on the module runs with coat's), or "
                     f"train this model without coat.convert")


def _refuse_accelerate_hooks(model: nn.Module) -> None:
    """accelerate's dispatch (``from_pretrained(device_map=...)``, ``dispatch_model``, ``cpu_offload``)
    hooks modules: each keeps its original bound forward (``_old_forward``) and calls that, so coat's
    forwards would never run (or would meet offloaded weights on the meta device)."""
    for name, mod in model.named_modules():
        if hasattr(mod, "_hf_hook") or hasattr(mod, "_old_forward"):
            where = name or f"the model ({type(model).__name__})"
            raise ValueError(
                f"coat.convert: {where} carries accelerate's hooks (_hf_hook / _old_forward): the model was "
                f"dispatched or offloaded by accelerate (from_pretrained with a device_map, dispatch_model, "
                f"cpu_offload), and those hooks call the original forward, so coat's would never run. coat needs "
                f"the whole model on one device per process: load it without device_map (then .to(device)), or "
                f"shard it with FSDP2 through coat.integrations.fsdp (docs/fsdp.md)")


def _check_layer(layer: nn.Module, fam: Family, prefix: str) -> str:
    """Everything the FP8 blocks read is where the family says, every projection is a plain
    nn.Linear or a PEFT LoRA layer around one (anything else would be read past silently, so it is
    refused here, naming it), and the configuration asks for nothing the blocks do not compute.
    Returns the MLP's gated activation."""
    for name in ("self_attn", "mlp", *fam.norms()):
        if not hasattr(layer, name):
            raise ValueError(f"coat.convert: {prefix}{name} is missing: not a {fam.name} decoder layer")
    # coat's forwards replace these, and compute the norms from their weights
    norms = [(f"{prefix}{n}", getattr(layer, n)) for n in fam.norms()]
    norms += [(f"{prefix}self_attn.{n}", getattr(layer.self_attn, n)) for n in ("q_norm", "k_norm")
              if isinstance(getattr(layer.self_attn, n, None), nn.Module)]
    for name, mod in ((prefix[:-1] or "the layer", layer), (f"{prefix}self_attn", layer.self_attn),
                      (f"{prefix}mlp", layer.mlp), *norms):
        _check_forward(mod, name)
    if fam.qk_norm != hasattr(layer.self_attn, "q_norm"):
        raise ValueError(f"coat.convert: {prefix}self_attn {'lacks' if fam.qk_norm else 'has'} q_norm, which a "
                         f"{fam.name} decoder layer {'has' if fam.qk_norm else 'lacks'}")
    for block, groups in GROUPS.items():
        for n in (n for g in groups for n in g):
            full = f"{prefix}{block}.{n}"
            mod = getattr(getattr(layer, block), n, None)
            if mod is None:
                raise ValueError(f"coat.convert: {full} is missing: not a {fam.name} decoder layer")
            adapters.base_linear(mod, full)
            adapters.check_adapters(mod, full)
    return fam.check(getattr(layer.self_attn, "config", None))


def _convert_layer(layer: nn.Module, recipe: Fp8Recipe, fam: Family, act: str) -> None:
    layer.self_attn.__class__ = _subclass(type(layer.self_attn), Fp8AttentionMixin)
    layer.mlp.__class__ = _subclass(type(layer.mlp), Fp8SwiGLUMixin)
    layer.__class__ = _subclass(type(layer), Fp8DecoderLayerMixin)
    layer.coat_family = fam
    layer.self_attn.coat_recipe = recipe
    layer.mlp.coat_recipe = recipe
    layer.self_attn.coat_unit_offset = layer.mlp.coat_unit_offset = fam.unit_offset
    layer.mlp.coat_act = act


FROZEN_WEIGHTS = ("keep", "fp8")


def convert(model: nn.Module, recipe: str | Fp8Recipe = "fp8", frozen_weights: str = "keep",
            fused_loss: bool = True) -> nn.Module:
    """Converts ``model`` (a Hugging Face Llama/Mistral/Qwen2/Qwen3/Gemma 3 text model, or one
    decoder layer) in place and returns it. ``recipe``: "fp8" / "coat" (FP8 GEMMs, FP8 saved activations with fp32
    group scales), "fp8-e8m0" (power-of-two group scales), an ``Fp8Recipe``, or "bf16" (no change).
    ``frozen_weights="fp8"`` stores every projection group whose weights are all frozen
    (requires_grad False: a LoRA base, frozen layers) as FP8 codes only, 1 byte per parameter
    (``coat/nn/frozen.py``; the state dict and ``save_pretrained`` hold them dequantized to their
    dtype, as plain transformers loads them); call convert again after freezing more (e.g. after
    ``peft.get_peft_model``: a group frozen after ``frozen_weights="fp8"`` and not stored in FP8 by
    a second convert is refused at the next forward, naming this). ``fused_loss`` (default on): a
    causal LM called with ``labels`` runs its final norm, LM head and cross-entropy chunk by chunk
    (``coat/nn/loss.py``): the [tokens, vocab] logits never exist, and the output's ``logits`` is
    None; call without labels (or set ``model.coat_fused_loss = False``) to get logits. A head PEFT
    wraps (``modules_to_save``, a LoRA adapter on ``lm_head``) takes Hugging Face's loss path; a head
    the fused loss cannot read (a bias, another module) is refused: convert with ``fused_loss=False``.
    A decoder layer, attention or MLP whose forward is not transformers' own (coat's replaces it) and
    a model accelerate dispatched or offloaded (its hooks would bypass coat) are refused
    (docs/models.md). Every argument and every check runs before the first module is changed: a
    refused model is left as it was. Converting again updates the recipe, stores newly frozen
    groups in FP8 and applies ``fused_loss`` (False switches an installed fused loss off, as
    ``model.coat_fused_loss = False`` does; its chunk size and FP8 backward are kept); it cannot undo
    a conversion: ``recipe="bf16"`` on a converted model is refused."""
    _check_args(model, recipe, frozen_weights, fused_loss)
    if recipe == "bf16":
        _refuse_converted(model)
        return model
    rec = resolve(recipe)
    if rec.granularity != "tensor" and frozen_weights == "fp8":
        raise ValueError(f"frozen_weights='fp8' stores per-tensor FP8 codes: it needs granularity 'tensor', got "
                         f"{rec.granularity!r} (keep the frozen weights with frozen_weights='keep')")
    fam, layers = _find_layers(model)
    # every check runs before anything is changed: nothing half-done
    _refuse_accelerate_hooks(model)
    acts = [_check_layer(layer, fam, name) for name, layer in layers]
    fuse = fused_loss and hasattr(_inner_lm(model), "lm_head")
    if fuse:
        try:
            _check_forward(check_fused_loss(model)[1], "the final norm")  # the fused loss computes it
        except ValueError as e:
            raise ValueError(f"coat.convert(fused_loss=True): {e} (convert with fused_loss=False to keep Hugging "
                             f"Face's loss)") from None
    for (_, layer), act in zip(layers, acts):
        _convert_layer(layer, rec, fam, act)
    if frozen_weights == "fp8":
        freeze_to_fp8([layer for _, layer in layers], rec)
    lm = _inner_lm(model)
    if fuse:  # installed again: only the recipe changes (and the switch, on)
        install_fused_loss(model, recipe=rec, chunk_mib=getattr(lm, "coat_loss_chunk_mib", DEFAULT_CHUNK_MIB),
                           fp8_backward=getattr(lm, "coat_loss_fp8_backward", False))
        # The model's class is now coat.nn.loss's; a PEFT adapter saved from it names the
        # transformers class in its adapter_config.json all the same (what plain PEFT writes).
        adapters.plain_peft_auto_mapping()
    elif isinstance(lm, FusedCausalLMLossMixin):  # converted before with the fused loss: switched off
        lm.coat_fused_loss = False
    return model


def _check_args(model, recipe, frozen_weights: str, fused_loss: bool) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if frozen_weights not in FROZEN_WEIGHTS:
        raise ValueError(f"frozen_weights must be one of {FROZEN_WEIGHTS}, got {frozen_weights!r}")
    if not isinstance(fused_loss, bool):
        raise ValueError(f"fused_loss must be True or False, got {fused_loss!r}")
    if recipe == "bf16" and frozen_weights != "keep":
        raise ValueError("frozen_weights='fp8' needs an FP8 recipe (the bf16 recipe leaves the model as it is)")


def _refuse_converted(model: nn.Module) -> None:
    """The bf16 recipe leaves a model as it is; it cannot turn a converted one back."""
    for name, mod in model.named_modules():
        if isinstance(mod, Fp8DecoderLayerMixin):
            raise ValueError(f"coat.convert(recipe='bf16'): {name or 'the layer'} ({type(mod).__name__}) is already "
                             f"converted to FP8, and convert cannot undo a conversion: load the model again (the "
                             f"save_pretrained checkpoint of a converted model is plain transformers') to train it "
                             f"in bf16")


def _find_layers(model: nn.Module) -> tuple[Family, list[tuple[str, nn.Module]]]:
    """The model's family and its decoder layers, each with its name prefix ("" for a lone layer)."""
    fam = models.of_layer(model)
    if fam is not None:
        return fam, [("", model)]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    fam = models.by_model_type(model_type)
    if fam is None:
        raise ValueError(
            f"coat.convert supports {models.names()} models; got {type(model).__name__}"
            + (f" (model_type={model_type!r})" if model_type else "")
        )
    fam.check_config(model.config)
    layers = [(n + ".", m) for n, m in model.named_modules() if models.of_layer(m) is fam]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no {fam.layer_class} to convert")
    return fam, layers


def _inner_lm(model: nn.Module) -> nn.Module:
    """The causal LM inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model
