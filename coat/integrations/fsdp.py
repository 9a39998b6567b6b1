"""FSDP2 for Hugging Face causal LMs: one ``fully_shard`` unit per ``layers_per_unit`` decoder
layers and the root, and deferred initialization: build a model whose matrices exist only on the
meta device, shard it, then give each rank memory for its own shards alone.

A 70B model is 140 GB in bf16: built whole on one GPU before ``fully_shard`` it would not fit, and
built on the meta device entirely it would lose the values of its non-persistent buffers (RoPE's
inverse frequencies), which nothing re-creates. So only parameters of two or more dimensions go to
the meta device as they are registered; vectors (norm weights, biases) and buffers are small and
keep the values their modules gave them. ``materialize`` allocates after sharding and draws the
matrices from N(0, std), the Hugging Face initialization of Linear and Embedding weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


@contextmanager
def matrices_on_meta() -> Iterator[None]:
    """While active, every parameter of two or more dimensions a module registers is replaced by
    an empty meta-device parameter of the same shape, dtype and ``requires_grad``."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.dim() >= 2 and param.device.type != "meta":
            param = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def has_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, std: float | None = None,
                generator: torch.Generator | None = None) -> None:
    """Allocate ``model``'s meta parameters on ``device`` (after ``fully_shard``: each rank's shards
    only) and fill them from N(0, ``std``) (default: the config's ``initializer_range``, else 0.02);
    every tensor that was not on the meta device keeps its value. ``ValueError`` if a parameter
    is on a device other than ``device`` or meta (the model would end up split across devices)."""
    device = torch.device(device)
    if std is None:
        std = float(getattr(getattr(model, "config", None), "initializer_range", 0.02))
    if not std > 0:
        raise ValueError(f"materialize: std must be > 0, got {std}")
    meta, kept = [], {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type == "meta":
            meta.append(name)
        elif t.device.type != device.type:
            raise ValueError(f"materialize: {name} is on {t.device}, not on {device} or meta: move the model's "
                             f"real tensors to {device} (or shard them there) before materializing")
        else:
            kept[name] = _local(t).detach().clone()
    model.to_empty(device=device)  # FSDP2 re-registers its sharded parameters on the new storage
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    for name, value in kept.items():
        _local(tensors[name]).copy_(value)
    for name in meta:
        _local(tensors[name]).normal_(0.0, std, generator=generator)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a Hugging Face Llama-family causal LM (``model.model.layers``; inside a
    PEFT model, its base model's)."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        model = get_base()
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: not a Llama-family causal LM")
    return list(layers)


def shard(model: nn.Module, mesh: Any, device: torch.device | str, mp_policy: Any = None,
          layers_per_unit: int = 1) -> nn.Module:
    """``fully_shard`` every ``layers_per_unit`` consecutive decoder layers as one unit (one
    all-gather and one reduce-scatter each), then the root (embeddings, final norm, LM head); a
    model built under ``matrices_on_meta`` is then materialized on ``device``. More layers per unit
    mean fewer, larger collectives and fewer hooks on the host, and that many more layers' weights
    unsharded at a time."""
    from torch.distributed.fsdp import fully_shard

    layers = decoder_layers(model)
    if not isinstance(layers_per_unit, int) or not 1 <= layers_per_unit <= len(layers):
        raise ValueError(f"layers_per_unit must be an integer from 1 to the model's {len(layers)} decoder layers, "
                         f"got {layers_per_unit!r}")
    kw = {"mesh": mesh} | ({"mp_policy": mp_policy} if mp_policy is not None else {})
    for i in range(0, len(layers), layers_per_unit):
        unit = layers[i:i + layers_per_unit]
        fully_shard(unit if len(unit) > 1 else unit[0], **kw)
    fully_shard(model, **kw)
    if has_meta(model):
        materialize(model, device)
    return model
