"""AdamW with FP8 optimizer states and Dynamic Range Expansion (COAT), fused into one kernel."""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch

from .._ops import adamw as _ops
from .._ops import quantize as _qops
from ..fp8.formats import format_name
from . import _compat, _state
from ._state import _local

__all__ = ["AdamW", "CoatAdamW"]

_MASTER = ("fp32", "bf16_sr")
_NONFINITE = ("propagate", "raise")


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class AdamW(torch.optim.Optimizer):
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
            is written; that check synchronises with the host once per step.
        seed: seed of the stochastic rounding (each parameter's seed derives from it and the
            parameter's position in the groups; stored in the state dict, so a resumed run rounds
            exactly as the uninterrupted one).

    ``copy.deepcopy(opt)`` and ``torch.save(opt)`` keep these settings (the copy steps as the
    original would). Load-state-dict post-hooks run after the states are loaded.

    ``torch.amp.GradScaler`` is supported the way torch's fused optimizers do it: the scaler hands
    ``grad_scale`` and ``found_inf`` to the step, the kernel unscales the gradients (times 1/scale)
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

    _step_supports_amp_scaling = True

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
        if master_weights not in _MASTER:
            raise ValueError(f"master_weights must be one of {_MASTER}, got {master_weights!r}")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite must be one of {_NONFINITE}, got {nonfinite!r}")
        if not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
        flags = dict(amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
                     differentiable=differentiable, fused=fused)
        _compat.check_constructor(lr, betas, flags)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **flags, m_format=m_format,
                        v_format=v_format, expansion=expansion)
        self.master_weights = master_weights
        self.nonfinite = nonfinite
        self.seed = seed
        self._check_hyper(defaults)
        self._reset_caches()
        self._release = None  # the GradRelease attached by coat.optim.step_in_backward, if any
        super().__init__(params, defaults)

    def _reset_caches(self) -> None:
        """Host-side caches: rebuilt on demand, never saved (they hold raw pointers)."""
        self._desc_cache: dict[tuple, tuple] = {}
        self._graph_tables: dict[int, tuple] = {}  # tables a CUDA-graph capture of step() reads
        self._minus_one: dict[torch.device, torch.Tensor] = {}  # maximize's grad_scale without a scaler

    # ---- pickling (copy.deepcopy, torch.save of the whole optimizer) --------------------------
    # torch's Optimizer.__getstate__ keeps only defaults, state and param_groups; coat's own settings
    # must travel too, and its caches must not (their pointers belong to the original's tensors).

    def __getstate__(self) -> dict[str, Any]:
        st = super().__getstate__()
        st.update(master_weights=self.master_weights, nonfinite=self.nonfinite, seed=self.seed)
        return st

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "master_weights" not in self.__dict__:  # pickled before coat kept its settings
            has_seed = any("sr_seed" in s for s in self.state.values() if isinstance(s, dict))
            self.master_weights = "bf16_sr" if has_seed else "fp32"
        self.__dict__.setdefault("nonfinite", "propagate")
        self.__dict__.setdefault("seed", 0)
        for k, v in _compat.TORCH_FLAGS.items():
            self.defaults.setdefault(k, v)
        for group in self.param_groups:
            _compat.fill_group_defaults(group)
        self._reset_caches()
        self._release = None  # a copy is not attached: the hooks belong to the original's parameters

    # ---- validation ------------------------------------------------------------------------

    def _check_hyper(self, group: dict[str, Any]) -> None:
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
            raise ValueError("betas as Tensors are not supported by coat.optim.AdamW: its kernel takes the betas "
                             "as floats at each launch (only lr can be a tensor read on the device); pass "
                             "floats, e.g. betas=(0.9, 0.999)")
        for i, b in enumerate(betas):
            if not _finite(b) or not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b} (must be a float in [0, 1))")
        if not _finite(group["eps"]) or group["eps"] < 0:
            raise ValueError(f"Invalid epsilon value: {group['eps']} (must be finite and >= 0)")
        if not _finite(group["weight_decay"]) or group["weight_decay"] < 0:
            raise ValueError(f"Invalid weight_decay value: {group['weight_decay']} (must be finite and >= 0)")
        group["m_format"] = format_name(group["m_format"], "m_format")
        group["v_format"] = format_name(group["v_format"], "v_format")
        if not isinstance(group["expansion"], bool):
            raise ValueError(f"expansion must be a bool, got {group['expansion']!r}")
        _compat.check_group_flags(group, self.nonfinite)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._check_hyper(group)
        for p in group["params"]:
            self._check_param(p)
        self._desc_cache.clear()

    def _master_kind(self, dtype: torch.dtype) -> str:
        if dtype == torch.float32:
            return "none"
        return self.master_weights

    def _check_param(self, p: torch.Tensor) -> None:
        local = _local(p)
        dt = local.dtype
        if dt not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"coat.optim.AdamW supports float32, bfloat16 and float16 parameters, got {dt}")
        if self.master_weights == "bf16_sr" and dt != torch.bfloat16 and dt != torch.float32:
            raise ValueError(f"master_weights='bf16_sr' needs bfloat16 parameters, got {dt}")
        if self.master_weights == "bf16_sr" and dt == torch.float32:
            raise ValueError("master_weights='bf16_sr' needs bfloat16 parameters, got float32 "
                             "(cast the model with .bfloat16(), or use master_weights='fp32')")
        _state.check_dense(local)

    # ---- state -----------------------------------------------------------------------------

    def _init_state(self, p: torch.Tensor, local: torch.Tensor, group: dict[str, Any], index: int) -> dict[str, Any]:
        # The rounding seed comes from the parameter's position in the groups, not from the order
        # states are created in: a resumed run seeds a parameter that first gets a gradient after
        # the checkpoint exactly as the uninterrupted run did.
        state = _state.new_state(local, group["m_format"], group["v_format"], self._master_kind(local.dtype),
                                 _state.param_seed(self.seed, index))
        self.state[p] = state
        return state

    @torch._disable_dynamo
    def state_dict(self) -> dict[str, Any]:
        # torch's packing, with sharded (DTensor) states wrapped before the post-hooks run, so that
        # the hooks see what is returned.
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        mapping: dict[int, int] = {}
        start, packed_groups = 0, []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            mapping.update({id(p): i for i, p in enumerate(g["params"], start) if id(p) not in mapping})
            packed["params"] = [mapping[id(p)] for p in g["params"]]
            start += len(packed["params"])
            packed_groups.append(packed)
        sd = {"state": {(mapping[id(k)] if isinstance(k, torch.Tensor) else k): v for k, v in self.state.items()},
              "param_groups": packed_groups}
        # Sharded (DTensor) parameters: every rank's state must reach a distributed checkpoint.
        for g in self.param_groups:
            for p in g["params"]:
                pid = mapping[id(p)]
                if pid in sd["state"] and _state._is_dtensor(p):
                    sd["state"][pid] = _state.to_dtensor_state(sd["state"][pid], p)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch's loader casts every floating-point state tensor to the parameter's dtype, which would
        # destroy FP8 codes and group maxima: coat loads its states itself, between torch's pre- and
        # post-hooks (so the post-hooks see them), and builds everything before replacing anything.
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             "optimizer's group")
        raw = state_dict["state"]
        id_map = dict(zip((i for s in saved_groups for i in s["params"]),
                          (p for g in self.param_groups for p in g["params"])))
        for pid, st in raw.items():
            if pid in id_map and st and "exp_avg_q" not in st:
                raise ValueError(f"state[{pid}] is not a coat.optim.AdamW state (keys {sorted(st)}); convert a "
                                 "torch.optim.AdamW state dict with coat.optim.from_torch_adamw_state")
        groups, group_of = [], {}
        for saved, cur in zip(saved_groups, self.param_groups):
            # Keys an older state dict lacks (torch's newer flags, coat's formats) keep this optimizer's.
            g = {**{k: v for k, v in cur.items() if k != "params"}, **saved, "params": cur["params"]}
            self._check_hyper(g)
            groups.append(g)
            group_of.update({id(p): g for p in g["params"]})
        state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        for pid, st in raw.items():
            p = id_map.get(pid)
            if p is None:  # not a parameter's state: kept as is, as torch does
                state[pid] = st
                continue
            if not st:  # a parameter without state yet
                continue
            g, local = group_of[id(p)], _local(p)
            state[p] = _state.load_param_state(st, local, g["m_format"], g["v_format"],
                                               self._master_kind(local.dtype), f"state[{pid}]")
        self.param_groups = groups
        self.state = state
        self._desc_cache.clear()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # ---- step ------------------------------------------------------------------------------

    def _item(self, p: torch.Tensor, group: dict[str, Any], gi: int, index: int) -> tuple[tuple, tuple]:
        """(launch key, (p, local, grad, state)) of a parameter holding a gradient, checked; its state
        created on first use. ``index``: its position in the whole parameter list (the state dict's
        id, from which the stochastic-rounding seed derives)."""
        local, grad = _local(p), _local(p.grad)
        if grad.is_sparse or grad.layout != torch.strided:
            raise ValueError("coat.optim.AdamW does not support sparse gradients")
        if grad.is_complex() or local.is_complex():
            raise ValueError("coat.optim.AdamW does not support complex parameters or gradients")
        if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"gradients must be float32, bfloat16 or float16, got {grad.dtype}")
        if grad.shape != local.shape:
            raise ValueError(f"gradient shape {tuple(grad.shape)} does not match the parameter's {tuple(local.shape)}")
        if grad.device != local.device:
            raise ValueError(f"gradient on {grad.device} but parameter on {local.device}")
        if not (local.is_contiguous() and grad.is_contiguous()):
            grad = _state.grad_like(local, grad)  # channels_last and other dense layouts
        if local.device.type not in ("cpu", "cuda"):
            raise ValueError(f"coat.optim.AdamW runs on CPU or CUDA tensors, got {local.device}")
        # An empty shard (an FSDP2 rank past a short dim 0) still gets its (empty) state and
        # its step count, so that every rank holds the same states with the same steps, as
        # distributed state dicts expect; it has no row in the kernel's descriptor table.
        state = self.state[p] or self._init_state(p, local, group, index)
        master = self._master_kind(local.dtype)
        return (local.device, local.dtype, grad.dtype, master, gi), (p, local, grad, state)

    def _gather(self) -> dict[tuple, list]:
        """Parameters with gradients, bucketed by what one launch can share."""
        buckets: dict[tuple, list] = defaultdict(list)
        first = 0  # position of the group's first parameter in the whole list (the state dict's id)
        for gi, group in enumerate(self.param_groups):
            self._check_hyper(group)
            params = group["params"]
            for j, p in enumerate(params):
                if p.grad is None:
                    continue
                key, item = self._item(p, group, gi, first + j)
                buckets[key].append(item)
            first += len(params)
        return buckets

    def _descriptors(self, key: tuple, items: list) -> tuple[torch.Tensor, int]:
        """The descriptor table of one launch. Built in full (every state checked) when a parameter
        or state pointer changed (a moved model, loaded states: load_state_dict and add_param_group
        clear the cache); when only gradients moved, as they do from step to step under
        ``zero_grad(set_to_none=True)``, only their column is rewritten."""
        # Every pointer the table holds: a state tensor replaced in place (opt.state[p][k] = ...) must
        # not leave the kernel writing to the old one.
        static = tuple((local.data_ptr(), id(state), *_state.tensor_ptrs(state)) for _, local, _, state in items)
        grads = [grad.data_ptr() for _, _, grad, _ in items]
        hit = self._desc_cache.get(key)
        if hit is not None and hit[0] == static:
            _, kept, rows, begin, old_grads, table, host = hit
            if old_grads == grads:
                self._keep_if_captured(key[0], table, host)
                return table, begin
            rows = rows.clone()
            rows[:, 1] = torch.tensor([grads[i] for i in kept], dtype=torch.int64)
        else:
            kept, lists, begin, seen = [], [], 0, set()
            for i, (p, local, grad, state) in enumerate(items):
                _state.check_state(state, local)  # a moved or re-laid-out tensor changes a pointer: checked here
                if local.numel() == 0:
                    continue
                if local.data_ptr() in seen:  # one launch would update it twice, racing with itself
                    raise ValueError(f"a parameter of shape {tuple(local.shape)} appears more than once in the "
                                     "optimizer's parameter groups (or two parameters start at the same address); "
                                     "pass each parameter once")
                seen.add(local.data_ptr())
                kept.append(i)
                lists.append(_state.descriptor_row(local, grad, state, begin, _state.shard_index(p)))
                begin += _state.groups(local.numel())
            rows = torch.tensor(lists, dtype=torch.int64).reshape(-1, _state.DESC_WORDS)
        device = key[0]
        if device.type == "cuda":
            host = rows.pin_memory()  # a fresh pinned buffer: an earlier copy from the old one may be in flight
            table = host.to(device, non_blocking=True)
        else:
            host = table = rows
        # The pinned host copy stays referenced: a CUDA graph that captured the copy replays it.
        self._desc_cache[key] = (static, kept, rows, begin, grads, table, host)
        self._keep_if_captured(device, table, host)
        return table, begin

    def _keep_if_captured(self, device: torch.device, table: torch.Tensor, host: torch.Tensor) -> None:
        """A CUDA graph captured now reads this table (and copies from its pinned host rows, when the
        copy was captured) by address at every replay: it is kept for the optimizer's lifetime, so
        that a later eager step with other gradients, add_param_group or load_state_dict (which
        build new tables and drop the cached ones) never frees or reuses memory a graph replays.
        One entry per distinct captured table: recapturing with the same tables adds nothing."""
        if _capturing(device):
            self._graph_tables[id(table)] = (table, host)

    def _negated(self, scale: torch.Tensor | None, device: torch.device, on_device: dict) -> torch.Tensor:
        """grad_scale for a maximize group: the kernel multiplies gradients by 1 / grad_scale, so a
        negated scale (exactly -1 without a scaler) negates them within the one pass it makes."""
        if scale is None:
            if device not in self._minus_one:
                self._minus_one[device] = torch.full((1,), -1.0, dtype=torch.float32, device=device)
            return self._minus_one[device]
        if ("-grad_scale", device) not in on_device:
            on_device[("-grad_scale", device)] = torch.neg(scale)
        return on_device[("-grad_scale", device)]

    def _launch(self, key: tuple, items: list, table: torch.Tensor, n_groups: int, grad_scale: Any,
                found_inf: Any, on_device: dict[tuple, torch.Tensor]) -> None:
        """Count the step of every tensor of one launch and run the fused kernel over its table, on
        the current stream. ``grad_scale`` / ``found_inf``: tensors (any device) or None; copies on
        the launch's device are kept in ``on_device`` for the other launches of the same step."""
        device, pdtype, gdtype, master, gi = key[:5]
        group = self.param_groups[gi]

        def to_dev(t: torch.Tensor | None, what: str) -> torch.Tensor | None:
            if t is None:
                return None
            if (what, device) not in on_device:
                on_device[(what, device)] = t.to(device=device, dtype=torch.float32, non_blocking=True).reshape(1)
            return on_device[(what, device)]

        steps = [st["step"] for _, _, _, st in items]
        torch._foreach_add_(steps, 1)
        lr = group["lr"]
        lr_t = to_dev(lr, f"lr{gi}") if isinstance(lr, torch.Tensor) else None
        fi = to_dev(found_inf, "found_inf")
        gs = to_dev(grad_scale, "grad_scale")
        if group["maximize"]:
            gs = self._negated(gs, device, on_device)
        m_fmt, v_fmt = group["m_format"], group["v_format"]
        if n_groups > 0:  # else only empty shards: their steps count, nothing to compute
            _ops.adamw_step(
                table, n_groups, lr=0.0 if lr_t is not None else float(lr), lr_tensor=lr_t,
                beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                weight_decay=group["weight_decay"], grad_scale=gs,
                found_inf=fi, param_dtype=pdtype, grad_dtype=gdtype, master=master,
                m_fmt=m_fmt, v_fmt=v_fmt, expansion=group["expansion"],
                m_log2_range=_state.log2_range(m_fmt), v_log2_range=_state.log2_range(v_fmt),
                cpu_threads=torch.get_num_threads(),
            )
        if fi is not None:  # a skipped step does not count (torch's fused optimizers do the same)
            torch._foreach_sub_(steps, [fi.reshape(())] * len(steps))
        _compat.bump_versions([p for p, _, _, _ in items] + [st["master"] for *_, st in items if "master" in st])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW step over the parameters that hold a gradient.

        Under gradient release (``coat.optim.step_in_backward``) backward has already stepped and
        freed every released gradient: ``step()`` then ends the iteration. It launches what is
        still pending, steps any parameter that still holds a gradient (one whose hook did not
        fire, e.g. after ``release.accumulate()``), and sets ``release.grad_norm`` and the clipping
        scale of the next iteration; it must be called once per iteration."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        release = self._release
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if release is not None:
            release._before_step(grad_scale, found_inf)
            grad_scale = release._clip_scale
        buckets = self._gather()
        if self.nonfinite == "raise":
            self._raise_on_nonfinite(buckets)
        # Every table (and with it every check of the states) before anything is written.
        tables = {key: self._descriptors(key, items) for key, items in buckets.items()}
        on_device: dict[tuple, torch.Tensor] = {}
        for key, items in buckets.items():
            self._launch(key, items, *tables[key], grad_scale, found_inf, on_device)
        if release is not None:
            release._end_iteration()
        return loss

    @staticmethod
    def _raise_on_nonfinite(buckets: dict[tuple, list]) -> None:
        grads = [g for items in buckets.values() for _, _, g, _ in items]
        if not grads:
            return
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            by_device[g.device].append(g)
        bad = 0
        for gs in by_device.values():  # one host synchronisation per device
            norms = torch._foreach_norm(gs, math.inf)
            bad += int((~torch.isfinite(torch.stack([n.float() for n in norms]))).sum())
        if bad:
            raise FloatingPointError(f"non-finite gradient in {bad} parameter(s) (nonfinite='raise'); "
                                     "nothing was updated")

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)

    def state_bytes(self) -> int:
        """Bytes held by the optimizer state (codes, group metadata, masters, step counters)."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))


#: Alias for users coming from NVlabs COAT (``CoatAdamW``).
CoatAdamW = AdamW
