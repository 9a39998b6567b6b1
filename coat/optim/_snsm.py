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


#: How a matrix's weights are kept (the ``master_weights`` of coat.optim.AdamW): "fp32" keeps an fp32
#: master copy of a 16-bit matrix in its state ("master") and writes the parameter from it (round
#: to nearest); "bf16_sr" keeps none and writes a bf16 parameter with stochastic rounding.
MASTER_WEIGHTS = ("fp32", "bf16_sr")


def has_master(local: torch.Tensor, master_weights: str) -> bool:
    return master_weights == "fp32" and local.dtype != torch.float32


def new_state(local: torch.Tensor, rank: int, state_dtype: torch.dtype, master_weights: str = "fp32") -> dict[str, Any]:
    shapes = state_shapes(tuple(local.shape), rank)
    dev = local.device
    st = {
        # On the host: the refresh (an SVD every T steps) is decided there, without a device sync.
        "step": torch.zeros((), dtype=torch.float32),
        "subset_norm": torch.zeros(shapes["subset_norm"], dtype=torch.float32, device=dev),
        "exp_avg": torch.zeros(shapes["exp_avg"], dtype=state_dtype, device=dev),
        "proj": torch.zeros(shapes["proj"], dtype=state_dtype, device=dev),
    }
    if has_master(local, master_weights):
        st["master"] = local.detach().float().clone()
    return st


def check_state(state: dict[str, Any], local: torch.Tensor, rank: int, state_dtype: torch.dtype, what: str,
                master_weights: str = "fp32") -> None:
    """A saved or live state this matrix can use (else ValueError naming ``what``)."""
    want_master = has_master(local, master_weights)
    if ("master" in state) != want_master:
        raise ValueError(f"{what} {'lacks' if want_master else 'holds'} an fp32 master copy, but this optimizer's "
                         f"master_weights={master_weights!r} for a {local.dtype} parameter "
                         f"{'needs' if want_master else 'keeps'} {'one' if want_master else 'none'}")
    if want_master and not (isinstance(state["master"], torch.Tensor) and state["master"].dtype == torch.float32
                            and tuple(state["master"].shape) == tuple(local.shape)):
        raise ValueError(f"{what}['master'] must be a float32 tensor of shape {tuple(local.shape)}")
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


#: How a refresh finds the top-r subspace: "svd" (a full SVD of the gradient, the reference's
#: proj_type="svd") or "randomized" (a randomized range finder: RANDOM_OVERSAMPLE extra columns,
#: RANDOM_POWER_ITERS power iterations, then the SVD of a (r + oversample) x n sketch; Halko,
#: Martinsson & Tropp 2011). Randomized costs a few GEMMs of the matrix's size instead of an SVD of it.
PROJ_TYPES = ("svd", "randomized")
RANDOM_OVERSAMPLE = 16
RANDOM_POWER_ITERS = 2


def top_subspace(g: torch.Tensor, r: int) -> torch.Tensor:
    """The projection of an fp32 gradient: (r, n) right singular vectors when tall, else (m, r) left."""
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    return vh[:r].contiguous() if tall(tuple(g.shape)) else u[:, :r].contiguous()


def randomized_subspace(g: torch.Tensor, r: int, gen: torch.Generator) -> torch.Tensor:
    """``top_subspace`` by a randomized range finder with a Gaussian sketch drawn from ``gen``;
    the exact SVD where the sketch would not be smaller than the matrix. A non-finite gradient
    raises before anything is computed (as the full SVD fails on it)."""
    m, n = g.shape
    k = min(r + RANDOM_OVERSAMPLE, m, n)
    if k >= min(m, n):
        return top_subspace(g, r)
    if not bool(torch.isfinite(g).all()):
        raise RuntimeError("SubsetNormSM: non-finite gradient at a projection refresh (randomized SVD)")
    omega = torch.randn(n, k, generator=gen, device=g.device, dtype=torch.float32)
    q = torch.linalg.qr(g @ omega).Q  # [m, k]: an orthonormal basis of the sketched range
    for _ in range(RANDOM_POWER_ITERS):  # sharpen it towards the top singular directions
        q = torch.linalg.qr(g.T @ q).Q
        q = torch.linalg.qr(g @ q).Q
    ub, _, vh = torch.linalg.svd(q.T @ g, full_matrices=False)  # the SVD of a [k, n] sketch
    return vh[:r].contiguous() if tall((m, n)) else (q @ ub[:, :r]).contiguous()


def sketch_generator(device: torch.device, seed: int) -> torch.Generator:
    """The generator of one refresh's sketch: a function of ``seed`` alone (the optimizer's seed, the
    matrix's position and the step), so a resumed run refreshes to the same projection."""
    return torch.Generator(device=device).manual_seed(seed % (2**63))


