"""AdamW with 4-bit optimizer states (Li, Chen, Zhu, NeurIPS 2023), fused into one step for all
tensors on coat's multi-tensor seam (``FusedOptimizer``)."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .._ops import adamw4 as _ops
from . import _compat, _hyper, _state, _state4
from ._state import _local
from .fused import FusedOptimizer, GradTransforms

__all__ = ["AdamW4bit"]


class AdamW4bit(FusedOptimizer):
    """AdamW whose moments are stored in 4 bits ("Memory Efficient Optimizers with 4-bit States").

    States (docs/optimizers.md, csrc/include/coat/adamw4.h):

    - m: 4-bit codes on the paper's signed dynamic-exponent map, in blocks of 128 consecutive
      elements with one fp32 absmax each;
    - v: 4-bit codes on the linear map without zero, ``(i + 1) / 16``, so a non-zero v never
      decodes to 0. Matrices (dim 0 against the rest, contiguous, not sharded) are rank-1
      normalized: element (i, j) is scaled by min(max of row i, max of column j); the row and
      column maxima of the new v are computed by the kernel in a first pass, without an fp32 copy
      of v. Other tensors, and matrices too thin for that to save bytes, take blocks of 128, as
      every tensor does with ``v_scaling="block"`` (no first pass: a faster step, 1/32 byte more
      per parameter; docs/optimizers.md compares the two);
    - tensors of at most 4096 elements keep fp32 m and v.

    That is about 1.03-1.06 bytes per parameter for large tensors, plus the master weights (fp32
    masters for 16-bit parameters, none for fp32 parameters or ``master_weights="bf16_sr"``).

    The step is torch.optim.AdamW's (decoupled weight decay; the update uses the new moments before
    they are encoded), one fused multi-tensor launch sequence per device, parameter group and dtype
    combination, without host synchronisation (CUDA-graph capturable). Arguments, GradScaler
    support, ``maximize``, ``lr`` as a tensor, ``nonfinite``, ``master_weights`` and ``seed``
    behave as in ``coat.optim.AdamW`` (stochastic rounding draws the same bits for the same seed,
    step and element). A non-finite gradient makes its element's parameter non-finite at once and,
    since 4-bit codes have no NaN, the scale of its block (v of a matrix: its row and column) NaN.

    Gradient release (``coat.optim.step_in_backward``) works through the base's protocol. Sharded
    (FSDP2 / DTensor) parameters step with blocks of 128 for v (rank-1 statistics would span
    shards); their states save as DTensors (codes and scales one block per rank) for
    torch.distributed.checkpoint, and load only at the same shard layout. ``state_dict()`` holds the
    codes and scales themselves: loading it resumes bit-identically.
    """

    display_name = "coat.optim.AdamW4bit"
    _desc_words = _ops.DESC_WORDS
    _amax_word = _ops.AMAX_WORD
    _settings = ("master_weights", "nonfinite", "seed", "v_scaling")
    v_scaling = "rank1"  # what optimizers pickled before the setting existed used

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: str = "fp32",
        nonfinite: str = "propagate",
        seed: int = 0,
        v_scaling: str = "rank1",
    ) -> None:
        _hyper.check_settings(master_weights, nonfinite, seed)
        if v_scaling not in _state4.V_SCALINGS:
            raise ValueError(f"v_scaling must be one of {', '.join(map(repr, _state4.V_SCALINGS))} (row and column "
                             f"maxima, or blocks of 128), got {v_scaling!r}")
        flags = {"amsgrad": amsgrad, "maximize": maximize, "foreach": foreach, "capturable": capturable,
                 "differentiable": differentiable, "fused": fused}
        _compat.check_constructor(lr, betas, flags)
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, **flags}
        self.master_weights = master_weights
        self.nonfinite = nonfinite
        self.seed = seed
        self.v_scaling = v_scaling
        super().__init__(params, defaults)

    # ---- validation ----------------------------------------------------------------------------

    def _check_group(self, group: dict[str, Any]) -> None:
        _hyper.check_adam_group(group, self.nonfinite, self.display_name)

    def _master_kind(self, dtype: torch.dtype) -> str:
        return _hyper.master_kind(dtype, self.master_weights)

    def _check_param(self, p: torch.Tensor) -> None:
        _hyper.check_param_dtype(_local(p).dtype, self.master_weights, self.display_name)
        super()._check_param(p)

    # ---- state (layout: coat/optim/_state4.py) ---------------------------------------------------

    def _new_state(self, p: torch.Tensor, local: torch.Tensor, group: dict[str, Any], index: int) -> dict[str, Any]:
        return _state4.new_state(local, _state4.kind_of(p, local, self.v_scaling),
                                 self._master_kind(local.dtype), _state.param_seed(self.seed, index))

    def _check_state(self, state: dict[str, Any], local: torch.Tensor) -> None:
        _state4.check_state(state, local, _state4.state_kind(state))
        _state4.check_master(state, local, self._master_kind(local.dtype))

    def _check_saved(self, pid: Any, saved: dict[str, Any]) -> None:
        if "exp_avg_q4" not in saved and not ("exp_avg" in saved and "exp_avg_q" not in saved):
            raise ValueError(f"state[{pid}] is not a coat.optim.AdamW4bit state (keys {sorted(saved)})")

    def _load_state(self, saved: dict[str, Any], p: torch.Tensor, local: torch.Tensor, group: dict[str, Any],
                    what: str) -> dict[str, Any]:
        index = next(i for i, q in enumerate(q for g in self.param_groups for q in g["params"]) if q is p)
        layout = _state4.shard_layout(p) if _state._is_dtensor(p) and _state.is_sharded(p) else None
        return _state4.load_param_state(saved, local, _state4.kind_of(p, local, self.v_scaling),
                                        self._master_kind(local.dtype), _state.param_seed(self.seed, index), what, layout, tuple(p.shape))

    def _dtensor_state(self, state: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
        return _state4.to_dtensor_state(state, p)

    def _saved_state(self, state: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
        return _state4.to_dtensor_state(state, p)  # every parameter's: packed codes carry their shape

    # ---- launch ----------------------------------------------------------------------------------

    def _launch_key(self, local: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> tuple:
        return (local.dtype, grad.dtype, self._master_kind(local.dtype))

    def _descriptor_row(self, p: torch.Tensor, local: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                        begin: int) -> list[int]:
        return _state4.descriptor_row(local, grad, state, begin, _state.shard_index(p), _state4.state_kind(state))

    def _row_groups(self, local: torch.Tensor) -> int:
        return _state4.groups(local.numel())

    def _run_kernel(self, key: tuple, items: list, table: torch.Tensor, n_groups: int, group: dict[str, Any],
                    lr: torch.Tensor | None, grads: GradTransforms, found_inf: torch.Tensor | None) -> None:
        pdtype, gdtype, master = key[2:5]
        _ops.adamw4_step(
            table, n_groups, lr=0.0 if lr is not None else float(group["lr"]), lr_tensor=lr,
            beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
            weight_decay=group["weight_decay"], amp_scale=grads.amp_scale, clip_scale=grads.clip_scale,
            maximize=grads.maximize, found_inf=found_inf,
            param_dtype=pdtype, grad_dtype=gdtype, master=master, cpu_threads=torch.get_num_threads(),
        )
