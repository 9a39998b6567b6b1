"""The fused multi-tensor optimizer seam: what every optimizer of coat shares (``FusedOptimizer``),
and the protocol between it and gradient release (``ReleaseHandle``). docs/optimizers.md."""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from typing import Any, Callable, Iterable, NamedTuple, Protocol

import torch

from ..nn import weight_amax
from . import _compat, _state
from ._state import _local

__all__ = ["FusedOptimizer", "GradTransforms", "Launch", "ReleaseHandle"]


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class Launch(NamedTuple):
    """One kernel launch: its key (``key[0]`` the device, ``key[1]`` the parameter group's index,
    then the subclass's ``_launch_key``, then the caller's tag), its items (``(param, local shard,
    gradient, state)`` per parameter, the gradient laid out like the shard), its descriptor table
    and group count, and each parameter's position in the whole parameter list."""

    key: tuple
    items: list
    table: torch.Tensor
    n_groups: int
    amax: list  # (parameter, its weight_amax slot) for each parameter whose amax the launch writes
    positions: list[int]

    @property
    def grads(self) -> list[torch.Tensor]:
        return [grad for _, _, grad, _ in self.items]


class GradTransforms(NamedTuple):
    """What a step does to the gradients inside its one pass, three separate things: GradScaler's
    ``amp_scale`` (g / amp_scale), gradient release's ``clip_scale`` (g / clip_scale) and the group's
    ``maximize`` (-g). The scales are fp32 [1] tensors on the launch's device, or None."""

    amp_scale: torch.Tensor | None
    clip_scale: torch.Tensor | None
    maximize: bool


class ReleaseHandle(Protocol):
    """What a ``FusedOptimizer`` calls on the gradient release attached to it (``attach_release``)."""

    def before_step(self, amp_scale: Any, found_inf: Any) -> torch.Tensor | None:
        """At the start of ``step()``: refuse a GradScaler (its ``amp_scale`` / ``found_inf``), launch
        what is still pending, and return the ``clip_scale`` the rest of the step launches with (or None)."""

    def end_iteration(self) -> None:
        """At the end of ``step()``: close the iteration (its norm, the next clipping scale)."""


class ReleaseTarget:
    """What gradient release (``coat.optim.step_in_backward``) drives: an optimizer that plans and runs
    its step for any subset of its parameters (``plan_launches(entries, tag)`` checks everything and
    returns launches with ``grads`` and ``positions``; ``run_launches(launches, clip_scale)`` writes),
    has a ``nonfinite`` setting, and calls the attached handle from ``step()``. ``FusedOptimizer``
    and ``coat.optim.SubsetNormSM`` are the ones coat has."""

    _release: ReleaseHandle | None = None

    @property
    def release_handle(self) -> ReleaseHandle | None:
        """The gradient release attached to this optimizer, or None."""
        return self._release

    def attach_release(self, handle: ReleaseHandle) -> None:
        """Attach ``handle``: from now on ``step()`` calls its ``before_step`` and ``end_iteration``."""
        if self._release is not None:
            raise RuntimeError("this optimizer already has gradient release attached; call .remove() on its "
                               "handle first")
        self._release = handle

    def detach_release(self, handle: ReleaseHandle) -> None:
        """Detach ``handle`` if it is the attached one; ``step()`` is the ordinary one again."""
        if self._release is handle:
            self._release = None


def add_checked_group(opt: torch.optim.Optimizer, param_group: dict[str, Any]) -> dict[str, Any]:
    """torch's ``add_param_group`` (it fills in the defaults and appends), then the optimizer's
    ``_check_group`` and ``_check_param``: a group refused after torch appended it is taken out
    again, so it never steps (nor makes later steps fail). Returns the group as added."""
    torch.optim.Optimizer.add_param_group(opt, param_group)
    group = opt.param_groups[-1]
    try:
        opt._check_group(group)
        for p in group["params"]:
            opt._check_param(p)
    except Exception:
        opt.param_groups.pop()
        raise
    return group


def _versions(p: torch.Tensor) -> tuple[int, int]:
    """Autograd's in-place counters of a parameter and of its local shard (a DTensor's)."""
    return p._version, _local(p)._version


