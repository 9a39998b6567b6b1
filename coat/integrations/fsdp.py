"""FSDP2 for Hugging Face causal LMs: one ``fully_shard`` unit per ``layers_per_unit`` decoder
layers and the root, and deferred initialization: build a model whose matrices exist only on the
meta device, shard it, then give each rank memory for its own shards alone.

A 70B model is 140 GB in bf16: built whole on one GPU before ``fully_shard`` it would not fit, and
built on the meta device entirely it would lose the values of its non-persistent buffers (RoPE's
inverse frequencies), which nothing re-creates. So only parameters of two or more dimensions go to
the meta device as they are registered; vectors (norm weights, biases) and buffers are small and
keep the values their modules gave them. ``materialize`` allocates after sharding and draws the
matrices from N(0, std), the Hugging Face initialization of Linear and Embedding weights, each rank
its own rows of each matrix.
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
    return any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


# Matrices are drawn in blocks of this many rows, each from its own generator (seeded by the base
# seed, the parameter's name and the block's index): a rank draws the blocks its shard overlaps,
# so every rank's shard is different and the whole matrix is the same at any world size.
ROWS_PER_BLOCK = 1024
_MASK64 = (1 << 64) - 1


def _mix(*words: int) -> int:
    """A 63-bit seed from integers (splitmix64 finalizer over each word in turn)."""
    z = 0
    for w in words:
        z = ((z ^ (w & _MASK64)) * 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
    return z >> 1


def _row_range(name: str, t: torch.Tensor) -> tuple[int, int]:
    """(first row, number of rows) of ``t``'s local part in the whole matrix: all of a plain
    tensor; a DTensor's dim-0 shard over a 1-D mesh (torch.chunk's split, as FSDP2's). Anything
    else is refused rather than filled with draws that other ranks might repeat."""
    if not hasattr(t, "to_local"):
        return 0, t.shape[0]
    from torch.distributed.tensor import Shard

    mesh, placements = t.device_mesh, t.placements
    if mesh.ndim != 1 or len(placements) != 1 or not (isinstance(placements[0], Shard) and placements[0].dim == 0):
        raise ValueError(f"materialize: {name} is placed {placements} on a {mesh.ndim}-D mesh; only dim-0 shards "
                         "over a 1-D mesh (fully_shard's default) are supported")
    rows, world, rank = t.shape[0], mesh.size(), mesh.get_local_rank()
    per = -(-rows // world)
    first = min(rank * per, rows)
    n = min(per, rows - first)
    if _local(t).shape[0] != n:
        raise ValueError(f"materialize: {name}'s shard has {_local(t).shape[0]} rows, expected {n} of {rows} "
                         f"(rank {rank} of {world})")
    return first, n


def _fill_normal(name: str, t: torch.Tensor, std: float, seed: int) -> None:
    local = _local(t)
    first, n = _row_range(name, t)
    key = _mix(*name.encode())
    for b in range(first // ROWS_PER_BLOCK, -(-(first + n) // ROWS_PER_BLOCK)):
        b0, b1 = b * ROWS_PER_BLOCK, min((b + 1) * ROWS_PER_BLOCK, t.shape[0])
        gen = torch.Generator(device=local.device).manual_seed(_mix(seed, key, b))
        lo, hi = max(b0, first), min(b1, first + n)
        if (lo, hi) == (b0, b1):  # the whole block is local: draw it in place
            local[lo - first:hi - first].normal_(0.0, std, generator=gen)
        else:
            block = torch.empty((b1 - b0, *t.shape[1:]), dtype=local.dtype, device=local.device)
            local[lo - first:hi - first].copy_(block.normal_(0.0, std, generator=gen)[lo - b0:hi - b0])


def _zero_padding_rows(model: nn.Module, drawn: set[int]) -> None:
    """Zero each drawn embedding's ``padding_idx`` row (on the rank whose shard holds it), as
    ``nn.Embedding`` and Hugging Face's initialization do."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding) and m.padding_idx is not None and id(m.weight) in drawn:
            first, n = _row_range(f"{name}.weight", m.weight)
            row = m.padding_idx % m.weight.shape[0]
            if first <= row < first + n:
                _local(m.weight)[row - first].zero_()


