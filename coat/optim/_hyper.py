"""AdamW's hyperparameter and parameter checks, shared by coat.optim.AdamW (FP8 states) and
coat.optim.AdamW4bit (4-bit states): the two take the same hyperparameters and master-weight modes."""

from __future__ import annotations

import math
from typing import Any

import torch

from . import _compat

MASTER = ("fp32", "bf16_sr")
NONFINITE = ("propagate", "raise")


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def check_settings(master_weights: str, nonfinite: str, seed: Any) -> None:
    """The constructor's own settings (not per group)."""
    if master_weights not in MASTER:
        raise ValueError(f"master_weights must be one of {MASTER}, got {master_weights!r}")
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
    if not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")


def check_adam_group(group: dict[str, Any], nonfinite: str, name: str) -> None:
    """lr, betas, eps, weight_decay and torch's flags of one parameter group (``name``: the optimizer's,
    for messages)."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.is_floating_point():
            raise ValueError(f"Tensor lr must be 1-element and floating-point, got shape {tuple(lr.shape)} "
                             f"and dtype {lr.dtype}")
    elif not _finite(lr) or lr < 0:
        raise ValueError(f"Invalid learning rate: {lr} (must be finite and >= 0)")
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair of floats, got {betas!r}")
    if any(isinstance(b, torch.Tensor) for b in betas):
        raise ValueError(f"betas as Tensors are not supported by {name}: its kernel takes the betas "
                         "as floats at each launch (only lr can be a tensor read on the device); pass "
                         "floats, e.g. betas=(0.9, 0.999)")
    for i, b in enumerate(betas):
        if not _finite(b) or not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b} (must be a float in [0, 1))")
    if not _finite(group["eps"]) or group["eps"] < 0:
        raise ValueError(f"Invalid epsilon value: {group['eps']} (must be finite and >= 0)")
    if not _finite(group["weight_decay"]) or group["weight_decay"] < 0:
        raise ValueError(f"Invalid weight_decay value: {group['weight_decay']} (must be finite and >= 0)")
    if group.get("decoupled_weight_decay", True) is not True and group["weight_decay"] != 0:
        # torch.optim.Adam's groups (an Adam state dict loaded here): an L2 term on the gradient,
        # which this step would silently turn into AdamW's decoupled decay.
        raise ValueError(f"decoupled_weight_decay={group['decoupled_weight_decay']!r} with weight_decay="
                         f"{group['weight_decay']} is not supported by {name}: its weight decay is AdamW's "
                         "(decoupled); a torch.optim.Adam state dict with weight decay does not load here")
    _compat.check_group_flags(group, nonfinite, name)


def check_param_dtype(dt: torch.dtype, master_weights: str, name: str) -> None:
    """A parameter dtype the step supports under ``master_weights``."""
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name} supports float32, bfloat16 and float16 parameters, got {dt}")
    if master_weights == "bf16_sr" and dt == torch.float16:
        raise ValueError(f"master_weights='bf16_sr' needs bfloat16 parameters, got {dt}")
    if master_weights == "bf16_sr" and dt == torch.float32:
        raise ValueError("master_weights='bf16_sr' needs bfloat16 parameters, got float32 "
                         "(cast the model with .bfloat16(), or use master_weights='fp32')")


def master_kind(dtype: torch.dtype, master_weights: str) -> str:
    """How the step writes a parameter of ``dtype``: fp32 parameters are their own master."""
    return "none" if dtype == torch.float32 else master_weights
