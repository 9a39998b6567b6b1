"""AdamW with FP8 optimizer states and Dynamic Range Expansion (COAT), fused into one kernel."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .._ops import adamw as _ops
from .._ops import quantize as _qops
from ..fp8.formats import format_name
from . import _compat, _hyper, _state
from ._state import _local
from .fused import FusedOptimizer, GradTransforms

__all__ = ["AdamW", "CoatAdamW"]

class AdamW(FusedOptimizer):
    """AdamW whose moments are stored in FP8 with Dynamic Range Expansion (COAT, ICLR 2025).

    m and v are kept per group of 128 consecutive elements of each parameter (groups never cross
    tensors; under FSDP2, of each rank's local shard) as FP8 codes plus the group's max (fp32) and
    expansion exponent (1 byte): 2 x (1 + 5/128) bytes per parameter. One fused kernel per step
    decodes them, applies the ``torch.optim.AdamW`` update in fp32 registers, re-encodes them and
    writes the parameter (and its fp32 master); one launch covers all tensors that share a device,
    dtypes and parameter group, with no host synchronisation, so ``step()`` can be captured in a
    CUDA graph (the descriptor tables a capture reads stay alive as long as the optimizer: later
    eager steps, ``add_param_group`` and ``load_state_dict`` build new ones and never free or
    rewrite a captured one). Each step bumps the autograd version counters of the parameters (and
    masters) it writes, as an in-place update does. Without CUDA the same semantics run on the CPU
    (C++).

    Args:
        params: parameters (dense: contiguous, channels_last or any other dimension order; the
            step works in memory order) or parameter groups (groups may override lr, betas, eps,
            weight_decay, maximize, m_format, v_format and expansion).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``; ``lr`` may be a tensor (read on
            the device at each step: change it in place to keep a captured graph valid); betas are
            floats.
        amsgrad, maximize, foreach, capturable, differentiable, fused: ``torch.optim.AdamW``'s
            keywords. ``maximize=True`` ascends (the gradients are negated inside the one pass the
            kernel makes); ``foreach``, ``fused`` and ``capturable`` take any value and change
            nothing (the step is always one fused multi-tensor launch without host
            synchronisation); ``amsgrad`` and ``differentiable`` must be False. Combinations torch
            refuses are refused with torch's exception.
        m_format, v_format: FP8 format of m and v: "e4m3" or "e5m2". v defaults to E5M2: v
            spans twice m's range (squared gradients), and a group wider than the format is
            compressed (k < 1, coarser steps; docs/numerics.md), which E5M2's range makes rarer
            (tests/python/test_optim_state_error.py measures both on a real run's moments).
        group_size: elements per quantization group; only 128 (the kernel's compile-time size).
        expansion: Dynamic Range Expansion (``False``: plain per-group FP8, scale gmax / fmt_max).
        master_weights: for bf16/fp16 parameters, "fp32" keeps an fp32 master copy (as COAT
            does); "bf16_sr" (bf16 parameters only) keeps none and writes the weights with
            stochastic rounding. fp32 parameters are their own master.
        nonfinite: "propagate" (default) behaves as torch.optim.AdamW: a NaN/Inf gradient makes
            that element's moments NaN (stored as the NaN code) and its parameter non-finite.
            "raise" checks the gradients first and raises ``FloatingPointError`` before anything
            is written; that check synchronises with the host once per step. Under GradScaler
            (which passes ``found_inf``) its own skip decides instead: an overflowing step is
            skipped, not raised, as GradScaler expects.
        seed: seed of the stochastic rounding (each parameter's seed derives from it and the
            parameter's position in the groups; stored in the state dict, so a resumed run rounds
            exactly as the uninterrupted one).

    ``copy.deepcopy(opt)`` and ``torch.save(opt)`` keep these settings (the copy steps as the
    original would). Load-state-dict post-hooks run after the states are loaded.

    The machinery that is not AdamW's (bucketing, descriptor tables and CUDA-graph safety, state
    dict framing, GradScaler and gradient release) is ``coat.optim.FusedOptimizer``'s; this class
    adds the hyperparameters, the FP8 state layout and the kernel call.

    ``torch.amp.GradScaler`` is supported the way torch's fused optimizers do it: the scaler hands
    ``grad_scale`` and ``found_inf`` to the step, the kernel unscales the gradients (times 1/scale,
    an argument of its own beside release's clipping scale and ``maximize``)
    and writes nothing when an inf was found (gradients are left scaled in ``.grad``).

    Gradient release (``coat.optim.step_in_backward(opt, model)``) runs this step inside backward,
    one launch per decoder layer as its gradients complete, and frees them: a full set of
    gradients never exists. Same result bit for bit; see ``coat/optim/release.py``.

    Under FSDP2 / HSDP, ``state_dict()`` returns each sharded parameter's state as DTensors (codes
    and master laid out like the parameter; group metadata as a grid over the whole parameter where
    every shard starts on a 128-element group boundary, else one block per shard), so
    ``torch.distributed.checkpoint`` with ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``
    saves every rank's shard and resumes bit-identically at the same world size, and loads exactly
    at another world size where the metadata is a grid.
    """

    display_name = "coat.optim.AdamW"
    _desc_words = _state.DESC_WORDS
    _amax_word = _state.AMAX_WORD
    _settings = ("master_weights", "nonfinite", "seed")

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
        m_format: str = "e4m3",
        v_format: str = "e5m2",
        group_size: int = 128,
        expansion: bool = True,
        master_weights: str = "fp32",
        nonfinite: str = "propagate",
        seed: int = 0,
    ) -> None:
        if group_size != _qops.DRE_GROUP_SIZE:
            raise ValueError(f"group_size must be {_qops.DRE_GROUP_SIZE} (the fused kernel's group size), got {group_size}")
        _hyper.check_settings(master_weights, nonfinite, seed)
        flags = dict(amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
                     differentiable=differentiable, fused=fused)
        _compat.check_constructor(lr, betas, flags)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **flags, m_format=m_format,
                        v_format=v_format, expansion=expansion)
        self.master_weights = master_weights
        self.nonfinite = nonfinite
        self.seed = seed
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "master_weights" not in self.__dict__:  # pickled before coat kept its settings
            has_seed = any("sr_seed" in s for s in self.state.values() if isinstance(s, dict))
            self.master_weights = "bf16_sr" if has_seed else "fp32"
        self.__dict__.setdefault("seed", 0)
        for k, v in _compat.TORCH_FLAGS.items():
            self.defaults.setdefault(k, v)
        for group in self.param_groups:
            _compat.fill_group_defaults(group)

    # ---- validation ------------------------------------------------------------------------

    def _check_group(self, group: dict[str, Any]) -> None:
        _hyper.check_adam_group(group, self.nonfinite, self.display_name)
        group["m_format"] = format_name(group["m_format"], "m_format")
        group["v_format"] = format_name(group["v_format"], "v_format")
        if not isinstance(group["expansion"], bool):
            raise ValueError(f"expansion must be a bool, got {group['expansion']!r}")

    def _master_kind(self, dtype: torch.dtype) -> str:
        return _hyper.master_kind(dtype, self.master_weights)

    def _check_param(self, p: torch.Tensor) -> None:
        _hyper.check_param_dtype(_local(p).dtype, self.master_weights, self.display_name)
        super()._check_param(p)

    # ---- state (the layout is coat/optim/_state.py's) ------------------------------------------

    def _new_state(self, p: torch.Tensor, local: torch.Tensor, group: dict[str, Any], index: int) -> dict[str, Any]:
        # The rounding seed comes from the parameter's position in the groups, not from the order
        # states are created in: a resumed run seeds a parameter that first gets a gradient after
        # the checkpoint exactly as the uninterrupted run did.
        return _state.new_state(local, group["m_format"], group["v_format"], self._master_kind(local.dtype),
                                _state.param_seed(self.seed, index))

    def _check_saved(self, pid: Any, saved: dict[str, Any]) -> None:
        if "exp_avg_q" not in saved:
            raise ValueError(f"state[{pid}] is not a coat.optim.AdamW state (keys {sorted(saved)}); convert a "
                             "torch.optim.AdamW state dict with coat.optim.from_torch_adamw_state")

    def _load_state(self, saved: dict[str, Any], p: torch.Tensor, local: torch.Tensor, group: dict[str, Any],
                    what: str) -> dict[str, Any]:
        return _state.load_param_state(saved, local, group["m_format"], group["v_format"],
                                       self._master_kind(local.dtype), what)

    def _dtensor_state(self, state: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
        return _state.to_dtensor_state(state, p)

    def _check_state(self, state: dict[str, Any], local: torch.Tensor) -> None:
        _state.check_state(state, local)
        _state.check_master(state, local, self._master_kind(local.dtype))

    # ---- launch ------------------------------------------------------------------------------

    def _launch_key(self, local: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> tuple:
        return (local.dtype, grad.dtype, self._master_kind(local.dtype))

    def _descriptor_row(self, p: torch.Tensor, local: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                        begin: int) -> list[int]:
        return _state.descriptor_row(local, grad, state, begin, _state.shard_index(p))

    def _row_groups(self, local: torch.Tensor) -> int:
        return _state.groups(local.numel())

    def _run_kernel(self, key: tuple, items: list, table: torch.Tensor, n_groups: int, group: dict[str, Any],
                    lr: torch.Tensor | None, grads: GradTransforms, found_inf: torch.Tensor | None) -> None:
        pdtype, gdtype, master = key[2:5]
        m_fmt, v_fmt = group["m_format"], group["v_format"]
        _ops.adamw_step(
            table, n_groups, lr=0.0 if lr is not None else float(group["lr"]), lr_tensor=lr,
            beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
            weight_decay=group["weight_decay"], amp_scale=grads.amp_scale, clip_scale=grads.clip_scale,
            maximize=grads.maximize, found_inf=found_inf, param_dtype=pdtype, grad_dtype=gdtype, master=master,
            m_fmt=m_fmt, v_fmt=v_fmt, expansion=group["expansion"],
            m_log2_range=_state.log2_range(m_fmt), v_log2_range=_state.log2_range(v_fmt),
            cpu_threads=torch.get_num_threads(),
        )


#: Alias for users coming from NVlabs COAT (``CoatAdamW``).
CoatAdamW = AdamW
