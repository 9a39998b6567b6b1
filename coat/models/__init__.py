"""Model families coat converts, one file each (``family.py`` says what a description holds)."""

from __future__ import annotations

from .family import ACTIVATIONS, GROUPS, PROJECTIONS, Family
from .gemma import GEMMA3
from .llama import LLAMA
from .mistral import MISTRAL
from .qwen import QWEN2, QWEN3

__all__ = ["ACTIVATIONS", "FAMILIES", "Family", "GEMMA3", "GROUPS", "LLAMA", "MISTRAL", "PROJECTIONS", "QWEN2", "QWEN3",
           "by_model_type", "names", "of_layer"]

#: Every supported family, in the order messages list them.
FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3)
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_LAYER = {f.layer_class: f for f in FAMILIES}


def names() -> str:
    """'Llama, Mistral, Qwen2, Qwen3 and Gemma 3', for messages."""
    ns = [f.name for f in FAMILIES]
    return ", ".join(ns[:-1]) + " and " + ns[-1]


def by_model_type(model_type: str | None) -> Family | None:
    return _BY_TYPE.get(model_type)


def of_layer(layer) -> Family | None:
    """The family whose decoder layer class ``layer`` is (or subclasses)."""
    for cls in type(layer).__mro__:
        fam = _BY_LAYER.get(cls.__name__)
        if fam is not None:
            return fam
    return None
