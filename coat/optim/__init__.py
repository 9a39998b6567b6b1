"""Optimizers with FP8 states: ``AdamW`` (alias ``CoatAdamW``), conversions to and from
``torch.optim.AdamW`` state dicts, and gradient release (``step_in_backward``: the step inside
backward, so a full set of gradients never exists)."""

from ._state import from_torch_adamw_state, to_torch_adamw_state
from .adamw import AdamW, CoatAdamW
from .release import GradRelease, step_in_backward

__all__ = ["AdamW", "CoatAdamW", "to_torch_adamw_state", "from_torch_adamw_state", "step_in_backward",
           "GradRelease"]
