"""Optimizers with FP8 states: ``AdamW`` (alias ``CoatAdamW``) and conversions to and from
``torch.optim.AdamW`` state dicts."""

from ._state import from_torch_adamw_state, to_torch_adamw_state
from .adamw import AdamW, CoatAdamW

__all__ = ["AdamW", "CoatAdamW", "to_torch_adamw_state", "from_torch_adamw_state"]