class FusedOptimizer(ReleaseTarget, torch.optim.Optimizer):
    """Base of coat's fused multi-tensor optimizers: one kernel launch per device, parameter group
    and launch key covers every tensor, through a table of per-tensor descriptor rows, with no host
    synchronisation, so ``step()`` can be captured in a CUDA graph.

    The base holds what does not depend on the update rule: parameter and gradient checks,
    bucketing by launch key, the descriptor tables and their cache (a table a CUDA-graph capture
    read is kept for the optimizer's lifetime), the step skeleton (step counts, ``lr`` as a tensor,
    the gradient transforms (``GradTransforms``: GradScaler's scale, release's clipping scale,
    ``maximize``), GradScaler's ``found_inf``, ``nonfinite='raise'``, gradient release), ``state_dict`` / ``load_state_dict`` framing, ``zero_grad``, ``state_bytes``,
    deepcopy and pickling.

    A subclass implements (the protocol; ``coat.optim.AdamW`` is one):

    - ``display_name`` (class attribute): the name error messages use.
    - ``_desc_words`` (class attribute): int64 words of one descriptor row.
    - ``_amax_word`` (class attribute, optional): the word of a row that points at the parameter's
      amax slot, which the kernel folds the largest finite |value| it writes into
      (``coat.nn.weight_amax``: the next forward then quantizes the weight without an amax pass);
      None (the default): the optimizer writes no amax.
    - ``_settings`` (class attribute): instance attributes that pickling keeps (``nonfinite`` at least).
    - ``_check_group(group)``: check (and normalise in place) a parameter group's hyperparameters;
      called for the defaults, on ``add_param_group``, at every step and on ``load_state_dict``.
    - ``_check_param(p)``: check a parameter when its group is added (the base checks it is dense).
    - ``_launch_key(local, grad, group)``: what, beyond device and group, one launch must share.
    - ``_new_state(p, local, group, index)``: a parameter's fresh state, a dict holding at least a
      ``"step"`` tensor (counted by the base; a ``"master"`` tensor, if any, is written by the step).
      ``index``: the parameter's position in the whole parameter list (its state dict id).
    - ``_check_state(state, local)``: a state the kernel can use with this shard (else ValueError).
    - ``_descriptor_row(p, local, grad, state, begin)`` and ``_row_groups(local)``: a tensor's
      descriptor row (word 1 the gradient's data pointer: the cache rewrites that column alone when
      only gradients moved), and how many work groups it adds (``begin`` is the running sum).
    - ``_run_kernel(key, items, table, n_groups, group, lr, grads, found_inf)``: the kernel
      call. ``lr``: the group's lr on the device when it is a tensor, else None (read
      ``group["lr"]``). ``grads``: the ``GradTransforms`` the kernel applies to the gradients;
      ``found_inf`` skips the step. Not called when ``n_groups`` is 0.
    - ``_check_saved(pid, saved)`` and ``_load_state(saved, p, local, group, what)``: refuse a
      foreign state, and turn a saved state into a live one (checked, on the parameter's device).
    - ``_dtensor_state(state, p)``: a sharded parameter's state as DTensors for ``state_dict``
      (``_saved_state``, which a subclass may override, calls it for DTensor parameters).

    Gradient release (``coat.optim.step_in_backward``) drives any subclass through the public
    methods ``release_handle``, ``attach_release``, ``detach_release``, ``plan_launches`` and
    ``run_launches``; the optimizer calls the handle only through ``ReleaseHandle``.
    """

    _step_supports_amp_scaling = True
    display_name = "coat.optim.FusedOptimizer"
    _desc_words = 1
    _amax_word: int | None = None
    _settings: tuple[str, ...] = ("nonfinite",)
    #: "propagate": non-finite gradients flow into the update; "raise": checked before any write.
    nonfinite = "propagate"

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], defaults: dict[str, Any]) -> None:
        self._check_group(defaults)
        self._reset_caches()
        self._release: ReleaseHandle | None = None  # attached by coat.optim.step_in_backward, if any
        super().__init__(params, defaults)

    def _reset_caches(self) -> None:
        """Host-side caches: rebuilt on demand, never saved (they hold raw pointers)."""
        self._desc_cache: dict[tuple, tuple] = {}
        self._graph_tables: dict[int, tuple] = {}  # tables a CUDA-graph capture of step() reads
        # id(p) -> p's and its shard's autograd versions when the step last wrote p from its fp32
        # master: a parameter changed in place since (model.load_state_dict, pruning, clamping) is
        # the new starting point, so its master is read from it again, as torch.optim keeps the edit.
        # Edits through p.data are invisible (autograd does not count them either).
        self._synced: dict[int, tuple[int, int]] = {}

    # ---- pickling (copy.deepcopy, torch.save of the whole optimizer) --------------------------
    # torch's Optimizer.__getstate__ keeps only defaults, state and param_groups; coat's own settings
    # must travel too, and its caches must not (their pointers belong to the original's tensors).

    def __getstate__(self) -> dict[str, Any]:
        st = super().__getstate__()
        st.update({k: getattr(self, k) for k in self._settings})
        return st

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("nonfinite", "propagate")
        self._reset_caches()
        self._release = None  # a copy is not attached: the hooks belong to the original's parameters

    # ---- the protocol's hooks (see the class docstring) ---------------------------------------

    def _check_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _check_param(self, p: torch.Tensor) -> None:
        _state.check_dense(_local(p))

    def _launch_key(self, local: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> tuple:
        raise NotImplementedError

    def _new_state(self, p: torch.Tensor, local: torch.Tensor, group: dict[str, Any], index: int) -> dict[str, Any]:
        raise NotImplementedError

    def _check_state(self, state: dict[str, Any], local: torch.Tensor) -> None:
        raise NotImplementedError

    def _descriptor_row(self, p: torch.Tensor, local: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                        begin: int) -> list[int]:
        raise NotImplementedError

    def _row_groups(self, local: torch.Tensor) -> int:
        raise NotImplementedError

    def _run_kernel(self, key: tuple, items: list, table: torch.Tensor, n_groups: int, group: dict[str, Any],
                    lr: torch.Tensor | None, grads: GradTransforms, found_inf: torch.Tensor | None) -> None:
        raise NotImplementedError

    def _check_saved(self, pid: Any, saved: dict[str, Any]) -> None:
        pass

    def _load_state(self, saved: dict[str, Any], p: torch.Tensor, local: torch.Tensor, group: dict[str, Any],
                    what: str) -> dict[str, Any]:
        raise NotImplementedError

    def _dtensor_state(self, state: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
        raise NotImplementedError(f"{self.display_name} has no state dict for sharded (DTensor) parameters")

    def _saved_state(self, state: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
        """A parameter's state as ``state_dict`` returns it: a sharded parameter's as DTensors. A
        subclass may add what loading must check (a new dict: the live state stays as it is)."""
        return self._dtensor_state(state, p) if _state._is_dtensor(p) else state

    # ---- parameter groups and state dicts -----------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        add_checked_group(self, param_group)
        self._desc_cache.clear()

    def _init_state(self, p: torch.Tensor, local: torch.Tensor, group: dict[str, Any], index: int) -> dict[str, Any]:
        state = self._new_state(p, local, group, index)
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
                if pid in sd["state"]:
                    sd["state"][pid] = self._saved_state(sd["state"][pid], p)
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
            if pid in id_map and st:
                self._check_saved(pid, st)
        groups, group_of = [], {}
        for saved, cur in zip(saved_groups, self.param_groups):
            # Keys an older state dict lacks (torch's newer flags, coat's formats) keep this optimizer's.
            g = {**{k: v for k, v in cur.items() if k != "params"}, **saved, "params": cur["params"]}
            self._check_group(g)
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
            state[p] = self._load_state(st, p, _local(p), group_of[id(p)], f"state[{pid}]")
        self.param_groups = groups
        self.state = state
        self._desc_cache.clear()
        # loaded masters are the truth for the parameters as they are now (a model loaded first)
        self._synced = {id(p): _versions(p) for p, st in state.items()
                        if isinstance(p, torch.Tensor) and "master" in st}
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # ---- launches ------------------------------------------------------------------------------

    def _item(self, p: torch.Tensor, group: dict[str, Any], gi: int, index: int) -> tuple[tuple, tuple]:
        """(launch key, (p, local, grad, state)) of a parameter holding a gradient, checked; its state
        created on first use. ``index``: its position in the whole parameter list (the state dict's
        id, from which a subclass may derive per-parameter seeds)."""
        local, grad = _local(p), _local(p.grad)
        name = self.display_name
        if grad.is_sparse or grad.layout != torch.strided:
            raise ValueError(f"{name} does not support sparse gradients")
        if grad.is_complex() or local.is_complex():
            raise ValueError(f"{name} does not support complex parameters or gradients")
        if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"gradients must be float32, bfloat16 or float16, got {grad.dtype}")
        if grad.shape != local.shape:
            raise ValueError(f"gradient shape {tuple(grad.shape)} does not match the parameter's {tuple(local.shape)}")
        if grad.device != local.device:
            raise ValueError(f"gradient on {grad.device} but parameter on {local.device}")
        if not (local.is_contiguous() and grad.is_contiguous()):
            grad = _state.grad_like(local, grad)  # channels_last and other dense layouts
        if local.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} runs on CPU or CUDA tensors, got {local.device}")
        # An empty shard (an FSDP2 rank past a short dim 0) still gets its (empty) state and
        # its step count, so that every rank holds the same states with the same steps, as
        # distributed state dicts expect; it has no row in the kernel's descriptor table.
        state = self.state[p] or self._init_state(p, local, group, index)
        if "master" in state and self._synced.get(id(p), _versions(p)) != _versions(p):
            if _capturing(local.device):  # a captured copy would replay at every step, rounding the master
                raise RuntimeError(f"{name}: a parameter of shape {tuple(local.shape)} was changed in place since "
                                   "the last step, and this step is being captured in a CUDA graph, whose replays "
                                   "would overwrite it again each time: change parameters before the warm-up steps")
            _state.adopt_edits(state["master"], local)  # edited since the last step: the edit stands
        return (local.device, gi, *self._launch_key(local, grad, group)), (p, local, grad, state)

    def _gather(self) -> tuple[dict[tuple, list], dict[tuple, list[int]]]:
        """Parameters with gradients, bucketed by what one launch can share, and their positions."""
        buckets: dict[tuple, list] = defaultdict(list)
        positions: dict[tuple, list[int]] = defaultdict(list)
        first = 0  # position of the group's first parameter in the whole list (the state dict's id)
        for gi, group in enumerate(self.param_groups):
            self._check_group(group)
            params = group["params"]
            for j, p in enumerate(params):
                if p.grad is None:
                    continue
                key, item = self._item(p, group, gi, first + j)
                buckets[key].append(item)
                positions[key].append(first + j)
            first += len(params)
        return buckets, positions

    def _plan(self, buckets: dict[tuple, list], positions: dict[tuple, list[int]]) -> list[Launch]:
        # Every table (and with it every check of the states) before anything is written.
        return [Launch(key, items, *self._descriptors(key, items), positions[key]) for key, items in buckets.items()]

    def plan_launches(self, entries: Iterable[tuple[torch.Tensor, int, int]], tag: tuple = ()) -> list[Launch]:
        """The launches that step ``entries`` (``(parameter, group index, position in the whole
        parameter list)``, each holding a gradient), checked and with their descriptor tables
        built, before anything is written. ``tag`` extends each launch key (gradient release tags
        its buckets: each gets its own cached tables)."""
        entries = list(entries)
        groups = self.param_groups
        for gi in sorted({gi for _, gi, _ in entries}):
            self._check_group(groups[gi])
        buckets: dict[tuple, list] = defaultdict(list)
        positions: dict[tuple, list[int]] = defaultdict(list)
        for p, gi, index in entries:
            key, item = self._item(p, groups[gi], gi, index)
            key += tag  # key[0] stays the device (the table cache's)
            buckets[key].append(item)
            positions[key].append(index)
        return self._plan(buckets, positions)

    def run_launches(self, launches: Iterable[Launch], clip_scale: torch.Tensor | None = None, *,
                     amp_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
        """Run planned launches on the current stream, in order: gradients divided by ``clip_scale``
        (gradient clipping) and by ``amp_scale`` (GradScaler's scale), negated where the group
        maximizes; a nonzero ``found_inf`` skips the step. Tensors on any device, or None."""
        on_device: dict[tuple, torch.Tensor] = {}
        launches = list(launches)
        amax = []
        for launch in launches:
            amax += self._launch(launch, clip_scale, amp_scale, found_inf, on_device)
        # in sync once all have run: a launch's writes also move the versions of views of one buffer
        # that other launches stepped (else each step would take those for edits); so do the amax slots
        self.mark_synced(p for launch in launches for p, *_ in launch.items)
        if amax:
            if launches and _capturing(launches[0].key[0]):
                weight_amax.captured(amax)  # written at each replay, not now
            else:
                weight_amax.written(amax)

    @torch.no_grad()
    def adopt_edits(self, params: Iterable[torch.Tensor]) -> None:
        """Parameters changed in place since the step last wrote them (their versions moved): their
        fp32 masters take the edits now, in place, as an eager step would (coat.CudaGraphStep calls
        this before a replay: the captured kernel reads the masters by address)."""
        for p in params:
            state = self.state.get(p)
            if state and "master" in state and self._synced.get(id(p), _versions(p)) != _versions(p):
                _state.adopt_edits(state["master"], _local(p))
                self._synced[id(p)] = _versions(p)

    def mark_synced(self, params: Iterable[torch.Tensor]) -> None:
        """The fp32 masters of ``params`` hold what the parameters were last written from (a step
        that wrote them, also one replayed from a CUDA graph): their versions as they are now."""
        self._synced.update((id(p), _versions(p)) for p in params if "master" in self.state.get(p, ()))

    def _descriptors(self, key: tuple, items: list) -> tuple[torch.Tensor, int, list]:
        """The descriptor table of one launch, its group count and the (parameter, amax slot) pairs
        whose slots it writes (``coat.nn.weight_amax``; subclasses with ``_amax_word``, the word of
        the descriptor that points at the slot). Built in full (every state checked) when a parameter
        or state pointer changed (a moved model, loaded states: load_state_dict and add_param_group
        clear the cache); when only gradients moved, as they do from step to step under
        ``zero_grad(set_to_none=True)``, only their column is rewritten."""
        amax_on = self._amax_word is not None and weight_amax.ENABLED
        # Every pointer the table holds: a state tensor replaced in place (opt.state[p][k] = ...) must
        # not leave the kernel writing to the old one.
        # and every shape: a parameter shrunk in place at the same address must be checked again
        # (an amax slot lives as long as its parameter on its device: looked up again with the table)
        static = (amax_on, *((local.data_ptr(), tuple(local.shape), id(state), *_state.tensor_ptrs(state))
                             for _, local, _, state in items))
        grads = [grad.data_ptr() for _, _, grad, _ in items]
        hit = self._desc_cache.get(key)
        if hit is not None and hit[0] == static:
            _, kept, rows, begin, old_grads, table, host, amax = hit
            if old_grads == grads:
                self._keep_if_captured(key[0], table, host)
                return table, begin, amax
            rows = rows.clone()
            rows[:, 1] = torch.tensor([grads[i] for i in kept], dtype=torch.int64)
        else:
            slots = [weight_amax.slot(p) if amax_on and weight_amax.wants_slot(p) else None for p, *_ in items]
            kept, lists, begin, seen = [], [], 0, set()
            for i, (p, local, grad, state) in enumerate(items):
                self._check_state(state, local)  # a moved or re-laid-out tensor changes a pointer: checked here
                if local.numel() == 0:
                    continue
                if local.data_ptr() in seen:  # one launch would update it twice, racing with itself
                    raise ValueError(f"a parameter of shape {tuple(local.shape)} appears more than once in the "
                                     "optimizer's parameter groups (or two parameters start at the same address); "
                                     "pass each parameter once")
                seen.add(local.data_ptr())
                kept.append(i)
                row = self._descriptor_row(p, local, grad, state, begin)
                if slots[i] is not None:
                    row[self._amax_word] = slots[i].data_ptr()
                lists.append(row)
                begin += self._row_groups(local)
            rows = torch.tensor(lists, dtype=torch.int64).reshape(-1, self._desc_words)
            amax = [(items[i][0], slots[i]) for i in kept if slots[i] is not None]
        device = key[0]
        if device.type == "cuda":
            host = rows.pin_memory()  # a fresh pinned buffer: an earlier copy from the old one may be in flight
            table = host.to(device, non_blocking=True)
        else:
            host = table = rows
        # The pinned host copy stays referenced: a CUDA graph that captured the copy replays it.
        self._desc_cache[key] = (static, kept, rows, begin, grads, table, host, amax)
        self._keep_if_captured(device, table, host)
        return table, begin, amax

    def _keep_if_captured(self, device: torch.device, table: torch.Tensor, host: torch.Tensor) -> None:
        """A CUDA graph captured now reads this table (and copies from its pinned host rows, when the
        copy was captured) by address at every replay: it is kept for the optimizer's lifetime, so
        that a later eager step with other gradients, add_param_group or load_state_dict (which
        build new tables and drop the cached ones) never frees or reuses memory a graph replays.
        One entry per distinct captured table: recapturing with the same tables adds nothing."""
        if _capturing(device):
            self._graph_tables[id(table)] = (table, host)

    def _launch(self, launch: Launch, clip_scale: Any, amp_scale: Any, found_inf: Any,
                on_device: dict[tuple, torch.Tensor]) -> list[torch.Tensor]:
        """Count the step of every tensor of one launch and run the kernel over its table, on the
        current stream. ``clip_scale`` / ``amp_scale`` / ``found_inf``: tensors (any device) or None;
        copies on the launch's device are kept in ``on_device`` for the other launches of the step.
        Returns the parameters whose amax slots it wrote (``coat.nn.weight_amax``)."""
        key, items, table, n_groups = launch.key, launch.items, launch.table, launch.n_groups
        device, gi = key[0], key[1]
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
        grads = GradTransforms(to_dev(amp_scale, "amp_scale"), to_dev(clip_scale, "clip_scale"),
                               bool(group.get("maximize", False)))
        # The kernel folds each weight's amax into its zeroed slot (coat.nn.weight_amax). Not where
        # GradScaler may skip the step; zeroed in a capture too, where the graph's replays write them.
        amax = launch.amax if fi is None else []
        if n_groups > 0:  # else only empty shards: their steps count, nothing to compute
            try:  # the kernel reads the counted step; a call refused before it launched takes it back
                if amax:
                    torch._foreach_zero_([s for _, s in amax])
                self._run_kernel(key, items, table, n_groups, group, lr_t, grads, fi)
            except Exception:
                torch._foreach_sub_(steps, 1)
                weight_amax.forget(p for p, _ in launch.amax)
                raise
        if fi is not None:  # a skipped step does not count; found_inf is a flag, though GradScaler passes
            # the sum of its devices' flags (torch's fused AdamW subtracts that sum: two devices, two steps)
            torch._foreach_sub_(steps, [(fi.reshape(()) != 0).float()] * len(steps))
        _compat.bump_versions([p for p, _, _, _ in items] + [st["master"] for *_, st in items if "master" in st])
        return [p for p, _ in amax] if n_groups > 0 else []

    # ---- step ----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step over the parameters that hold a gradient.

        Under gradient release (``coat.optim.step_in_backward``) backward has already stepped and
        freed every released gradient: ``step()`` then ends the iteration. It launches what is
        still pending, steps any parameter that still holds a gradient (one whose hook did not
        fire, e.g. after ``release.accumulate()``), and sets ``release.grad_norm`` and the clipping
        scale of the next iteration; it must be called once per iteration."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self._step()
        except BaseException:
            # GradScaler sets these for one step() and deletes them after it returns: after a raise
            # they would stay, and every later step would read a stale found_inf and skip
            for name in ("grad_scale", "found_inf"):
                self.__dict__.pop(name, None)
            raise
        return loss

    def _step(self) -> None:
        release = self._release
        amp_scale = getattr(self, "grad_scale", None)  # GradScaler's names for them
        found_inf = getattr(self, "found_inf", None)
        clip_scale = release.before_step(amp_scale, found_inf) if release is not None else None
        buckets, positions = self._gather()
        # under GradScaler, non-finite gradients are its found_inf's to skip (an overflow of the
        # scaled loss is how it finds its scale), not an error
        if self.nonfinite == "raise" and found_inf is None:
            self._raise_on_nonfinite(buckets)
        self.run_launches(self._plan(buckets, positions), clip_scale, amp_scale=amp_scale, found_inf=found_inf)
        if release is not None:
            release.end_iteration()

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
        """Bytes held by the optimizer state (for AdamW: codes, group metadata, masters, step counters)."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))
