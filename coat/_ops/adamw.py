"""The adamw family: the fused FP8-state AdamW step over a table of tensor descriptors.

Not a ``torch.library`` custom op: the step mutates parameters and states that it reaches through
the raw pointers of the descriptor table (that is what lets one launch cover every tensor), so
there is no functional schema to give it. ``coat.optim.AdamW.step`` is its only caller and is
excluded from torch.compile tracing; it is still a plain launch on the current stream, so CUDA
graphs capture it.
"""

from __future__ import annotations

import torch

from .. import _C
from ._util import dev_ctx as _dev_ctx
from ._util import stream as _stream
from .enums import DTYPE_IDS, FP8_FORMATS, MASTER_KINDS

DESC_WORDS: int = _C.ADAMW_DESC_WORDS
AMAX_WORD: int = _C.ADAMW_AMAX_WORD  # the descriptor word of param_amax (coat.nn.weight_amax)


def adamw_step(
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
    m_fmt: str,
    v_fmt: str,
    expansion: bool,
    m_log2_range: float,
    v_log2_range: float,
    cpu_threads: int,
) -> None:
    """One step over the tensors of ``descs`` (int64 [n, DESC_WORDS], layout of coat::AdamwTensor,
    on the device of the states). Scalars given as tensors are fp32 with one element; ``master``
    and the formats ``m_fmt`` / ``v_fmt`` ("e4m3", "e5m2") are names."""
    with _dev_ctx(descs):
        _C.adamw_step(
            descs, int(n_groups), float(lr), lr_tensor, float(beta1), float(beta2), float(eps),
            float(weight_decay), amp_scale, clip_scale, bool(maximize), found_inf, DTYPE_IDS[param_dtype],
            DTYPE_IDS[grad_dtype],
            MASTER_KINDS[master], FP8_FORMATS[m_fmt], FP8_FORMATS[v_fmt], bool(expansion), float(m_log2_range),
            float(v_log2_range), int(cpu_threads), _stream(descs),
        )
