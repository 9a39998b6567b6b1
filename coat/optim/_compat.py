"""torch.optim.AdamW's keywords on coat.optim.AdamW: which values coat accepts and what they mean.

coat has one implementation, the fused multi-tensor kernel, whose step never synchronises with the
host. So ``foreach``, ``fused`` and ``capturable`` choose nothing (any value runs the same kernel,
bit for bit); ``maximize`` is honoured (the kernel multiplies every gradient by 1 / grad_scale, and
a negated scale negates the gradients at no extra cost); ``amsgrad`` and ``differentiable`` would
need what the kernel does not have (a running-max state; an autograd graph through the step) and
are refused when set. Combinations that torch refuses are refused with torch's exception type and
message, so that a configuration written for coat also constructs with torch.optim.AdamW.
"""

from __future__ import annotations

from typing import Any

import torch

#: torch.optim.AdamW's group keys that coat keeps in its groups too, with torch's defaults.
TORCH_FLAGS: dict[str, Any] = dict(amsgrad=False, maximize=False, foreach=None, capturable=False,
                                   differentiable=False, fused=None)


def check_constructor(lr: Any, betas: Any, flags: dict[str, Any]) -> None:
    """The keyword combinations torch.optim.AdamW's constructor refuses, refused the same way."""
    foreach, capturable = flags["foreach"], flags["capturable"]
    if isinstance(lr, torch.Tensor) and foreach and not capturable:
        raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
    if isinstance(betas, (tuple, list)) and len(betas) == 2:
        tensors = [isinstance(b, torch.Tensor) for b in betas]
        if any(tensors) and not all(tensors):
            raise ValueError("betas must be either both floats or both Tensors")
        if all(tensors) and foreach and not capturable:
            raise ValueError("betas[0] as a Tensor is not supported for capturable=False and foreach=True")
    if flags["fused"] and flags["differentiable"]:
        raise RuntimeError("`fused` does not support `differentiable`")
    if flags["fused"] and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


def check_group_flags(group: dict[str, Any], nonfinite: str, name: str = "coat.optim.AdamW") -> None:
    """torch's keywords of one parameter group: the values coat runs, else a ValueError naming them."""
    for key in ("maximize", "capturable"):
        if not isinstance(group[key], bool):
            raise ValueError(f"{key} must be a bool, got {group[key]!r}")
    for key in ("foreach", "fused"):
        if group[key] not in (None, False, True):
            raise ValueError(f"{key} must be None or a bool, got {group[key]!r}")
    if group["amsgrad"] is not False:
        raise ValueError(f"amsgrad={group['amsgrad']!r} is not supported by {name}: its fused kernel keeps no "
                         "running maximum of v (that needs a third quantized state in the kernel); use "
                         "amsgrad=False, or torch.optim.AdamW for AMSGrad")
    if group["differentiable"] is not False:
        raise ValueError(f"differentiable={group['differentiable']!r} is not supported by {name}: its step is a "
                         "fused kernel outside autograd; use differentiable=False")
    if group["capturable"] and nonfinite == "raise":
        raise ValueError("capturable=True cannot be combined with nonfinite='raise' (that check synchronises "
                         "with the host at every step); use nonfinite='propagate'")


def fill_group_defaults(group: dict[str, Any]) -> None:
    """Give a group from before these keys existed (an older state dict or pickle) torch's defaults."""
    for k, v in TORCH_FLAGS.items():
        group.setdefault(k, v)


def _increment_takes_list() -> bool:
    try:  # recent torch takes a tensor or a list (one call); older ones (2.6) a single tensor and
        torch.autograd.graph.increment_version([])  # raise TypeError or RuntimeError for a list
        return True
    except (TypeError, RuntimeError):
        return False


_LIST_VERSIONS = _increment_takes_list()


def bump_versions(tensors: list[torch.Tensor]) -> None:
    """Tell autograd that ``tensors`` were modified in place (the fused kernel writes them through
    raw pointers, which no version counter sees), so that a backward through a value saved before
    the step raises "modified by an inplace operation", as after torch.optim.AdamW's step. Host
    metadata only: nothing is launched, so it is safe inside a CUDA-graph capture (a replay does
    not bump: CudaGraphStep bumps after each)."""
    if _LIST_VERSIONS:
        torch.autograd.graph.increment_version(tensors)
    else:
        for t in tensors:
            torch.autograd.graph.increment_version(t)
