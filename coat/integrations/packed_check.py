"""Hugging Face's check for packed sequences, skipped where the answer is known.

``transformers.masking_utils.find_packed_sequence_indices`` is wrapped once, process-wide, by a
function that answers "not packed" while ``_UnpackedPositions`` is on in the calling thread and
calls Hugging Face's own check otherwise (``FusedCausalLMLossMixin`` in coat/nn/loss.py turns it on
for forwards whose positions the model derives itself)."""

from __future__ import annotations

import functools
import threading

import torch


class _UnpackedPositions:
    """While on (in this thread), Hugging Face's check for packed sequences answers "not packed"
    without looking.

    When a forward gets neither ``position_ids`` nor an attention mask, a KV cache or
    ``cache_position``, the model derives the positions itself as ``arange(seq)``: provably one
    sequence per row. Hugging Face still checks them for packed sequences
    (``masking_utils.find_packed_sequence_indices``) and reads the answer on the host, which
    synchronizes with the GPU at the start of every training forward: the host then starts each
    step with an empty launch queue, and at small batches the forward's kernels wait on Python.
    Here the answer is known, so the check is skipped; every other call (other threads, forwards
    with positions or masks of their own) runs Hugging Face's check."""

    _local = threading.local()

    def __init__(self, on: bool):
        # Under torch.compile Hugging Face skips the check itself (is_tracing), and the wrapper
        # must not be installed from traced code.
        self.on = on and not torch.compiler.is_compiling() and _wrap_packed_check()

    def __enter__(self):
        if self.on:
            self._local.depth = getattr(self._local, "depth", 0) + 1

    def __exit__(self, *exc):
        if self.on:
            self._local.depth -= 1


@functools.cache
def _wrap_packed_check() -> bool:
    """Puts the thread-aware wrapper around Hugging Face's check, once; False where there is none."""
    try:
        import transformers.masking_utils as mu
    except ImportError:
        return False
    check = getattr(mu, "find_packed_sequence_indices", None)
    if check is None:
        return False
    if getattr(check, "_coat_wrapper", False):  # installed already (a re-imported coat)
        return True

    _UnpackedPositions.check = staticmethod(check)  # Hugging Face's own, called through here

    @functools.wraps(check)
    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        if getattr(_UnpackedPositions._local, "depth", 0):
            return None
        return _UnpackedPositions.check(position_ids, *args, **kwargs)

    find_packed_sequence_indices._coat_wrapper = True
    mu.find_packed_sequence_indices = find_packed_sequence_indices
    return True