def next_projection(grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
                    sketch_seed: int = 0) -> torch.Tensor | None:
    """The projection the coming step (``state["step"] + 1``) refreshes to, or None: computed before
    anything is written, so that an SVD that fails (a non-finite gradient) leaves every state as it
    was. ``sketch_seed``: the randomized refresh's seed (combined with the step here)."""
    t = int(state["step"].item()) + 1
    if not refreshes(t, group["update_proj_gap"]):
        return None
    p = state["proj"]
    r = p.shape[0] if tall(tuple(grad.shape)) else p.shape[1]
    if group.get("proj_type", "svd") == "randomized":
        return randomized_subspace(grad.float(), r, sketch_generator(grad.device, sketch_seed * 1_000_033 + t))
    return top_subspace(grad.float(), r)


#: Elements of a matrix updated at once: the update runs in slices of whole rows (tall) or columns
#: (wide), so its fp32 temporaries stay near 24 bytes x CHUNK whatever the matrix (an LM head
#: of 1.3e8 parameters would otherwise need ~3 GB of them).
CHUNK = 1 << 24


def update(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
           new_proj: torch.Tensor | None, *, clip_scale: torch.Tensor | None = None,
           sr_seed: int | None = None) -> None:
    """One step of one matrix (``state["step"]`` already counts it; ``new_proj``: ``next_projection``'s).
    Computed in fp32 on the fp32 master (``state["master"]``) or the parameter itself; the gradient
    is multiplied by ``1 / clip_scale`` when given (gradient release's clipping scale). The
    parameter is written in its own dtype: from the master, or with stochastic rounding seeded by
    ``sr_seed`` for bf16 parameters without one (``master_weights="bf16_sr"``), else round to nearest.
    Every quantity of the update is per row (tall) or per column (wide) once the projection is
    fixed, so it runs in slices of the long dimension (``CHUNK``)."""
    t = int(state["step"].item())
    beta1, beta2 = group["betas"]
    lr = float(group["lr"])
    is_tall = tall(tuple(p.shape))
    if new_proj is not None:
        state["proj"].copy_(new_proj)
        state["exp_avg"].zero_()  # momentum coordinates of the old subspace mean nothing in the new one
    proj = state["proj"].float()
    step_size = lr
    if group["correct_bias"]:
        bc2 = 1.0 - beta2 ** t if beta2 < 1.0 else 1.0
        step_size = lr * math.sqrt(bc2) / (1.0 - beta1 ** t)
    inv = None if clip_scale is None else torch.reciprocal(clip_scale.to(p.device, torch.float32).reshape(()))
    master = state.get("master")
    gen = _generator(p.device, sr_seed, t) if sr_seed is not None and master is None and p.dtype == torch.bfloat16 \
        else None
    long, short = (p.shape[0], p.shape[1]) if is_tall else (p.shape[1], p.shape[0])
    per = max(1, CHUNK // max(short, 1))
    for a in range(0, long, per):
        def pick(x: torch.Tensor, a: int = a) -> torch.Tensor:
            return x[a:a + per] if is_tall else x[:, a:a + per]

        g = pick(grad).float()
        if inv is not None:
            g = g * inv
        low = g @ proj.T if is_tall else proj.T @ g
        exp_avg = pick(state["exp_avg"])
        m = exp_avg.float().mul_(beta1).add_(low, alpha=1.0 - beta1)
        exp_avg.copy_(m)
        # momentum in the subspace, plain SGD on the orthogonal residual g - back(low)
        num = ((m - low) @ proj if is_tall else proj @ (m - low)).add_(g)
        sq = g.square().sum(dim=1 if is_tall else 0, keepdim=True)
        del g, low, m
        v = pick(state["subset_norm"])
        if beta2 < 1.0:
            v.mul_(beta2).add_(sq, alpha=1.0 - beta2)
        else:  # beta2 == 1: AdaGrad's accumulation
            v.add_(sq)
        w = pick(master) if master is not None else pick(p).float()  # a view when fp32: updated in place
        new = w.sub_(num.div_(v.sqrt().add_(group["eps"])), alpha=step_size)
        del num
        if group["weight_decay"] > 0:  # after the update, as the reference does
            new.mul_(1.0 - lr * group["weight_decay"])
        pick(p).copy_(bf16_stochastic(new, gen) if gen is not None else new)


#: The largest finite bfloat16.
_BF16_MAX = 3.3895313892515355e38


def _generator(device: torch.device, seed: int, step: int) -> torch.Generator:
    """A generator for (seed, step): the same bits for the same matrix and step, so a resumed run
    rounds as the uninterrupted one did."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 0x9E3779B1 + step * 0x85EBCA77) % (1 << 63))
    return gen


def bf16_stochastic(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """bf16 of fp32 ``x`` with stochastic rounding: 16 random bits added below the bf16 mantissa,
    then truncated (coat.optim.AdamW's rule: the magnitude rounds up with probability equal to the
    dropped fraction; NaN and +-Inf stay; a finite value never becomes Inf)."""
    r = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=gen)
    out = ((x.view(torch.int32) + r) & -65536).view(torch.float32)
    finite = torch.isfinite(x)
    out = torch.where(finite & torch.isinf(out), torch.full_like(x, _BF16_MAX).copysign(x), out)
    return torch.where(finite, out, x).to(torch.bfloat16)
