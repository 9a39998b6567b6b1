"""Custom op of the loss family: cross-entropy over rows of logits with the gradient written in
place (the per-chunk core of ``coat.nn.loss``; the contract is in ``csrc/include/coat/loss.h``)."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _C
from ._util import custom_op, dev_ctx, stream


@custom_op("coat::cross_entropy_rows_", mutates_args=("logits",))
def cross_entropy_rows_(logits: torch.Tensor, labels: torch.Tensor,
                        inv: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, target), fp32 [rows], of logits [rows, vocab] (fp32/bf16/fp16, contiguous); labels
    [rows] int64, negative for an ignored row. With ``inv`` (a one-element fp32 tensor) the logits
    are overwritten with ``inv * (softmax - onehot)`` (0 on ignored rows)."""
    with dev_ctx(logits):
        return _C.cross_entropy_rows(logits, labels, inv, stream(logits))


@cross_entropy_rows_.register_fake
def _(logits, labels, inv):
    rows = logits.shape[0] if logits.dim() else 0
    return logits.new_empty(rows, dtype=torch.float32), logits.new_empty(rows, dtype=torch.float32)
