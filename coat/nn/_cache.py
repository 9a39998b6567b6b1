"""The KV-cache argument of Hugging Face forwards, whatever the installed transformers calls it.

transformers 5.0 (to 5.17 at least) passes ``past_key_values`` to the causal LM, the model, each
decoder layer and its attention; 5.24 passes ``cache`` (and still accepts ``past_key_values``
through a deprecation shim on its own forwards, which coat's forwards replace). A forward that
reads only one name and meets the other leaves the cache empty: every cached decoding step then
attends to its own token only. coat's forwards take the cache under either name."""

from __future__ import annotations

import inspect

#: Newest first.
CACHE_NAMES = ("cache", "past_key_values")


def pop_cache(kwargs: dict, cache=None):
    """The KV cache given as ``cache`` or in ``kwargs`` under any of its names (removed from
    ``kwargs``); None if none is given."""
    for name in CACHE_NAMES:
        other = kwargs.pop(name, None)
        if other is None:
            continue
        if cache is not None and other is not cache:
            raise ValueError(f"two different KV caches given (cache= and {name}=); pass one, as cache=")
        cache = other
    return cache


def cache_name(forward) -> str:
    """The name a Hugging Face ``forward`` takes the KV cache under: coat passes it on under this
    name only, as 5.24 warns (FutureWarning, "will be removed in version 5.40.0") whenever a
    forward it decorates gets ``past_key_values``, even as None."""
    params = inspect.signature(forward).parameters
    return next((n for n in CACHE_NAMES if n in params), CACHE_NAMES[-1])
