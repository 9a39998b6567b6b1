"""Optimizers with FP8 states: ``AdamW`` (alias ``CoatAdamW``), and with 4-bit states: ``AdamW4bit``,
Subset-Norm + Subspace-Momentum on the matrices (``SubsetNormSM``, torch ops, AdamW on the rest),
on the fused multi-tensor base
``FusedOptimizer`` (docs/optimizers.md: what a new optimizer implements), conversions to and from
``torch.optim.AdamW`` state dicts, and gradient release (``step_in_backward``: the step inside
backward, so a full set of gradients never exists)."""

from ._state import from_torch_adamw_state, to_torch_adamw_state
from .adamw import AdamW, CoatAdamW
from .adamw4bit import AdamW4bit
from .fused import FusedOptimizer
from .release import GradRelease, step_in_backward
from .subset_norm import SubsetNormSM, snsm_param_groups

__all__ = ["AdamW", "AdamW4bit", "CoatAdamW", "FusedOptimizer", "to_torch_adamw_state", "from_torch_adamw_state",
           "step_in_backward", "GradRelease", "SubsetNormSM",
           "snsm_param_groups"]
