"""coat's subclasses of transformers' classes, made at run time and found again by name.

``coat.convert`` swaps a decoder layer's class (and its attention's and MLP's) for ``(mixin, hf
class)``; the fused loss does the same to the causal LM and its final norm. The subclasses are
named as ``coat.convert`` and ``coat.nn.loss`` have always named them (``Fp8LlamaDecoderLayer``,
``DeferrableLlamaRMSNorm``, ``LlamaForCausalLM``) and live in those modules, so ``torch.save`` of a
converted model, pickled by class name, loads in a fresh process: the module's ``__getattr__``
calls ``rebuild`` here, which finds the transformers class in the families' modules
(``coat.models``) and makes the subclass again.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from .. import models

_SUBCLASSES: dict[tuple[type, type], type] = {}


def subclass(cls: type, mixin: type, name: str, module: str, attrs: dict[str, Any] | None = None) -> type:
    """``type(name, (mixin, cls))`` placed in ``module`` (made once per (cls, mixin)); ``cls``
    itself when it already is one."""
    if issubclass(cls, mixin):
        return cls
    key = (cls, mixin)
    if key not in _SUBCLASSES:
        sub = type(name, (mixin, cls), {"__module__": module, "__qualname__": name, **(attrs or {})})
        _SUBCLASSES[key] = sub
        # lets pickle find the class in this process; another process rebuilds it (module docstring)
        setattr(sys.modules[module], name, sub)
    return _SUBCLASSES[key]


def hf_class(name: str) -> type | None:
    """The class ``name`` of a supported family's transformers module, or None."""
    for fam in models.FAMILIES:
        try:
            mod = importlib.import_module(fam.module_path)
        except ImportError:  # a family this transformers does not have
            continue
        cls = getattr(mod, name, None)
        if isinstance(cls, type):
            return cls
    return None


def rebuild(module: str, name: str, parse: Callable[[str], tuple[str, type, dict[str, Any] | None] | None]) -> type:
    """A module ``__getattr__``'s answer for ``name``: ``parse(name)`` gives (transformers class
    name, mixin, extra class attributes) or None when ``name`` is none of the module's subclasses."""
    parsed = parse(name)
    base = hf_class(parsed[0]) if parsed is not None else None
    if base is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    base_name, mixin, attrs = parsed
    return subclass(base, mixin, name, module, attrs(base) if callable(attrs) else attrs)
