"""The one FP8 weight path of coat's layers: E4M3 codes of a weight, or of the separate weights of a
fused projection ([W_q; W_k; W_v], [W_gate; W_up]) read where they lie, with one per-tensor scale.
A layer block (``block.py``) takes its weight from a *source* (``source``): the live parameters,
the cache below, FP8-frozen codes, or the codes FSDP2 gathered under FP8 all-gather
(``gathered.py``).

Lifetime, by default (``Fp8Recipe(weight_cache=False)``, the live source): no FP8 copy of a weight
outlives the op that needs it. The block op (csrc/bindings/block.cpp) makes the codes itself:

- Forward: the row-major codes [N, K] (an amax pass, then one quantize pass over the separate
  parameters: no bf16 concatenation). They die with the forward GEMM; the layer saves only the
  4-byte scale.
- Backward: the transposed codes [K, N] that the input-gradient GEMM needs, from the same
  parameters with the forward's scale, in one pass (the kernel transposes through shared memory:
  no FP8 transpose copy). They die with that GEMM.

So between steps a converted model holds exactly what the unconverted model holds, and inside a
step at most the FP8 weight of the op running is alive. The price is that the bf16 weights are read
three times per step (amax, forward codes, backward codes: 6 B/param read, 2 B/param written), twice
where the optimizer step that wrote them also wrote their amax (``weight_amax``: coat's fused
optimizers do; the forward then needs no amax pass).

``Fp8Recipe(weight_cache=True)`` trades memory for those passes under gradient accumulation: the
codes and the transposed codes are made together, once per optimizer step, and kept until the next
``step()`` of any torch optimizer (a global step hook frees them) or ``invalidate_weight_cache()``.
That costs 2 bytes per parameter of the converted layers from the first micro-batch to the step.
The cache is keyed on each parameter's identity, version counter, storage and shape, so in-place
edits through the parameter (``with torch.no_grad(): p.mul_(...)``, ``load_state_dict``) and
``p.data = t`` are seen. It is used only by forwards that record gradients (training); no-grad,
inference-mode and compiled forwards always quantize afresh. Not seen: an in-place edit through
``p.data`` (a tensor sharing the storage with a version counter of its own) between two
micro-batches of one optimizer step; call ``invalidate_weight_cache()`` after such an edit. The
cache is refused under FSDP2 (it would keep FP8 copies of unsharded weights).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from .._ops import quantize as qops
from . import frozen
from . import gathered
from . import weight_amax
from .._ops._util import fmt_id
from .recipe import DEFAULT

__all__ = ["Fp8Weight", "source", "forward_codes", "backward_codes", "use_cache", "invalidate_weight_cache",
           "cached_bytes", "stats"]

#: Quantization passes over weights (tests and diagnostics): "forward" (amax + codes, or codes alone
#: with the optimizer's amax: counted in "optimizer_amax" too), "backward" (transposed codes),
#: "cached" (both at once, weight_cache=True), "hits".
stats = {"forward": 0, "backward": 0, "cached": 0, "hits": 0, "optimizer_amax": 0}


class Fp8Weight(NamedTuple):
    data: Optional[torch.Tensor]  # [N, K] FP8 codes (row-major), or None
    data_t: Optional[torch.Tensor]  # [K, N] FP8 codes (the transpose), or None
    scale: torch.Tensor  # [1] fp32 dequantization multiplier


# ---- the cache of weight_cache=True ----------------------------------------------------------------

# first parameter -> {ids of all parameters: (key, Fp8Weight)}; weak keys, so a deleted model's
# entries go with it.
_cache: WeakIdKeyDictionary = WeakIdKeyDictionary()


def invalidate_weight_cache() -> None:
    """Frees every cached FP8 weight (``weight_cache=True``); the next forward quantizes afresh."""
    _cache.clear()


def _on_optimizer_step(*_args, **_kwargs) -> None:
    if _cache:
        _cache.clear()


_step_hook = register_optimizer_step_post_hook(_on_optimizer_step)


def cached_bytes() -> int:
    """Bytes held by the weight cache now (0 unless ``weight_cache=True`` is in use)."""
    total = 0
    for per_first in list(_cache.values()):
        for _, w in per_first.values():
            total += sum(t.numel() * t.element_size() for t in (w.data, w.data_t, w.scale) if t is not None)
    return total


def _key(weights: Sequence[torch.Tensor]) -> tuple:
    return tuple((w._version, w.data_ptr(), tuple(w.shape), w.dtype) for w in weights)


def use_cache(enabled: bool, weights: Sequence[torch.Tensor]) -> bool:
    """Whether a layer's call may use the cache: asked where the layer is called (autograd
    Functions run their forward with grad disabled), only for training forwards."""
    return (
        enabled
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and not torch.is_inference_mode_enabled()
        and any(w.requires_grad for w in weights)
        and type(weights[0]) in (torch.Tensor, torch.nn.Parameter)
    )


def count(kind: str) -> None:
    """Counts a weight quantization pass in ``stats``."""
    if not torch.compiler.is_compiling():  # a side effect Dynamo must not trace
        stats[kind] += 1


def _lookup(weights: Sequence[torch.Tensor], dtype: torch.dtype) -> Optional[Fp8Weight]:
    per_first = _cache.get(weights[0])
    if per_first is None:
        return None
    hit = per_first.get(tuple(id(w) for w in weights))
    if hit is None or hit[0] != _key(weights) or hit[1].data.dtype != dtype:
        return None
    return hit[1]


def _cached(weights: Sequence[torch.Tensor], dtype: torch.dtype) -> Fp8Weight:
    hit = _lookup(weights, dtype)
    if hit is not None:
        count("hits")
        return hit
    q, q_t, scale = qops.quantize_stacked_amax(list(weights), fmt_id(dtype), True, True)
    count("cached")
    entry = Fp8Weight(q.view(dtype), q_t.view(dtype), scale)
    per_first = _cache.get(weights[0])
    if per_first is None:
        per_first = _cache[weights[0]] = {}
    per_first[tuple(id(w) for w in weights)] = (_key(weights), entry)
    return entry


# ---- the sources a block takes its weight from ------------------------------------------------------

#: Where a layer block's FP8 weight comes from (``source``): "live" (the parameters, quantized by the
#: block op itself in each direction: the default lifetime above), "cached" (``weight_cache=True``),
#: "frozen" (FP8-frozen codes, ``frozen.py``), "gathered" (codes FSDP2 gathered under FP8 all-gather,
#: ``gathered.py``). Weights FSDP2 gathers in their own dtype reach the block as live parameters.
LIVE, CACHED, FROZEN, GATHERED = "live", "cached", "frozen", "gathered"


def source(cache: bool, frozen_scales: Optional[Sequence[torch.Tensor]], weights: Sequence[torch.Tensor] = ()) -> str:
    """The source of a layer call's weight: ``cache`` as ``use_cache`` decided, ``frozen_scales``
    the scales of FP8-frozen codes (or None), ``weights`` the call's (FP8-gathered or not)."""
    if gathered.is_gathered(weights):
        return GATHERED
    return FROZEN if frozen_scales is not None else CACHED if cache else LIVE


