"""Subset-Norm + Subspace-Momentum (Nguyen & Nguyen, 2024) for the matrices of a model, with
coat.optim.AdamW (FP8 states) for everything else, in one optimizer object. Torch ops, not yet a
fused kernel. The per-matrix math is coat/optim/_snsm.py; docs/optimizers.md."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable, Iterable, NamedTuple

import torch

from . import _compat, _snsm, _state
from .adamw import AdamW
from .fused import Launch, ReleaseTarget, add_checked_group

__all__ = ["SubsetNormSM", "snsm_param_groups"]

_HYPER = ("lr", "betas", "eps", "weight_decay")  # what the AdamW part takes from its group

# torch.optim.AdamW's keywords (_compat.TORCH_FLAGS), none of which this optimizer implements: a group
# written for torch.optim.AdamW must not step otherwise in silence (a maximize=True group would
# descend), so any value but False (or None) is refused.
_FLAG_WHY = {
    "maximize": "its step always descends; negate the loss to ascend",
    "amsgrad": "it keeps no running maximum of v",
    "differentiable": "its step runs outside autograd",
    "capturable": "its step count lives on the host, so step() cannot be captured in a CUDA graph",
    "foreach": "it has one implementation (torch ops per matrix, coat.optim.AdamW's kernel for the rest)",
    "fused": "it has one implementation (torch ops per matrix, coat.optim.AdamW's kernel for the rest)",
}


def _check_torch_flags(options: dict[str, Any], where: str) -> None:
    for key in _compat.TORCH_FLAGS:
        if options.get(key) not in (None, False):
            raise ValueError(f"{where}{key}={options[key]!r} is not supported by coat.optim.SubsetNormSM: "
                             f"{_FLAG_WHY.get(key, 'not implemented')}; leave {key} out")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class _Matrices(NamedTuple):
    """Planned steps of SN-SM matrices (gradient release's launch of them): ``(param, grad, group,
    new projection or None, the matrix's seed)`` per matrix, and each one's position in the whole
    parameter list."""

    items: list
    positions: list[int]

    @property
    def grads(self) -> list[torch.Tensor]:
        return [g for _, g, *_ in self.items]


class SubsetNormSM(ReleaseTarget, torch.optim.Optimizer):
    """AdamSNSM: Subset-Norm step sizes with Subspace-Momentum on 2-D weights, coat.optim.AdamW on the rest.

    "Efficient Adaptive Optimization via Subset-Norm and Subspace-Momentum" (Nguyen & Nguyen, 2024;
    ICML 2025 as "Lean and Mean Adaptive Optimization ..."); reference code timmytonga/sn-sm. For a
    matrix parameter W (m x n) with gradient G at step t (1-based), in fp32:

    - every ``update_proj_gap`` steps (and at step 1): P = top-``rank`` singular vectors of G over its
      smaller dimension (``proj_type="svd"``: a full SVD, as the reference; "randomized": a randomized
      range finder, a few GEMMs of the matrix's size), and the momentum is reset to zero;
    - L = P G (projected gradient, r x max(m, n)); M = beta1 M + (1 - beta1) L;
      U = P^T M + (G - P^T L): momentum in the subspace, plain SGD on the orthogonal residual;
    - V = beta2 V + (1 - beta2) s (beta2 = 1: V += s, AdaGrad's accumulation), s the sum of G^2 over
      the smaller dimension: one value per row of a tall matrix, per column of a wide one;
    - W -= lr sqrt(1 - beta2^t) / (1 - beta1^t) U / (sqrt(V) + eps) (the bias correction applies to
      both parts, as in the reference; ``correct_bias=False`` drops it), then W -= lr weight_decay W.

    The reference code resets the momentum one step late (it updates and uses the old subspace's
    momentum with the new projection at the refresh step, then zeroes it); here it is reset before the
    refresh step's update, as the paper describes.

    Defaults of the paper's reference runs (LLaMA pre-training, ``examples.sh``): lr 0.05 (about 10x
    Adam's: a subset norm sums many squares), betas (0.9, 0.999), eps 1e-6, weight_decay 0, rank 128,
    update_proj_gap 100 (200 in some runs), cosine schedule with warm-up, gradient clipping 1.0, and
    the same lr for the AdamW part. The constructor's own defaults are those, except lr (1e-3, as
    torch's optimizers: pass the paper's explicitly).

    Which parameters take which rule: a parameter of a group with ``"adamw": True``, and every
    parameter that is not 2-D, steps with coat.optim.AdamW (FP8 states, Dynamic Range Expansion,
    the group's lr, betas, eps and weight_decay); every other 2-D parameter takes SN-SM. Embedding
    matrices are 2-D: mark them (``snsm_param_groups(model)`` builds the reference's split: the
    weights of ``nn.Linear`` modules, except one tied to an ``nn.Embedding``, take SN-SM).

    Args:
        params: parameters or parameter groups (groups may override lr, betas, eps, weight_decay,
            rank, update_proj_gap, proj_type, correct_bias, adamw and adamw_betas).
        betas: (beta1, beta2) of both parts; beta2 = 1 accumulates the subset norms (AdaGrad), which
            the AdamW part cannot: give a group holding AdamW parameters ``adamw_betas`` then.
        adamw_betas: betas of the AdamW part when they differ (None: ``betas``).
        rank: the subspace's rank (capped at each matrix's smaller dimension).
        update_proj_gap: steps between refreshes of the projection (T).
        proj_type: how a refresh finds the top-``rank`` subspace: "svd" (default; a full SVD of the
            gradient, the reference's) or "randomized" (Gaussian sketch of rank + 16 columns, two
            power iterations, the SVD of the small sketch: ``_snsm.randomized_subspace``; its draws
            come from ``seed``, the matrix's position and the step, so a resumed run refreshes alike).
        state_dtype: torch.float32 (default) or torch.bfloat16: dtype of the momentum and the
            projection (the reference keeps them in the gradient's dtype); subset norms stay fp32.
        master_weights: "fp32" (default): a 16-bit matrix keeps an fp32 master copy in its state and
            is written from it; "bf16_sr": no master copy, a bf16 matrix is written with stochastic
            rounding (the same bits for the same seed, matrix and step). The AdamW part takes the same.
        seed: the stochastic-rounding seed (both parts), and the randomized refresh's.
        adamw_options: keywords for the internal coat.optim.AdamW (nonfinite, m_format, v_format,
            ...); lr, betas, eps and weight_decay come from the groups, master_weights and seed from
            this optimizer.

    State per matrix: 4 max(m, n) + w r (m + n) bytes (w = 2 or 4), e.g. 0.17 B/param for
    4096 x 11008 at rank 128 in fp32 (``_snsm.state_bytes``), plus 4 B/param of fp32 master for a
    16-bit matrix with ``master_weights="fp32"``. Matrices step one by one in torch ops on their own
    device (CPU or CUDA), in fp32. The step count
    lives on the host (the refresh is decided there), so ``step()`` is not CUDA-graph capturable.

    Gradient release (``coat.optim.step_in_backward``) steps each matrix inside backward, with its
    refresh, as soon as its gradient is complete (the AdamW part through coat.optim.AdamW's own
    launches); without clipping the result is the ordinary step's, bit for bit. Refused: sharded
    (FSDP2 / DTensor) parameters (a shard's rows or columns are not the matrix's: its subset norms
    and SVD would be the shard's), sparse or complex gradients, and torch.optim.AdamW's keywords
    (``maximize``, ``amsgrad``, ``capturable``, ``differentiable``, ``foreach``, ``fused``) set to
    anything but False or None, in groups or ``adamw_options``. ``torch.amp.GradScaler`` works the
    ordinary way (``scaler.step`` unscales first), not under gradient release.
    """

    display_name = "coat.optim.SubsetNormSM"

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        rank: int = 128,
        update_proj_gap: int = 100,
        proj_type: str = "svd",
        correct_bias: bool = True,
        adamw_betas: tuple[float, float] | None = None,
        state_dtype: torch.dtype = torch.float32,
        master_weights: str = "fp32",
        seed: int = 0,
        adamw_options: dict[str, Any] | None = None,
    ) -> None:
        if state_dtype not in _snsm.STATE_DTYPES:
            raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype!r}")
        if master_weights not in _snsm.MASTER_WEIGHTS:
            raise ValueError(f"master_weights must be one of {_snsm.MASTER_WEIGHTS}, got {master_weights!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**62:
            raise ValueError(f"seed must be an int in [0, 2**62), got {seed!r}")
        opts = dict(adamw_options or {})
        bad = sorted(set(opts) & {*_HYPER, "params", "master_weights", "seed"})
        if bad:
            raise ValueError(f"adamw_options must not set {bad}: the AdamW part takes lr, betas, eps and weight_decay "
                             "from the parameter groups, master_weights and seed from this optimizer")
        _check_torch_flags(opts, "adamw_options: ")  # the AdamW part would honour them, the matrices not
        opts.update(master_weights=master_weights, seed=seed)
        self.master_weights = master_weights
        self.seed = seed
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, rank=rank,
                        update_proj_gap=update_proj_gap, proj_type=proj_type, correct_bias=correct_bias, adamw=False,
                        adamw_betas=adamw_betas)
        self._check_group(defaults)
        self.state_dtype = state_dtype
        self.adamw_options = opts
        super().__init__(params, defaults)
        self._adamw = self._build_adamw()
        # id(matrix) -> its autograd version when last written from its fp32 master (see
        # coat.optim.FusedOptimizer._synced: a matrix changed in place since is the new start)
        self._synced: dict[int, int] = {}

    # ---- groups and routing --------------------------------------------------------------------

    def _check_group(self, group: dict[str, Any]) -> None:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            raise ValueError("lr as a Tensor is not supported by coat.optim.SubsetNormSM; pass a float")
        if not _finite(lr) or lr < 0:
            raise ValueError(f"Invalid learning rate: {lr} (must be finite and >= 0)")
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_finite(b) for b in betas)):
            raise ValueError(f"betas must be a pair of floats, got {betas!r}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]} (must be in [0, 1))")
        if not 0.0 <= betas[1] <= 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]} (must be in [0, 1]; 1 accumulates)")
        if not _finite(group["eps"]) or group["eps"] < 0:
            raise ValueError(f"Invalid epsilon value: {group['eps']} (must be finite and >= 0)")
        if not _finite(group["weight_decay"]) or group["weight_decay"] < 0:
            raise ValueError(f"Invalid weight_decay value: {group['weight_decay']} (must be finite and >= 0)")
        for key in ("rank", "update_proj_gap"):
            v = group[key]
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{key} must be an int >= 1, got {v!r}")
        ab = group["adamw_betas"]
        if ab is not None and not (isinstance(ab, (tuple, list)) and len(ab) == 2 and all(_finite(b) for b in ab)
                                   and 0 <= ab[0] < 1 and 0 <= ab[1] < 1):
            raise ValueError(f"adamw_betas must be None or a pair of floats in [0, 1), got {ab!r}")
        for key in ("correct_bias", "adamw"):
            if not isinstance(group[key], bool):
                raise ValueError(f"{key} must be a bool, got {group[key]!r}")
        if group.setdefault("proj_type", "svd") not in _snsm.PROJ_TYPES:  # groups saved before it existed: svd
            raise ValueError(f"proj_type must be one of {_snsm.PROJ_TYPES}, got {group['proj_type']!r}")
        _check_torch_flags(group, "")
        if group.get("decoupled_weight_decay", True) is not True and group["weight_decay"] != 0:
            # torch.optim.Adam's L2 term, which both parts would silently turn into decoupled decay
            raise ValueError(f"decoupled_weight_decay={group['decoupled_weight_decay']!r} with weight_decay="
                             f"{group['weight_decay']} is not supported by coat.optim.SubsetNormSM: its weight "
                             "decay is decoupled (AdamW's); leave decoupled_weight_decay out")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = add_checked_group(self, param_group)
        if hasattr(self, "_adamw"):  # after construction: the AdamW part gets the group's other params
            self._adamw.add_param_group(self._adamw_group(group))

    def _check_param(self, p: torch.Tensor) -> None:
        if _state._is_dtensor(p):
            raise ValueError("params: coat.optim.SubsetNormSM does not support sharded (FSDP2 / DTensor) "
                             "parameters: a shard holds only part of a matrix's rows or columns, so its subset "
                             "norms and SVD would be the shard's, not the matrix's; use coat.optim.AdamW under FSDP2")
        if p.is_complex() or p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"params: coat.optim.SubsetNormSM supports float32, bfloat16 and float16 "
                             f"parameters, got {p.dtype}")
        if self.master_weights == "bf16_sr" and p.dtype == torch.float16:  # matrices too: no master, no rounding
            raise ValueError("params: master_weights='bf16_sr' needs bfloat16 parameters, got torch.float16 "
                             "(cast the model with .bfloat16(), or use master_weights='fp32')")

    @staticmethod
    def _is_matrix(p: torch.Tensor, group: dict[str, Any]) -> bool:
        return not group["adamw"] and p.dim() == 2

    def _adamw_group(self, group: dict[str, Any]) -> dict[str, Any]:
        params = [p for p in group["params"] if not self._is_matrix(p, group)]
        return {"params": params, **self._adamw_hyper(group, bool(params))}

    @staticmethod
    def _adamw_hyper(group: dict[str, Any], has_params: bool) -> dict[str, Any]:
        """The AdamW part's hyperparameters for ``group`` (betas: ``adamw_betas`` if given)."""
        hyper = {k: group[k] for k in _HYPER}
        if group["adamw_betas"] is not None:
            hyper["betas"] = group["adamw_betas"]
        if hyper["betas"][1] >= 1.0:
            if has_params:
                raise ValueError("betas: beta2 = 1 (AdaGrad accumulation) applies to the Subset-Norm matrices only; "
                                 "give this group's other parameters (AdamW) adamw_betas=(beta1, beta2 < 1)")
            hyper["betas"] = (0.9, 0.999)  # a group without AdamW parameters: never used
        return hyper

    def _build_adamw(self) -> AdamW:
        """The AdamW part: one group per group of this optimizer (empty where it holds only matrices)."""
        groups = [self._adamw_group(g) for g in self.param_groups]
        return AdamW(groups, **self._adamw_hyper(self.defaults, False), **self.adamw_options)

    def _sync_adamw(self) -> None:
        """Hyperparameters changed on this optimizer's groups (a scheduler's lr) reach the AdamW part."""
        for group, inner in zip(self.param_groups, self._adamw.param_groups):
            inner.update(self._adamw_hyper(group, bool(inner["params"])))

    @property
    def adamw(self) -> AdamW:
        """The internal coat.optim.AdamW that steps the non-matrix parameters."""
        return self._adamw

    # ---- step ----------------------------------------------------------------------------------

    @property
    def nonfinite(self) -> str:
        """The AdamW part's ``nonfinite`` setting (the matrices' updates propagate non-finite values)."""
        return self._adamw.nonfinite

    def _plan_matrices(self, todo: list[tuple[torch.Tensor, dict[str, Any]]]) -> list[tuple]:
        """(param, grad, group, new projection or None, seed) of SN-SM matrices holding a gradient: every
        check and every refresh's SVD before anything is written (a failing SVD, from a non-finite
        gradient, changes nothing)."""
        out = []
        index = self._positions()
        for p, group in todo:
            self._check_group(group)
            self._check_param(p)
            g = p.grad
            if g.is_sparse or g.layout != torch.strided or g.is_complex():
                raise ValueError("coat.optim.SubsetNormSM does not support sparse or complex gradients")
            if g.shape != p.shape or g.device != p.device:
                raise ValueError(f"gradient of shape {tuple(g.shape)} on {g.device} does not match the "
                                 f"parameter's {tuple(p.shape)} on {p.device}")
            state = self.state[p]
            if not state:
                state.update(_snsm.new_state(p, group["rank"], self.state_dtype, self.master_weights))
            seed = self._matrix_seed(index[id(p)])
            out.append((p, g, group, _snsm.next_projection(g, state, group, seed), seed))
        return out

    def _positions(self) -> dict[int, int]:
        """id(parameter) -> its position in the whole parameter list."""
        return {id(q): i for i, q in enumerate(q for g in self.param_groups for q in g["params"])}

    def _matrix_seed(self, position: int) -> int:
        """A matrix's own seed: of its stochastic rounding, and (with the step) of its refresh's sketch."""
        return self.seed * 1_000_003 + position

    def _run_matrices(self, items: list[tuple], clip_scale: torch.Tensor | None) -> None:
        synced = self._synced
        for p, g, group, proj, seed in items:
            state = self.state[p]
            if "master" in state and synced.get(id(p), p._version) != p._version:
                _state.adopt_edits(state["master"], p)  # changed in place since the last step: the change stands
            state["step"] += 1
            # bf16_sr: the rounding bits of a matrix come from its seed (the optimizer's and its position)
            sr_seed = seed if self.master_weights == "bf16_sr" else None
            _snsm.update(p, g, state, group, proj, clip_scale=clip_scale, sr_seed=sr_seed)
            if "master" in state:
                synced[id(p)] = p._version

    def mark_synced(self, params: Iterable[torch.Tensor]) -> None:
        """As coat.optim.AdamW's: the masters hold what ``params`` were last written from."""
        params = list(params)
        self._synced.update((id(p), p._version) for p in params if "master" in self.state.get(p, ()))
        self._adamw.mark_synced(params)

    def _inner_positions(self) -> dict[int, int]:
        """Position in the whole parameter list -> position in the AdamW part's list."""
        return {outer: inner for inner, outer in enumerate(self._adamw_ids())}

    def plan_launches(self, entries: Iterable[tuple[torch.Tensor, int, int]], tag: tuple = ()) -> list:
        """Gradient release's protocol (``coat.optim.fused.ReleaseTarget``): the launches that step
        ``entries`` (``(parameter, group index, position in the whole list)``, each holding a
        gradient), checked, refreshes computed, nothing written: the AdamW part's launches (with
        positions in this optimizer's list) and one launch of the matrices."""
        mats, inner = [], []
        inner_of = self._inner_positions()
        for p, gi, index in entries:
            group = self.param_groups[gi]
            if self._is_matrix(p, group):
                mats.append((p, group, index))
            else:
                inner.append((p, gi, inner_of[index], index))
        launches: list = []
        if inner:
            self._sync_adamw()
            planned = self._adamw.plan_launches([(p, gi, ii) for p, gi, ii, _ in inner], tag)
            outer_of = {ii: index for _, _, ii, index in inner}
            launches += [launch._replace(positions=[outer_of[i] for i in launch.positions]) for launch in planned]
        if mats:
            launches.append(_Matrices(self._plan_matrices([(p, g) for p, g, _ in mats]), [i for *_, i in mats]))
        return launches

    def run_launches(self, launches: Iterable, clip_scale: torch.Tensor | None = None, *,
                     amp_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
        """Run planned launches in order; gradients are divided by ``clip_scale`` (the clipping
        scale of gradient release). ``amp_scale`` and ``found_inf`` are refused for matrices
        (GradScaler unscales before this optimizer's step)."""
        for launch in launches:
            if isinstance(launch, Launch):
                self._adamw.run_launches([launch], clip_scale, amp_scale=amp_scale, found_inf=found_inf)
            else:
                if found_inf is not None or amp_scale is not None:
                    raise ValueError("amp_scale / found_inf: the Subset-Norm matrices cannot unscale or skip a step "
                                     "on the device; let torch.amp.GradScaler unscale before step()")
                self._run_matrices(launch.items, clip_scale)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        release = self._release
        if release is not None:  # released parameters are stepped already; the rest with the clip scale
            scale = release.before_step(getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
            entries, first = [], 0
            for gi, group in enumerate(self.param_groups):
                entries += [(p, gi, first + j) for j, p in enumerate(group["params"]) if p.grad is not None]
                first += len(group["params"])
            self.run_launches(self.plan_launches(entries, ("step",)), scale)
            release.end_iteration()
            return loss
        todo = self._plan_matrices([(p, g) for g in self.param_groups for p in g["params"]
                                    if p.grad is not None and self._is_matrix(p, g)])
        self._sync_adamw()
        self._adamw.step()
        self._run_matrices(todo, None)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)

    def state_bytes(self) -> int:
        """Bytes held by all states: the matrices' (step counts included) and the AdamW part's."""
        own = sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor))
        return own + self._adamw.state_bytes()

    # ---- state dicts -----------------------------------------------------------------------------

    def _adamw_ids(self) -> list[int]:
        """The state-dict id (position in the whole parameter list) of each AdamW-part parameter,
        in the AdamW part's own order."""
        ids, i = [], 0
        for g in self.param_groups:
            for p in g["params"]:
                if not self._is_matrix(p, g):
                    ids.append(i)
                i += 1
        return ids

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: ``state`` keyed by each parameter's position in the groups, matrices'
        states (step, subset_norm, exp_avg, proj) and the AdamW part's (coat.optim.AdamW's keys)
        side by side; ``param_groups`` this optimizer's. torch's state-dict hooks see the whole of it."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        packed = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]
        sd = {"state": {index[id(p)]: st for p, st in self.state.items() if isinstance(p, torch.Tensor)},
              "param_groups": packed}
        ids = self._adamw_ids()
        for k, st in self._adamw.state_dict()["state"].items():
            sd["state"][ids[k]] = st
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads exactly what ``state_dict()`` returned (states are not cast to the parameters' dtypes);
        everything is checked and built before anything is replaced. torch's load hooks run around it."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError("loaded state dict's parameter groups do not match this optimizer's (their number "
                             "or sizes differ)")
        groups = []
        for s, g in zip(saved_groups, self.param_groups):
            new = {**{k: v for k, v in g.items() if k != "params"}, **{k: v for k, v in s.items() if k != "params"},
                   "params": g["params"]}
            self._check_group(new)
            if new["adamw"] != g["adamw"]:
                raise ValueError("loaded state dict routes a parameter group differently (its 'adamw' flag)")
            groups.append(new)
        params = [(p, g) for g in groups for p in g["params"]]
        saved_ids = [i for s in saved_groups for i in s["params"]]
        raw = state_dict["state"]
        state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        inner_state, inner_pos = {}, 0
        for sid, (p, g) in zip(saved_ids, params):
            st = raw.get(sid)
            if not self._is_matrix(p, g):
                if st:
                    inner_state[inner_pos] = st
                inner_pos += 1
            elif st:
                state[p] = self._load_matrix_state(st, p, g, f"state[{sid}]")
        inner_sd = {"state": inner_state, "param_groups": self._adamw.state_dict()["param_groups"]}
        for ig, g in zip(inner_sd["param_groups"], groups):
            ig.update(self._adamw_hyper(g, bool(ig["params"])))
        self._adamw.load_state_dict(inner_sd)  # checks its states and replaces them, or raises
        self.param_groups[:] = groups
        self.state = state
        self._synced = {id(p): p._version for p, st in state.items() if "master" in st}  # loaded: in sync
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_matrix_state(self, st: dict[str, Any], p: torch.Tensor, group: dict[str, Any],
                           what: str) -> dict[str, Any]:
        _snsm.check_state(st, p, group["rank"], self.state_dtype, what, self.master_weights)
        out = {k: st[k].detach().to(device=p.device, copy=True) for k in (*_snsm.STATE_KEYS, "master") if k in st}
        out["step"] = torch.as_tensor(st["step"], dtype=torch.float32).detach().cpu().clone().reshape(())
        return out

    # ---- pickling --------------------------------------------------------------------------------

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._release = None  # a copy is not attached: the hooks belong to the original's parameters
        self._synced = {}

    def __getstate__(self) -> dict[str, Any]:
        st = super().__getstate__()
        st.update(state_dtype=self.state_dtype, adamw_options=self.adamw_options, _adamw=self._adamw,
                  master_weights=self.master_weights, seed=self.seed)
        return st


def snsm_param_groups(model: torch.nn.Module, **matrix_options: Any) -> list[dict[str, Any]]:
    """The reference's split of ``model``'s trainable parameters: the projection matrices take
    Subset-Norm + Subspace-Momentum (``matrix_options``: per-group overrides such as rank or lr),
    everything else ``{"adamw": True}``. Matrices are the 2-D parameters other than embedding
    tables (an ``nn.Embedding``'s weight, and a head tied to it): ``nn.Linear`` weights, and those of
    coat.convert's FP8 layers, which are not ``nn.Linear``."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    params = [p for p in model.parameters() if p.requires_grad]
    matrix = {id(p) for p in params if p.dim() == 2 and id(p) not in embedded}
    return [{"params": [p for p in params if id(p) in matrix], **matrix_options},
            {"params": [p for p in params if id(p) not in matrix], "adamw": True}]
