"""The adamw4 family: the fused AdamW step with 4-bit states over a table of tensor descriptors.

Like ``coat._ops.adamw``, not a ``torch.library`` custom op: the step mutates parameters and states
through the raw pointers of the descriptor table. ``coat.optim.AdamW4bit.step`` is its only caller
(excluded from torch.compile tracing); it is a plain sequence of launches on the current stream, so
CUDA graphs capture it.
"""

from __future__ import annotations

import torch

from .. import _C
from ._util import dev_ctx as _dev_ctx
from ._util import stream as _stream
from .enums import DTYPE_IDS, MASTER_KINDS

#: int64 words of one descriptor row (coat::Adamw4Tensor).
DESC_WORDS: int = _C.ADAMW4_DESC_WORDS
AMAX_WORD: int = _C.ADAMW4_AMAX_WORD  # the descriptor word of param_amax (coat.nn.weight_amax)
#: Elements per absmax block and per work group.
BLOCK: int = _C.ADAMW4_BLOCK
#: Tensors with fewer elements keep fp32 states.
MIN_NUMEL: int = _C.ADAMW4_MIN_NUMEL
#: coat::Adamw4Kind by name ("full", "block", "rank1").
KINDS: dict[str, int] = dict(_C.ADAMW4_KINDS)


def adamw4_step(
    descs: torch.Tensor,
    n_groups: int,
    *,
    lr: float,
    lr_tensor: torch.Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amp_scale: torch.Tensor | None,
    clip_scale: torch.Tensor | None,
    maximize: bool,
    found_inf: torch.Tensor | None,
    param_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    master: str,
    cpu_threads: int,
) -> None:
    """One step over the tensors of ``descs`` (int64 [n, DESC_WORDS], layout of coat::Adamw4Tensor,
    on the device of the states). Scalars given as tensors are fp32 with one element; ``master`` is
    "none", "fp32" or "bf16_sr"."""
    with _dev_ctx(descs):
        _C.adamw4_step(
            descs, int(n_groups), float(lr), lr_tensor, float(beta1), float(beta2), float(eps),
            float(weight_decay), amp_scale, clip_scale, bool(maximize), found_inf, DTYPE_IDS[param_dtype],
            DTYPE_IDS[grad_dtype],
            MASTER_KINDS[master], int(cpu_threads), _stream(descs),
        )