def forward_codes(src: str, weights: Sequence[torch.Tensor], frozen_scales: Optional[Sequence[torch.Tensor]] = None,
                  dtype: torch.dtype = DEFAULT.act_dtype) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(row-major FP8 codes [N, K] of cat(weights, 0) in ``dtype``, the recipe's weight format, and
    their scale) for the forward GEMM, or None where the block op quantizes the live parameters
    itself (counted here as a "forward" pass)."""
    if src == FROZEN:
        return frozen.group_codes(weights, frozen_scales)
    if src == GATHERED:
        return gathered.group_codes(weights, dtype)
    if src == CACHED:
        w = _cached(weights, dtype)
        return w.data, w.scale
    count("forward")
    return None


def optimizer_amax(src: str, weights: Sequence[torch.Tensor], granularity: str) -> Optional[list[torch.Tensor]]:
    """The amax of each weight from the optimizer step that wrote it (``weight_amax``), for a live
    forward at per-tensor granularity whose weights all hold a current one; else None (the block op
    runs the amax pass)."""
    if src != LIVE or granularity != "tensor":
        return None
    amax = weight_amax.current(weights)
    if amax is not None:
        count("optimizer_amax")
    return amax


def backward_codes(src: str, weights: Sequence[torch.Tensor], scale: torch.Tensor,
                   dtype: torch.dtype = DEFAULT.act_dtype) -> Optional[torch.Tensor]:
    """Transposed FP8 codes [K, N] of cat(weights, 0) with the forward's ``scale`` for the
    input-gradient GEMM: the FP8-frozen or FP8-gathered codes transposed, the cached copy when the forward used the
    cache and the weights have not changed since, else None: the block op quantizes the live
    parameters with ``scale`` itself (counted here as a "backward" pass)."""
    if src == FROZEN:
        return frozen.group_codes_t(weights)
    if src == GATHERED:
        return gathered.group_codes_t(weights, dtype)
    if src == CACHED:
        entry = _lookup(weights, dtype)
        if entry is not None and entry.scale is scale:
            count("hits")
            return entry.data_t
    count("backward")
    return None
