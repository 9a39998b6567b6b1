"""Each weight's amax from the optimizer step that wrote it: group scaling for the weights.

coat's layer blocks quantize their bf16 weights to E4M3 afresh in every forward (``weights.py``,
the live source), and per-tensor scaling needs the weight's amax first: a pass that reads the
whole weight only to find its largest value. The weight's producer is the optimizer step, which
reads and writes every element anyway. So coat's fused optimizers (``coat.optim.AdamW``,
``AdamW4bit``) write the largest finite |value| of each 2-D parameter they update into a slot of
its own (``AdamwTensor::param_amax``, folded in the step's own pass), and a forward whose weights
all hold a current amax quantizes with the max of theirs (``quantize_stacked_from_part_amax``):
the same codes and scale bit for bit, without the amax pass.

Current means: the parameter is the same tensor (data pointer, shape, dtype) at the same version
counter as right after the step that wrote the slot, and the forward trains (grad on, a weight
requires grad). An in-place edit through the parameter (``with torch.no_grad(): p.mul_(2)``,
``load_state_dict``), ``p.data = t``, a moved model, a step GradScaler may skip: the amax is not
current and the forward runs the amax pass. Evaluation forwards (no grad, inference mode) always run
it, so weights swapped in for evaluation through ``p.data`` (EMA weights) are quantized right.

Not seen, as autograd does not see them either: writes that move no version counter between a step
and the next training forward: through ``p.data`` or a NumPy view, and torch.distributed collectives
on a parameter (``dist.all_reduce(p)``, ``dist.broadcast(p, 0)``). Call ``forget()`` after such a
write (or set ``ENABLED = False``). Unseen, a value raised above the recorded amax encodes as NaN,
never as a silently clipped code, and so do the GEMM outputs it enters (from there NaN usually
reaches the loss; PyTorch's CPU attention, though, turns all-NaN query rows into zeros); values
lowered below it quantize with the recorded, coarser scale (in range, not bit for bit the amax
pass's codes).

Compiled forwards and FSDP2's gathered weights (the optimizer steps their shards) always run the
amax pass, and so do forwards captured in a CUDA graph (whose replays would read the slot after
edits no capture sees), except inside ``readable_in_capture()``: ``coat.CudaGraphStep`` uses it,
replays the forward only after the captured optimizer step that rewrites the slots, and before a
replay rewrites the slots of parameters whose version counters moved outside its step (``refresh``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterable, Iterator, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._ops import quantize as _quantize

__all__ = ["ENABLED", "wants_slot", "slot", "written", "current", "refresh", "forget", "readable_in_capture",
           "recording_captured_writes", "captured"]

#: False: no optimizer writes a slot and every forward runs the amax pass (the same codes and
#: scales bit for bit), kept for A/B measurement and the tests that hold the two equal.
ENABLED = True

# parameter -> fp32 [1] on its device. Kept for the parameter's life: a descriptor table (and a
# CUDA graph that captured the step) holds the slot's address.
_slots: WeakIdKeyDictionary = WeakIdKeyDictionary()
# parameter -> its _key right after a step wrote its slot
_written: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _key(p: torch.Tensor) -> tuple:
    return p._version, p.data_ptr(), tuple(p.shape), p.dtype, p.device


def wants_slot(p: torch.Tensor) -> bool:
    """Whether an optimizer step should write p's amax: a plain 2-D floating parameter (a layer's
    weight; DTensor shards are not what a layer reads)."""
    return (ENABLED and p.dim() == 2 and p.is_floating_point() and p.numel() > 0
            and type(p) in (torch.Tensor, torch.nn.Parameter))


def slot(p: torch.Tensor) -> torch.Tensor:
    """p's slot (made on first use, and again for a parameter moved to another device)."""
    s = _slots.get(p)
    if s is None or s.device != p.device:
        s = _slots[p] = torch.zeros(1, dtype=torch.float32, device=p.device)
        _written.pop(p, None)
    return s


def written(params: Iterable[torch.Tensor]) -> None:
    """A step has written the slots of ``params`` (zeroed before it, then folded by its kernel) and
    the parameters with them; call after the step's version bumps."""
    for p in params:
        _written[p] = _key(p)


def refresh(params: Iterable[torch.Tensor]) -> bool:
    """Writes the slots of ``params`` (those that have one) with the amax of the weights as they are
    now, in place (a CUDA graph that reads a slot keeps reading it), and records them as current.
    False where one could not be written (the caller then cannot rely on the slot)."""
    ok = True
    for p in params:
        s = _slots.get(p)
        if s is None:
            continue
        if s.device != p.device or not p.is_contiguous():
            forget([p])
            ok = False
            continue
        with torch.no_grad():
            s.copy_(_quantize.amax_stacked([p.detach()]))
        _written[p] = _key(p)
    return ok


def forget(params: Optional[Iterable[torch.Tensor]] = None) -> None:
    """The amax of ``params`` (all, if None) is no longer current: their next forwards run the amax
    pass. Needed only after an in-place edit through ``p.data``, which no version counter sees."""
    if params is None:
        _written.clear()
        return
    for p in params:
        _written.pop(p, None)


_capture = threading.local()


@contextlib.contextmanager
def _collecting(name: str) -> Iterator[list]:
    """A list that this thread's ``_capture.<name>`` points at while the context is open."""
    old = getattr(_capture, name, None)
    out: list = []
    setattr(_capture, name, out)
    try:
        yield out
    finally:
        setattr(_capture, name, old)


def readable_in_capture() -> contextlib.AbstractContextManager[list]:
    """Within, a forward captured in a CUDA graph reads the current slots (the graph then reads them
    at every replay: the caller must replay it only while the slots hold the weights' amax). Yields
    the list of the parameters whose slots were handed out, for the caller to watch."""
    return _collecting("read")


def recording_captured_writes() -> contextlib.AbstractContextManager[list]:
    """Within, a captured optimizer step lists the parameters whose slots its replays write
    (``captured``): the caller records them as current after each replay (``written``)."""
    return _collecting("writes")


def captured(params: Iterable[torch.Tensor]) -> None:
    """A step being captured writes the slots of ``params`` at each replay (not now)."""
    writes = getattr(_capture, "writes", None)
    if writes is not None:
        writes.extend(params)


def _traced(w: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return True
    return w.is_cuda and torch.cuda.is_current_stream_capturing() and getattr(_capture, "read", None) is None


def current(weights: Sequence[torch.Tensor]) -> Optional[list[torch.Tensor]]:
    """The slots of ``weights`` (one per part of a fused projection) when every one holds the amax
    of the weight as it is now, else None (the forward then runs the amax pass)."""
    if torch.compiler.is_compiling() or not ENABLED or not weights or not _written or _traced(weights[0]):
        return None  # compiling first: Dynamo does not trace into the weak dictionary
    out = []
    for w in weights:
        k = _written.get(w)
        if k is None or k != _key(w):
            return None
        out.append(_slots[w])
    read = getattr(_capture, "read", None)
    if read is not None and weights[0].is_cuda and torch.cuda.is_current_stream_capturing():
        read.extend(weights)
    return out
