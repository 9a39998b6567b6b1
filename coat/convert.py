"""``coat.convert``: switch a Hugging Face Llama-family model to the FP8 precision flow in place.

Each decoder layer, its attention and its MLP get a subclass of their own class whose forward runs
the FP8 blocks of ``coat.nn``; every submodule and parameter stays where it was, so state-dict keys
do not change and ``save_pretrained`` writes a checkpoint plain transformers loads. Models:
Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k norms), with GQA, any attention implementation
the model is configured with (SDPA by default), KV caches (``generate``), padding masks and
gradient checkpointing. The final norm and the LM head stay as they are.
"""

from __future__ import annotations

from torch import nn

from .nn import adapters
from .nn.attention import Fp8AttentionMixin
from .nn.frozen import freeze_to_fp8
from .nn.loss import install_fused_loss
from .nn.layer import Fp8DecoderLayerMixin
from .nn.mlp import Fp8SwiGLUMixin
from .nn.recipe import Fp8Recipe, resolve

#: model_type -> decoder layer class name.
SUPPORTED = {
    "llama": "LlamaDecoderLayer",
    "mistral": "MistralDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "qwen3": "Qwen3DecoderLayer",
}
_LAYER_NAMES = set(SUPPORTED.values())
_SUBCLASSES: dict = {}


_MIXIN_BY_SUFFIX = (("DecoderLayer", Fp8DecoderLayerMixin), ("Attention", Fp8AttentionMixin), ("MLP", Fp8SwiGLUMixin))
_HF_MODULES = {t: f"transformers.models.{t}.modeling_{t}" for t in SUPPORTED}


def __getattr__(name: str) -> type:
    """Rebuilds a converted class by name, so that ``torch.save(model)`` of a converted model loads in
    a process that has not converted anything yet (pickle finds classes as module attributes)."""
    import importlib

    if name.startswith("Fp8"):
        base_name = name[3:]
        for suffix, mixin in _MIXIN_BY_SUFFIX:
            if base_name.endswith(suffix):
                for mod_name in _HF_MODULES.values():
                    base = getattr(importlib.import_module(mod_name), base_name, None)
                    if base is not None:
                        return _subclass(base, mixin)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _subclass(cls: type, mixin: type) -> type:
    if issubclass(cls, mixin):
        return cls
    key = (cls, mixin)
    if key not in _SUBCLASSES:
        name = "Fp8" + cls.__name__
        sub = type(name, (mixin, cls), {"__module__": __name__, "__qualname__": name,
                                        "_coat_hf_module": cls.__module__})
        _SUBCLASSES[key] = sub
        globals()[name] = sub  # lets pickle find the class in a process that converted the same model
    return _SUBCLASSES[key]


_PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def _check_projections(layer: nn.Module, prefix: str) -> None:
    """Every projection is a plain nn.Linear or a PEFT LoRA layer around one (anything else would be
    read past silently, so it is refused here, naming it)."""
    for block, names in _PROJECTIONS.items():
        for n in names:
            full = f"{prefix}{block}.{n}"
            mod = getattr(getattr(layer, block), n, None)
            if mod is None:
                raise ValueError(f"coat.convert: {full} is missing: not a Llama-family decoder layer")
            adapters.base_linear(mod, full)
            adapters.check_adapters(mod, full)


def _convert_layer(layer: nn.Module, recipe: Fp8Recipe, prefix: str = "") -> None:
    for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
        if not hasattr(layer, name):
            raise ValueError(f"{type(layer).__name__} has no {name!r}: not a Llama-family decoder layer")
    _check_projections(layer, prefix)
    cfg = getattr(layer.self_attn, "config", None)
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"coat.convert supports SwiGLU MLPs (hidden_act 'silu'), got hidden_act={act!r}")
    layer.self_attn.__class__ = _subclass(type(layer.self_attn), Fp8AttentionMixin)
    layer.mlp.__class__ = _subclass(type(layer.mlp), Fp8SwiGLUMixin)
    layer.__class__ = _subclass(type(layer), Fp8DecoderLayerMixin)
    layer.self_attn.coat_recipe = recipe
    layer.mlp.coat_recipe = recipe


def _is_layer(m: nn.Module) -> bool:
    return any(c.__name__ in _LAYER_NAMES for c in type(m).__mro__)


FROZEN_WEIGHTS = ("keep", "fp8")


def convert(model: nn.Module, recipe: str | Fp8Recipe = "fp8", frozen_weights: str = "keep",
            fused_loss: bool = True) -> nn.Module:
    """Converts ``model`` (a Hugging Face Llama/Mistral/Qwen2/Qwen3 model, or one decoder layer)
    in place and returns it. ``recipe``: "fp8" / "coat" (FP8 GEMMs, FP8 saved activations with fp32
    group scales), "fp8-e8m0" (power-of-two group scales), an ``Fp8Recipe``, or "bf16" (no change).
    ``frozen_weights="fp8"`` stores every projection group whose weights are all frozen
    (requires_grad False: a LoRA base, frozen layers) as FP8 codes only, 1 byte per parameter
    (``coat/nn/frozen.py``; the state dict and ``save_pretrained`` hold them dequantized to their
    dtype, as plain transformers loads them); call convert again after freezing more (e.g. after
    ``peft.get_peft_model``: a group frozen after ``frozen_weights="fp8"`` and not stored in FP8 by
    a second convert is refused at the next forward, naming this). ``fused_loss`` (default on): a
    causal LM called with ``labels`` runs its final norm, LM head and cross-entropy chunk by chunk
    (``coat/nn/loss.py``): the [tokens, vocab] logits never exist, and the output's ``logits`` is
    None; call without labels (or set ``model.coat_fused_loss = False``) to get logits. Converting twice only updates the recipe (and
    stores newly frozen groups in FP8)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if frozen_weights not in FROZEN_WEIGHTS:
        raise ValueError(f"frozen_weights must be one of {FROZEN_WEIGHTS}, got {frozen_weights!r}")
    if recipe == "bf16":
        if frozen_weights != "keep":
            raise ValueError("frozen_weights='fp8' needs an FP8 recipe (the bf16 recipe leaves the model as it is)")
        return model
    rec = resolve(recipe)
    if _is_layer(model):
        layers = [("", model)]
    else:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in SUPPORTED:
            raise ValueError(
                f"coat.convert supports Llama, Mistral, Qwen2 and Qwen3 models; got {type(model).__name__}"
                + (f" (model_type={model_type!r})" if model_type else "")
            )
        layers = [(n + ".", m) for n, m in model.named_modules() if _is_layer(m)]
        if not layers:
            raise ValueError(f"{type(model).__name__} has no {SUPPORTED[model_type]} to convert")
    for name, layer in layers:  # every layer is checked before any is converted: nothing half-done
        _check_projections(layer, name)
    for name, layer in layers:
        _convert_layer(layer, rec, name)
    if frozen_weights == "fp8":
        freeze_to_fp8([layer for _, layer in layers])
    if not isinstance(fused_loss, bool):
        raise ValueError(f"fused_loss must be True or False, got {fused_loss!r}")
    if fused_loss and hasattr(_inner_lm(model), "lm_head"):
        install_fused_loss(model)
        # The model's class is now coat.nn.loss's; a PEFT adapter saved from it names the
        # transformers class in its adapter_config.json all the same (what plain PEFT writes).
        adapters.plain_peft_auto_mapping()
    return model


def _inner_lm(model: nn.Module) -> nn.Module:
    """The causal LM inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model