def _retie(model: nn.Module, aliases: list[list[str]]) -> None:
    """Make each group of parameter names one parameter again (``to_empty`` gives every module
    of a tied, unsharded model its own new tensor)."""
    for names in aliases:
        first = model.get_parameter(names[0])
        for alias in names[1:]:
            owner, _, leaf = alias.rpartition(".")
            if model.get_parameter(alias) is not first:
                setattr(model.get_submodule(owner), leaf, first)


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, std: float | None = None,
                generator: torch.Generator | None = None) -> None:
    """Allocate ``model``'s meta parameters on ``device`` (after ``fully_shard``: each rank's shards
    only) and fill them from N(0, ``std``) (default: the config's ``initializer_range``, else 0.02),
    an embedding's padding row zero; every tensor that was not on the meta device keeps its value,
    and tied parameters stay tied. The draws depend on a base seed taken from ``generator`` (default:
    torch's global one, which every rank seeds alike) and not on the world size: a matrix is the
    same whole as sharded over any number of ranks. ``ValueError`` if a parameter is on a device
    other than ``device`` or meta (the model would end up split across devices), or if a meta
    tensor is a buffer or a vector (only ``matrices_on_meta``'s matrices can be drawn: norms,
    biases and RoPE's frequencies would get random values)."""
    device = torch.device(device)
    if std is None:
        std = float(getattr(getattr(model, "config", None), "initializer_range", 0.02))
    if not std > 0:
        raise ValueError(f"materialize: std must be > 0, got {std}")
    params = dict(model.named_parameters())
    meta, kept = [], {}
    for name, t in [*params.items(), *model.named_buffers()]:
        if t.device.type == "meta":
            if name not in params or t.dim() < 2:
                raise ValueError(f"materialize: {name} is a meta {'buffer' if name not in params else 'vector'}; "
                                 "only matrices can be drawn: build the model under matrices_on_meta(), which "
                                 "keeps vectors and buffers real")
            meta.append(name)
        elif t.device.type != device.type:
            raise ValueError(f"materialize: {name} is on {t.device}, not on {device} or meta: move the model's "
                             f"real tensors to {device} (or shard them there) before materializing")
        else:
            kept[name] = _local(t).detach().clone()
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator,
                             device=generator.device if generator is not None else "cpu"))
    model.to_empty(device=device)  # FSDP2 re-registers its sharded parameters on the new storage
    _retie(model, [names for names in groups.values() if len(names) > 1])
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    for name, value in kept.items():
        _local(tensors[name]).copy_(value)
    for name in meta:
        _fill_normal(name, tensors[name], std, seed)
    _zero_padding_rows(model, {id(tensors[name]) for name in meta})


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
          layers_per_unit: int = 1, fp8_all_gather: bool = False) -> nn.Module:
    """``fully_shard`` every ``layers_per_unit`` consecutive decoder layers as one unit (one
    all-gather and one reduce-scatter each), then the root (embeddings, final norm, LM head); a
    model built under ``matrices_on_meta`` is then materialized on ``device``. More layers per unit
    mean fewer, larger collectives and fewer hooks on the host, and that many more layers' weights
    unsharded at a time. ``fp8_all_gather``: gather the converted layers' weights as FP8 codes
    (``fp8_gather``; every decoder layer converted with per-tensor FP8 scaling, else ``ValueError``;
    FP8-frozen groups keep FSDP2's own gather of their codes; refused with CPU offloading or
    ``reshard_after_forward`` as a group size). Off by default: it halves the gathered bytes but
    adds host work per weight and gather (RESULTS.md section 46)."""
    from torch.distributed.fsdp import fully_shard

    from . import fp8_gather

    layers = decoder_layers(model)
    if not isinstance(layers_per_unit, int) or not 1 <= layers_per_unit <= len(layers):
        raise ValueError(f"layers_per_unit must be an integer from 1 to the model's {len(layers)} decoder layers, "
                         f"got {layers_per_unit!r}")
    if fp8_all_gather and any(fp8_gather.weight_groups(layer) is None for layer in layers):
        raise ValueError("fp8_all_gather=True needs every decoder layer converted with per-tensor FP8 scaling "
                         "(coat.convert with a recipe of granularity 'tensor'); shard with fp8_all_gather=False")
    kw = {"mesh": mesh} | ({"mp_policy": mp_policy} if mp_policy is not None else {})
    units = [layers[i:i + layers_per_unit] for i in range(0, len(layers), layers_per_unit)]
    for unit in units:
        fully_shard(unit if len(unit) > 1 else unit[0], **kw)
    fully_shard(model, **kw)
    if has_meta(model):
        materialize(model, device)
    if fp8_all_gather:
        fp8_gather.install(units)
    return model
