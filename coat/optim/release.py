"""Gradient release: a coat.optim.FusedOptimizer's step (AdamW's) inside backward, so a full set of
gradients never exists.

A post-accumulate-grad hook on every parameter hands its finished gradient to the bucket it belongs
to (by default one bucket per decoder layer: each element of the model's ``nn.ModuleList`` s, and
one per module owning the remaining parameters). When every parameter of a bucket has its
gradient, the bucket runs the same fused kernel as ``optimizer.step()`` over them (one launch per device,
dtypes and parameter group, through a descriptor table cached per bucket, on the current stream,
without host synchronisation) and frees their gradients. Whatever a backward leaves incomplete (a
parameter that got no gradient) is launched when that backward ends (an autograd-engine callback).

Why the result is the ordinary step's, bit for bit: the kernel's arithmetic for an element depends
only on that element, its tensor's step count and its tensor's seed (the stochastic-rounding seed
derives from the parameter's position in the optimizer, never from launch order), so splitting one
launch into several changes nothing. Every autograd node that reads a parameter feeds its
AccumulateGrad, so the hook fires only after the last read of the value being replaced.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from typing import Any, Iterable, Iterator

import torch

from ._state import _local
from ._norm import _NormClip, clip_scale
from .fused import ReleaseTarget

__all__ = ["GradRelease", "step_in_backward", "clip_scale"]


def _refuse_wrappers(model: torch.nn.Module | None) -> None:
    if model is None or not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ValueError("gradient release cannot run under DistributedDataParallel: DDP all-reduces the "
                         "gradients after the hooks that release them have fired, so each rank would step with "
                         "its own unreduced gradient. Shard the model with FSDP2 (torch.distributed.fsdp."
                         "fully_shard), whose reduce-scatter completes a gradient before its hook fires")
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ValueError("gradient release does not support FSDP1 (FullyShardedDataParallel): its flat "
                         "parameters are not the optimizer's; use FSDP2 (torch.distributed.fsdp.fully_shard)")


def _model_buckets(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """Each element of every outermost ``nn.ModuleList`` (a decoder layer) is a bucket; every other
    parameter goes to the bucket of the module that registers it."""
    inside: set[int] = set()
    buckets: list[list[torch.nn.Parameter]] = []
    seen: set[int] = set()
    for mod in model.modules():  # pre-order: an outer ModuleList comes before the lists inside it
        if isinstance(mod, torch.nn.ModuleList) and id(mod) not in inside:
            for child in mod:
                inside.update(id(m) for m in child.modules())
                ps = [p for p in child.parameters() if id(p) not in seen]
                seen.update(id(p) for p in ps)
                if ps:
                    buckets.append(ps)
    for mod in model.modules():
        if id(mod) in inside:
            continue
        ps = [p for p in mod._parameters.values() if p is not None and id(p) not in seen]
        seen.update(id(p) for p in ps)
        if ps:
            buckets.append(ps)
    return buckets


def _explicit_buckets(buckets: Iterable[Any]) -> list[list[torch.nn.Parameter]]:
    out: list[list[torch.nn.Parameter]] = []
    seen: set[int] = set()
    for i, b in enumerate(buckets):
        members = [b] if isinstance(b, (torch.nn.Module, torch.Tensor)) else list(b)
        ps: list[torch.nn.Parameter] = []
        for m in members:
            got = list(m.parameters()) if isinstance(m, torch.nn.Module) else [m]
            for p in got:
                if not isinstance(p, torch.Tensor):
                    raise ValueError(f"buckets[{i}] holds a {type(p).__name__}; a bucket is a Module or an iterable "
                                     "of Parameters and Modules")
                if id(p) in seen:
                    raise ValueError(f"buckets[{i}]: a parameter of shape {tuple(p.shape)} is in more than one bucket")
                seen.add(id(p))
                ps.append(p)
        out.append(ps)
    return out


class GradRelease(_NormClip):
    """The handle that ``step_in_backward`` returns: the hooks, the buckets and the iteration's
    bookkeeping. See ``step_in_backward`` for the semantics."""

    def __init__(self, optimizer: ReleaseTarget, model: torch.nn.Module | None = None, *,
                 buckets: Iterable[Any] | None = None, max_grad_norm: float | None = None,
                 first_iteration: str = "skip", norm_estimate: str = "running") -> None:
        if not isinstance(optimizer, ReleaseTarget):
            raise TypeError("step_in_backward needs a coat optimizer whose step is planned and launched per bucket "
                            "(coat.optim.AdamW, AdamW4bit or SubsetNormSM: a coat.optim.fused.ReleaseTarget), got "
                            f"{type(optimizer).__name__}")
        if optimizer.release_handle is not None:
            raise RuntimeError("this optimizer already has gradient release attached; call .remove() on its "
                               "handle first")
        if optimizer.nonfinite == "raise":
            raise ValueError("gradient release cannot honour nonfinite='raise': that mode checks every gradient "
                             "before writing anything, and release steps each layer before the next one's "
                             "gradient exists; use nonfinite='propagate' (a non-finite gradient then shows up as "
                             "NaN in that parameter and its states)")
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                          or math.isnan(max_grad_norm) or max_grad_norm <= 0):
            raise ValueError(f"max_grad_norm must be a number > 0 (math.inf: measure the norm, never clip) or None, "
                             f"got {max_grad_norm!r}")
        if first_iteration not in ("skip", "unclipped"):
            raise ValueError(f"first_iteration must be 'skip' or 'unclipped', got {first_iteration!r}")
        if norm_estimate not in ("running", "previous"):
            raise ValueError(f"norm_estimate must be 'running' or 'previous', got {norm_estimate!r}")
        self.first_iteration = first_iteration
        if model is None and buckets is None:
            raise ValueError("step_in_backward needs the model (its decoder layers become the buckets) or buckets=")
        _refuse_wrappers(model)
        self.optimizer = optimizer
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        names = {}
        if model is not None:
            for n, p in model.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), n)
        in_opt = {id(p): p for g in optimizer.param_groups for p in g["params"]}
        raw = _explicit_buckets(buckets) if buckets is not None else _model_buckets(model)
        chosen: list[list[torch.nn.Parameter]] = []
        placed: set[int] = set()
        for b in raw:
            ps = [p for p in b if id(p) in in_opt and p.requires_grad]
            placed.update(id(p) for p in b)
            if ps:
                chosen.append(ps)
        for p in in_opt.values():  # the optimizer's parameters outside the model: one bucket each
            if id(p) not in placed and p.requires_grad:
                chosen.append([p])
        self._buckets: list[tuple[torch.nn.Parameter, ...]] = [tuple(b) for b in chosen]
        self._bucket_of = {id(p): i for i, b in enumerate(self._buckets) for p in b}
        self._names = {id(p): names.get(id(p), f"param_groups parameter of shape {tuple(p.shape)}")
                       for b in self._buckets for p in b}
        self._positions: dict[int, tuple[int, int, int]] = {}
        self._norm_group = self._find_norm_group() if self.max_grad_norm is not None else None
        self.norm_estimate = norm_estimate
        # Per bucket, its sharded parameters: under FSDP2 the running estimate sums their squared
        # norms over the ranks when the bucket launches (one small all-reduce, the same vector on
        # every rank: every rank flushes the same buckets in the same order, as FSDP2's
        # reduce-scatters complete them).
        self._sharded_of = [[p for p in b if self._is_sharded(p)] for b in self._buckets]
        # Carried from the last iteration whose norm was finite: its norm, per-parameter norms (by
        # position) and the total squared in fp64 (squares of fp32 norms cannot overflow there).
        self._carried: torch.Tensor | None = None
        self._prev_norms: dict[int, torch.Tensor] = {}
        self._prev_total_sq: torch.Tensor | None = None
        self._lock = threading.RLock()
        self._accumulating = 0
        self.grad_norm: torch.Tensor | None = None
        self._clip_scale: torch.Tensor | None = None
        self.stats = {"flushes": 0, "launches": 0, "incomplete": 0, "skipped_iterations": 0}
        self._reset_iteration()
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for b in self._buckets for p in b]
        optimizer.attach_release(self)

    # ---- public --------------------------------------------------------------------------------

    @property
    def buckets(self) -> list[list[str]]:
        """The parameters (by name in the model) of each bucket, one launch group each."""
        return [[self._names[id(p)] for p in b] for b in self._buckets]

    @contextlib.contextmanager
    def accumulate(self, enabled: bool = True) -> Iterator[None]:
        """Backward passes inside accumulate into ``.grad`` as without release (no step); the next
        backward outside releases the sums. ``enabled=False`` makes it a no-op (for
        ``with release.accumulate(i < n - 1):``)."""
        if not enabled:
            yield
            return
        with self._lock:
            self._accumulating += 1
        try:
            yield
        finally:
            with self._lock:
                self._accumulating -= 1

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to clip as the uninterrupted one: the norm carried into the next
        iteration, the last iteration's whose norm was finite (without it, the first iteration after
        loading is a first iteration: see first_iteration)."""
        per = None
        if self._prev_norms:
            n = max(self._prev_norms) + 1
            per = torch.full((n,), float("nan"))
            for i, v in self._prev_norms.items():
                per[i] = v.detach().float().cpu()
        norm = self._carried
        return {"grad_norm": None if norm is None else norm.detach().cpu().clone(), "param_norms": per}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the carried norm (and from it the next iteration's clipping scale)."""
        if not isinstance(state, dict) or "grad_norm" not in state:
            raise ValueError("not a GradRelease state dict (expected a dict with 'grad_norm')")
        norm = state["grad_norm"]
        if norm is not None and not (isinstance(norm, torch.Tensor) and norm.numel() == 1):
            raise ValueError(f"grad_norm must be None or a one-element tensor, got {norm!r}")
        per = state.get("param_norms")
        if per is not None and not (isinstance(per, torch.Tensor) and per.dim() == 1):
            raise ValueError(f"param_norms must be None or a 1-D tensor, got {per!r}")
        with self._lock:
            self._prev_norms, self._prev_total_sq, self._carried = {}, None, None
            if norm is None or self.max_grad_norm is None:
                self.grad_norm, self._clip_scale = None, None
                return
            dev = self._norm_device()
            self.grad_norm = norm.detach().to(dev, torch.float32).reshape(())
            self._carry(self.grad_norm.clone())
            if per is not None:  # older checkpoints carry only the total: the estimate then starts from it
                known = [i for i, v in enumerate(per.float().cpu().tolist()) if not math.isnan(v)]
                per = per.to(dev, torch.float32)
                self._prev_norms = {i: per[i] for i in known}

    def _norm_device(self) -> torch.device:
        return _local(self._buckets[0][0]).device if self._buckets else torch.device("cpu")

    def remove(self) -> None:
        """Detach: remove the hooks; the optimizer steps as usual again. Gradients not yet stepped
        stay in ``.grad`` (``optimizer.step()`` steps them)."""
        with self._lock:
            for h in self._handles:
                h.remove()
            self._handles = []
            self.optimizer.detach_release(self)
            self._reset_iteration()

    def __enter__(self) -> "GradRelease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (f"GradRelease({len(self._buckets)} buckets, max_grad_norm={self.max_grad_norm}, "
                f"attached={self.optimizer.release_handle is self})")

    # ---- per iteration ---------------------------------------------------------------------------

    def _reset_iteration(self) -> None:
        n = len(self._buckets)
        self._arrived = [0] * n
        self._expected: list[int | None] = [None] * n
        self._pending: list[list[torch.nn.Parameter]] = [[] for _ in range(n)]
        self._released: set[int] = set()
        self._norms: dict[int, torch.Tensor] = {}  # position in the optimizer -> norm of the local grad
        self._done_cur_sq: torch.Tensor | None = None  # running estimate: released so far, squared
        self._done_prev_sq: torch.Tensor | None = None  # ... and the same parameters' previous norms
        self._tasks: set[int] = set()

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        with self._lock:
            pid = id(p)
            if pid in self._released:
                what = ("accumulated another gradient" if self._accumulating else "received a second gradient")
                raise RuntimeError(
                    f"gradient release: parameter '{self._names[pid]}' {what} after its step in this iteration. "
                    "Call optimizer.step() once per iteration (under release it launches what is pending and ends "
                    "the iteration), and run every micro-batch but the last inside release.accumulate()")
            if self._accumulating:
                return
            self._released.add(pid)
            b = self._bucket_of[pid]
            if self._expected[b] is None:
                self._expected[b] = sum(1 for q in self._buckets[b] if q.requires_grad)
            self._arrived[b] += 1
            self._pending[b].append(p)
            self._queue_end_of_backward()
            if self._arrived[b] >= self._expected[b]:
                self._flush(b)

    def _queue_end_of_backward(self) -> None:
        # Outside a backward (a hook fired by hand) there is no engine callback: what stays pending is
        # launched by optimizer.step().
        task = torch._C._current_graph_task_id()
        if task >= 0 and task not in self._tasks:
            self._tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_of_backward(task))

    def _end_of_backward(self, task: int) -> None:
        with self._lock:
            self._tasks.discard(task)
            self._flush_all()
        # coat's FP8 weight cache (Fp8Recipe(weight_cache=True)) is keyed on version counters, which
        # the kernel's in-place writes do not bump; the ordinary step clears it through a step hook.
        weights = sys.modules.get("coat.nn.weights")
        if weights is not None:
            weights.invalidate_weight_cache()

    def _flush_all(self) -> None:
        for b, pending in enumerate(self._pending):
            if pending:
                self.stats["incomplete"] += 1
                self._flush(b)

    def _position(self, p: torch.nn.Parameter) -> tuple[int, int, int]:
        """(group index, index in the group, index in the whole list) of p, followed through
        add_param_group and load_state_dict."""
        groups = self.optimizer.param_groups
        pos = self._positions.get(id(p))
        if pos is None or pos[0] >= len(groups) or pos[1] >= len(groups[pos[0]]["params"]) \
                or groups[pos[0]]["params"][pos[1]] is not p:
            self._positions, first = {}, 0
            for gi, g in enumerate(groups):
                for j, q in enumerate(g["params"]):
                    self._positions.setdefault(id(q), (gi, j, first + j))
                first += len(g["params"])
            pos = self._positions.get(id(p))
            if pos is None:
                raise RuntimeError(f"gradient release: parameter '{self._names[id(p)]}' is no longer in the "
                                   "optimizer's parameter groups; call .remove() and step_in_backward again")
        return pos

    @torch.no_grad()
    def _flush(self, b: int) -> None:
        params, self._pending[b] = self._pending[b], []
        # A gradient zeroed since it arrived (zero_grad before step() with a launch still pending) is
        # not stepped, as the ordinary step would not.
        params = [p for p in params if p.grad is not None]
        if not params:
            return
        where = [self._position(p) for p in params]
        # Every table (and with it every check of the states) before anything is written.
        launches = self.optimizer.plan_launches([(p, gi, index) for p, (gi, _, index) in zip(params, where)],
                                                tag=("release", b))
        scale = self._clip_scale
        if self.max_grad_norm is not None:
            fresh = []
            for launch in launches:
                norms = torch._foreach_norm(launch.grads, 2, dtype=torch.float32)
                self._norms.update(zip(launch.positions, norms))
                fresh += list(zip(launch.positions, norms))
            if self._running_clip():
                scale = self._running_scale(self._squares(b, fresh, over_ranks=True))
            elif not math.isinf(self.max_grad_norm) and not self._measuring():
                scale = self._previous_scale(self._squares(b, fresh, over_ranks=False))
        if not self._measuring():
            self.optimizer.run_launches(launches, scale)
            self.stats["launches"] += len(launches)
        self.stats["flushes"] += 1
        for p in params:
            g = p.grad
            if g is not None and g.is_cuda:
                # The gradient may come from another stream (FSDP2's reduce-scatter): its memory must not
                # be handed out again before the launch on this stream has read it.
                _local(g).record_stream(torch.cuda.current_stream(g.device))
            p.grad = None

    # ---- optimizer.step() (coat.optim.fused.ReleaseHandle) -----------------------------------

    def before_step(self, amp_scale: Any, found_inf: Any) -> torch.Tensor | None:
        """Called by ``optimizer.step()`` first: refuses a GradScaler (its ``amp_scale`` /
        ``found_inf``), launches what is pending and returns the clipping scale the rest of the step
        launches with (or None)."""
        if amp_scale is not None or found_inf is not None:
            for name in ("grad_scale", "found_inf"):  # GradScaler removes them only after a step that returns
                self.optimizer.__dict__.pop(name, None)
            raise RuntimeError(
                "torch.amp.GradScaler cannot drive an optimizer under gradient release: a skipped step needs "
                "every gradient checked before any parameter is written, and release has already stepped each "
                "layer in backward (with the scaled gradients). Train in bf16 without a scaler, or call .remove() "
                "on the release handle")
        with self._lock:
            self._flush_all()
        return self._clip_scale

    def end_iteration(self) -> None:
        """Called by ``optimizer.step()`` last: the iteration's norm and the next clipping scale."""
        with self._lock:
            if self._released and self._measuring():
                self.stats["skipped_iterations"] += 1
            if self.max_grad_norm is not None:
                self._finish_norm()
            self._reset_iteration()


