"""Subset-Norm + Subspace-Momentum on one matrix, in torch ops: the state layout, the update and its
byte count (the optimizer class is coat/optim/subset_norm.py; docs/optimizers.md).

A matrix G of shape (m, n) is "tall" when m >= n. Everything follows that one orientation, as in the
reference code (timmytonga/sn-sm):

- subset norm: one value per row of a tall matrix (the sum of squares over its n columns), one per
  column of a wide one (over its m rows): shape (m, 1) or (1, n), fp32;
- projection P: the top-r right singular vectors of G for a tall matrix, shape (r, n), low = G P^T of
  shape (m, r) and back(x) = x P; the top-r left singular vectors for a wide one, shape (m, r),
  low = P^T G of shape (r, n) and back(x) = P x. The projection acts on the smaller dimension, so
  momentum holds r x max(m, n) values and P r x min(m, n).
"""

from __future__ import annotations

import math
from typing import Any

import torch

#: Keys of a Subset-Norm / Subspace-Momentum state (besides "step").
STATE_KEYS = ("subset_norm", "exp_avg", "proj")
STATE_DTYPES = (torch.float32, torch.bfloat16)


def tall(shape: tuple[int, ...]) -> bool:
    return shape[0] >= shape[1]


def eff_rank(shape: tuple[int, ...], rank: int) -> int:
    """The subspace's rank for a matrix of ``shape``: at most its smaller dimension."""
    return min(rank, shape[0], shape[1])


def state_shapes(shape: tuple[int, ...], rank: int) -> dict[str, tuple[int, int]]:
    m, n = shape
    r = eff_rank(shape, rank)
    if tall(shape):
        return {"subset_norm": (m, 1), "exp_avg": (m, r), "proj": (r, n)}
    return {"subset_norm": (1, n), "exp_avg": (r, n), "proj": (m, r)}


def state_bytes(shape: tuple[int, ...], rank: int, state_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one matrix's state: fp32 subset norm, momentum and projection in ``state_dtype``
    (the 4-byte step count not included)."""
    sizes = {k: math.prod(s) for k, s in state_shapes(shape, rank).items()}
    width = torch.empty((), dtype=state_dtype).element_size()
    return 4 * sizes["subset_norm"] + width * (sizes["exp_avg"] + sizes["proj"])


def new_state(local: torch.Tensor, rank: int, state_dtype: torch.dtype) -> dict[str, Any]:
    shapes = state_shapes(tuple(local.shape), rank)
    dev = local.device
    return {
        # On the host: the refresh (an SVD every T steps) is decided there, without a device sync.
        "step": torch.zeros((), dtype=torch.float32),
        "subset_norm": torch.zeros(shapes["subset_norm"], dtype=torch.float32, device=dev),
        "exp_avg": torch.zeros(shapes["exp_avg"], dtype=state_dtype, device=dev),
        "proj": torch.zeros(shapes["proj"], dtype=state_dtype, device=dev),
    }


def check_state(state: dict[str, Any], local: torch.Tensor, rank: int, state_dtype: torch.dtype, what: str) -> None:
    """A saved or live state this matrix can use (else ValueError naming ``what``)."""
    missing = [k for k in ("step", *STATE_KEYS) if k not in state]
    if missing:
        raise ValueError(f"{what} is not a coat.optim.SubsetNormSM matrix state: missing {missing} "
                         f"(keys {sorted(state)})")
    for k, shape in state_shapes(tuple(local.shape), rank).items():
        t = state[k]
        want = torch.float32 if k == "subset_norm" else state_dtype
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != want:
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{what}[{k!r}] must be a {want} tensor of shape {shape} for a parameter of shape "
                             f"{tuple(local.shape)} at rank {rank}, got {got}")


def refreshes(step: int, gap: int) -> bool:
    """Whether step ``step`` (1-based) recomputes the projection and resets the momentum."""
    return step == 1 or step % gap == 0


def top_subspace(g: torch.Tensor, r: int) -> torch.Tensor:
    """The projection of an fp32 gradient: (r, n) right singular vectors when tall, else (m, r) left."""
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    return vh[:r].contiguous() if tall(tuple(g.shape)) else u[:, :r].contiguous()


def next_projection(grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor | None:
    """The projection the coming step (``state["step"] + 1``) refreshes to, or None: computed before
    anything is written, so that an SVD that fails (a non-finite gradient) leaves every state as it was."""
    if not refreshes(int(state["step"].item()) + 1, group["update_proj_gap"]):
        return None
    p = state["proj"]
    return top_subspace(grad.float(), p.shape[0] if tall(tuple(grad.shape)) else p.shape[1])


def update(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
           new_proj: torch.Tensor | None) -> None:
    """One step of one matrix (``state["step"]`` already counts it; ``new_proj``: ``next_projection``'s).
    Computed in fp32; the parameter is written in its own dtype (round to nearest)."""
    t = int(state["step"].item())
    beta1, beta2 = group["betas"]
    lr = float(group["lr"])
    g = grad.float()
    is_tall = tall(tuple(g.shape))
    if new_proj is not None:
        state["proj"].copy_(new_proj)
        state["exp_avg"].zero_()  # momentum coordinates of the old subspace mean nothing in the new one
    proj = state["proj"].float()
    low = g @ proj.T if is_tall else proj.T @ g
    m = state["exp_avg"].float().mul_(beta1).add_(low, alpha=1.0 - beta1)
    state["exp_avg"].copy_(m)

    def back(x: torch.Tensor) -> torch.Tensor:
        return x @ proj if is_tall else proj @ x

    # momentum in the subspace, plain SGD on the orthogonal residual g - back(low)
    num = back(m - low).add_(g)
    sq = g.square().sum(dim=1 if is_tall else 0, keepdim=True)
    v = state["subset_norm"]
    if beta2 < 1.0:
        v.mul_(beta2).add_(sq, alpha=1.0 - beta2)
    else:  # beta2 == 1: AdaGrad's accumulation
        v.add_(sq)
    step_size = lr
    if group["correct_bias"]:
        bc2 = 1.0 - beta2 ** t if beta2 < 1.0 else 1.0
        step_size = lr * math.sqrt(bc2) / (1.0 - beta1 ** t)
    new = p.float().sub_(num.div_(v.sqrt().add_(group["eps"])), alpha=step_size)
    if group["weight_decay"] > 0:  # after the update, as the reference does
        new.mul_(1.0 - lr * group["weight_decay"])
    p.copy_(new)