def step_in_backward(optimizer: ReleaseTarget, model: torch.nn.Module | None = None, *,
                     buckets: Iterable[Any] | None = None, max_grad_norm: float | None = None,
                     first_iteration: str = "skip", norm_estimate: str = "running") -> GradRelease:
    """Gradient release: ``optimizer`` (coat.optim.AdamW, AdamW4bit or SubsetNormSM) steps each
    parameter inside backward, as soon as its gradient is complete, and frees that gradient, so at
    most a bucket's gradients (a decoder layer's) exist at a time instead of the whole model's. The result is the
    ordinary step's, bit for bit, without clipping. docs/release.md has the whole contract
    (accumulation, FSDP2, tied and missing parameters, checkpointing, what is refused).

    Args:
        optimizer: the coat optimizer over the model's parameters (a ``coat.optim.fused.ReleaseTarget``:
            any ``FusedOptimizer`` subclass, or ``SubsetNormSM``; release drives it through that
            public protocol).
        model: the model; each element of every outermost ``nn.ModuleList`` (a decoder layer) is
            one bucket, each other module's own parameters another. Under FSDP2 the sharded model.
        buckets: instead of the model's layout, an explicit list of buckets (each a Module or an
            iterable of Parameters and Modules); parameters outside every bucket get their own.
        max_grad_norm: clip each bucket by ``min(1, max_grad_norm / (estimate + 1e-6))`` of an
            estimate of the total gradient norm (see ``norm_estimate``); ``math.inf`` only
            measures it. The iteration's norm is ``release.grad_norm`` after ``optimizer.step()``.
            None: no norm is computed.
        first_iteration: with clipping and no carried norm (the first iteration, unless
            ``load_state_dict`` restored one): "skip" (default) only measures the norm and drops
            the released gradients; "unclipped" steps them unclipped.
        norm_estimate: "running" (default): the norm released so far plus the previous
            iteration's norms of the parameters still to come, scaled by how the released ones
            changed (the last bucket clips by the exact norm; summed over ranks under FSDP2);
            "previous": the previous iteration's total norm. A non-finite norm clips with
            coefficient 0 (or NaN), as ``clip_grad_norm_`` does.

    Returns a ``GradRelease`` handle: ``accumulate()``, ``grad_norm``, ``state_dict()`` /
    ``load_state_dict()`` (the carried norm), ``buckets``, ``stats``, ``remove()`` (also a context
    manager). The training loop stays the ordinary one (``backward``, ``optimizer.step()``,
    ``zero_grad``, the lr scheduler); ``optimizer.step()`` ends each iteration.
    """
    return GradRelease(optimizer, model, buckets=buckets, max_grad_norm=max_grad_norm, first_iteration=first_iteration,
                       norm_estimate=norm_estimate)
