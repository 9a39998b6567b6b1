"""Gradient release: coat.optim.AdamW's step inside backward, so a full set of gradients never exists.

A post-accumulate-grad hook on every parameter hands its finished gradient to the bucket it belongs
to (by default one bucket per decoder layer: each element of the model's ``nn.ModuleList`` s, and
one per module owning the remaining parameters). When every parameter of a bucket has its
gradient, the bucket runs the same fused kernel as ``AdamW.step`` over them (one launch per device,
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
from collections import defaultdict
from typing import Any, Iterable, Iterator

import torch

from . import _state
from ._state import _local
from .adamw import AdamW

__all__ = ["GradRelease", "step_in_backward", "clip_scale"]


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The kernel's ``grad_scale`` (gradients are multiplied by ``1 / grad_scale``) that clips like
    ``torch.nn.utils.clip_grad_norm_``: coefficient ``min(1, max_norm / (norm + 1e-6))``, so an
    infinite norm gives coefficient 0 (scale inf: the gradients become 0) and a NaN norm NaN."""
    coef = torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)
    return torch.reciprocal(coef)


def _finite_or(new: torch.Tensor, ok: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
    """new where the iteration's norm is finite (ok), else the value carried before (new itself when
    nothing finite was carried yet), on the device, without synchronising."""
    return new if old is None else torch.where(ok, new, old.to(new.device, new.dtype))


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


class GradRelease:
    """The handle that ``step_in_backward`` returns: the hooks, the buckets and the iteration's
    bookkeeping. See ``step_in_backward`` for the semantics."""

    def __init__(self, optimizer: AdamW, model: torch.nn.Module | None = None, *,
                 buckets: Iterable[Any] | None = None, max_grad_norm: float | None = None,
                 first_iteration: str = "skip", norm_estimate: str = "running") -> None:
        if not isinstance(optimizer, AdamW):
            raise TypeError(f"step_in_backward needs a coat.optim.AdamW, got {type(optimizer).__name__}")
        if optimizer._release is not None:
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
        optimizer._release = self

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
            if self.optimizer._release is self:
                self.optimizer._release = None
            self._reset_iteration()

    def __enter__(self) -> "GradRelease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (f"GradRelease({len(self._buckets)} buckets, max_grad_norm={self.max_grad_norm}, "
                f"attached={self.optimizer._release is self})")

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
        opt = self.optimizer
        groups = opt.param_groups
        where = [self._position(p) for p in params]
        for gi in sorted({w[0] for w in where}):
            opt._check_hyper(groups[gi])
        by_key: dict[tuple, list] = defaultdict(list)
        indices: dict[tuple, list[int]] = defaultdict(list)
        for p, (gi, _, index) in zip(params, where):
            key, item = opt._item(p, groups[gi], gi, index)
            key += ("release", b)  # key[0] stays the device (the table cache's)
            by_key[key].append(item)
            indices[key].append(index)
        # Every table (and with it every check of the states) before anything is written.
        tables = {key: opt._descriptors(key, items) for key, items in by_key.items()}
        scale = self._clip_scale
        if self.max_grad_norm is not None:
            fresh = []
            for key, items in by_key.items():
                norms = torch._foreach_norm([grad for _, _, grad, _ in items], 2, dtype=torch.float32)
                self._norms.update(zip(indices[key], norms))
                fresh += list(zip(indices[key], norms))
            if self._running_clip():
                scale = self._running_scale(self._squares(b, fresh, over_ranks=True))
            elif not math.isinf(self.max_grad_norm) and not self._measuring():
                scale = self._previous_scale(self._squares(b, fresh, over_ranks=False))
        on_device: dict[tuple, torch.Tensor] = {}
        if not self._measuring():
            for key, items in by_key.items():
                opt._launch(key, items, *tables[key], scale, None, on_device)
                self.stats["launches"] += 1
        self.stats["flushes"] += 1
        for p in params:
            g = p.grad
            if g is not None and g.is_cuda:
                # The gradient may come from another stream (FSDP2's reduce-scatter): its memory must not
                # be handed out again before the launch on this stream has read it.
                _local(g).record_stream(torch.cuda.current_stream(g.device))
            p.grad = None

    def _running_clip(self) -> bool:
        return (self.norm_estimate == "running" and self._prev_total_sq is not None
                and not math.isinf(self.max_grad_norm))

    def _is_sharded(self, p: torch.nn.Parameter) -> bool:
        return self._norm_group is not None and _state._is_dtensor(p) and any(pl.is_shard() for pl in p.placements)

    def _squares(self, b: int, fresh: list, over_ranks: bool) -> list[tuple[int, torch.Tensor]]:
        """(position, squared norm in fp64: the square of an fp32 norm cannot overflow there) of the
        gradients bucket b launches now; with ``over_ranks``, a sharded parameter's summed over the
        ranks (the whole gradient's), in one all-reduce per bucket."""
        sq = {i: n.double().square() for i, n in fresh}
        sharded = self._sharded_of[b]
        if not (over_ranks and sharded):
            return list(sq.items())
        where = [self._position(p)[2] for p in sharded]
        dev = fresh[0][1].device
        zero = torch.zeros((), dtype=torch.float64, device=dev)  # a shard without a gradient here
        summed = torch.stack([sq[i].to(dev) if i in sq else zero for i in where])
        torch.distributed.all_reduce(summed, group=self._norm_group)
        sq.update((i, summed[j]) for j, i in enumerate(where) if i in sq)
        return list(sq.items())

    def _released_sq(self, fresh_sq: list) -> torch.Tensor:
        """Add this bucket's squared norms to the iteration's sum so far and return the sum."""
        dev = fresh_sq[0][1].device
        cur = torch.stack([q.to(dev) for _, q in fresh_sq]).sum()
        self._done_cur_sq = cur if self._done_cur_sq is None else self._done_cur_sq + cur
        return self._done_cur_sq

    def _previous_scale(self, fresh_sq: list) -> torch.Tensor:
        """The carried scale, unless the gradients released so far already have a non-finite norm:
        then, as clip_grad_norm_ would for the whole iteration, coefficient 0 (inf) or NaN. (Under
        FSDP2 the gradients this rank released: no collective.)"""
        done = self._released_sq(fresh_sq)
        bad = clip_scale(done.sqrt(), self.max_grad_norm)
        carried = self._clip_scale if self._clip_scale is not None else torch.ones_like(bad)
        return torch.where(torch.isfinite(done), carried.to(bad.device), bad)

    def _running_scale(self, fresh_sq: list) -> torch.Tensor:
        """The clipping scale of a bucket launching now: the norm estimated from the current
        gradients released so far (this bucket's included) and the previous iteration's norms of
        the parameters still to come, scaled by the current/previous ratio of those released. A
        gradient that grows from one iteration to the next is clipped in the bucket where it grows
        (and, as clip_grad_norm_ does, the buckets after it); the last bucket of a backward clips
        by the exact norm of the iteration. Sums of squares are fp64; sharded parameters' norms
        are over all ranks (current and previous), as in the total."""
        done = self._released_sq(fresh_sq)
        dev = done.device
        known = [self._prev_norms[i].to(dev, torch.float64) for i, _ in fresh_sq if i in self._prev_norms]
        if known:  # parameters without a previous norm (new in this iteration) add nothing to P
            prev = torch.stack(known).square().sum()
            self._done_prev_sq = prev if self._done_prev_sq is None else self._done_prev_sq + prev
        if self._done_prev_sq is None:
            self._done_prev_sq = torch.zeros((), dtype=torch.float64, device=dev)
        # The parameters still to come: their previous squared norms, scaled by how this iteration's
        # released gradients compare with the same parameters' previous ones (norms drift together:
        # early in training they fall by ~10% per step, and an unscaled previous norm over-clips).
        total = self._prev_total_sq.to(dev)
        rest = torch.clamp(total - self._done_prev_sq, min=0.0)
        ratio = torch.where(self._done_prev_sq > 0, done / self._done_prev_sq, 1.0)
        est = done + rest * ratio
        # A non-finite carried norm (no finite iteration yet) clips to nothing; a non-finite current
        # one gives coefficient 0 (inf) or NaN, as clip_grad_norm_ does for the whole iteration.
        est = torch.where(torch.isfinite(total), est, total)
        est = torch.where(torch.isfinite(done), est, done)
        return clip_scale(est.sqrt(), self.max_grad_norm)

    def _measuring(self) -> bool:
        """Whether this iteration only measures the norm (first_iteration="skip", no norm carried)."""
        return (self.first_iteration == "skip" and self.max_grad_norm is not None
                and not math.isinf(self.max_grad_norm) and self._clip_scale is None)

    # ---- optimizer.step() --------------------------------------------------------------------

    def _before_step(self, grad_scale: Any, found_inf: Any) -> None:
        if grad_scale is not None or found_inf is not None:
            for name in ("grad_scale", "found_inf"):  # GradScaler removes them only after a step that returns
                self.optimizer.__dict__.pop(name, None)
            raise RuntimeError(
                "torch.amp.GradScaler cannot drive an optimizer under gradient release: a skipped step needs "
                "every gradient checked before any parameter is written, and release has already stepped each "
                "layer in backward (with the scaled gradients). Train in bf16 without a scaler, or call .remove() "
                "on the release handle")
        with self._lock:
            self._flush_all()

    def _end_iteration(self) -> None:
        with self._lock:
            if self._released and self._measuring():
                self.stats["skipped_iterations"] += 1
            if self.max_grad_norm is not None:
                self._finish_norm()
            self._reset_iteration()

    def _find_norm_group(self) -> Any:
        """The process group over which sharded gradients' squared norms are summed (None: no sharded
        parameters)."""
        found = set()
        for b in self._buckets:
            for p in b:
                if not _state._is_dtensor(p):
                    continue
                dims = [d for d, pl in enumerate(p.placements) if pl.is_shard()]
                if len(dims) > 1:
                    raise NotImplementedError(f"gradient release with max_grad_norm: parameter '{self._names[id(p)]}' "
                                              f"is sharded over {len(dims)} mesh dimensions {tuple(p.placements)}; "
                                              "only one sharded dimension (FSDP2, HSDP) is supported")
                if dims:
                    found.add((p.device_mesh, dims[0]))
        if len(found) > 1:
            raise NotImplementedError("gradient release with max_grad_norm: parameters are sharded over different "
                                      "meshes; the norm needs one process group")
        if not found:
            return None
        mesh, dim = found.pop()
        return mesh.get_group(dim)

    def _finish_norm(self) -> None:
        """The total norm of this iteration's released gradients (as clip_grad_norm_ computes it over
        the whole model), and from it the clipping scale of the next iteration."""
        sharded, plain = [], []
        for b in self._buckets:
            for p in b:
                index = self._position(p)[2]
                n = self._norms.get(index)
                if self._is_sharded(p):
                    sharded.append((index, p, n))
                elif n is not None:
                    plain.append((index, n))
        plain.sort(key=lambda x: x[0])  # the optimizer's order, whatever order the buckets launched in
        sharded.sort(key=lambda x: x[0])
        total = None
        if plain:
            dev = plain[0][1].device
            total = torch.linalg.vector_norm(torch.stack([n.to(dev) for _, n in plain]))
        if self._norm_group is not None:
            # Every rank sums a vector of the same length (a zero where a shard got no gradient), so
            # the collective matches on all ranks whatever each released.
            dev = _local(sharded[0][1]).device
            zero = torch.zeros((), dtype=torch.float32, device=dev)
            sq = torch.stack([(n.to(dev) if n is not None else zero) ** 2 for _, _, n in sharded])
            torch.distributed.all_reduce(sq, group=self._norm_group)
            sq_total = sq.sum()
            total = torch.sqrt(sq_total + (total.to(dev) ** 2 if total is not None else 0.0))
            # The running estimate's previous norms of sharded parameters: the whole gradients'.
            plain += [(i, torch.sqrt(sq[j])) for j, (i, _, n) in enumerate(sharded) if n is not None]
        self.grad_norm = total
        if total is None:
            self._carried, self._prev_norms, self._prev_total_sq, self._clip_scale = None, {}, None, None
            return
        # An iteration whose norm is not finite was clipped to nothing (or NaN, as clip_grad_norm_);
        # its norms are no estimate of the next one's: the last finite iteration's stay carried.
        ok = torch.isfinite(total)
        old = self._prev_norms
        self._prev_norms = {i: _finite_or(n, ok, old.get(i)) for i, n in plain}
        self._carry(_finite_or(total.float(), ok, self._carried))

    def _carry(self, norm: torch.Tensor) -> None:
        """Make ``norm`` (fp32, on the device) the total norm the next iteration clips by."""
        self._carried = norm
        self._prev_total_sq = norm.double() ** 2
        self._clip_scale = None if math.isinf(self.max_grad_norm) else clip_scale(norm, self.max_grad_norm)


def step_in_backward(optimizer: AdamW, model: torch.nn.Module | None = None, *, buckets: Iterable[Any] | None = None,
                     max_grad_norm: float | None = None, first_iteration: str = "skip",
                     norm_estimate: str = "running") -> GradRelease:
    """Gradient release: ``optimizer`` (a ``coat.optim.AdamW``) steps each parameter inside
    backward, as soon as its gradient is complete, and frees that gradient, so at most a bucket's
    gradients (a decoder layer's) exist at a time instead of the whole model's.

    Args:
        optimizer: the ``coat.optim.AdamW`` over the model's parameters (its groups, formats,
            master weights, lr and scheduler work as without release).
        model: the model; each element of every outermost ``nn.ModuleList`` (a decoder layer) is
            one bucket, each other module's own parameters another. Under FSDP2 pass the sharded
            model: its DTensor parameters are the optimizer's, each rank releases its own shards as
            FSDP2's reduce-scatter completes them.
        buckets: instead of the model's layout, an explicit list of buckets (each a Module or an
            iterable of Parameters and Modules). Parameters of the optimizer outside every bucket
            get a bucket of their own.
        max_grad_norm: clip by an estimate of the total gradient norm (the current one is not
            known until every layer has been stepped): a bucket's gradients are multiplied by
            ``min(1, max_grad_norm / (estimate + 1e-6))``, see ``norm_estimate``. ``math.inf`` only
            measures the norm. The norm (of the released gradients, as ``clip_grad_norm_``
            computes it over the optimizer's parameters in their order; summed over ranks under
            FSDP2) is ``release.grad_norm`` after ``optimizer.step()``. None: no norm is computed.
        first_iteration: what an iteration without a carried norm (the first one, unless
            ``release.load_state_dict`` restored it) does when clipping: "skip" (default) only
            measures the norm, dropping its released gradients without a step; "unclipped" steps
            them unclipped. An unclipped first gradient is typically several times the clipped
            ones, and AdamW's second moment remembers its square for ~1 / (1 - beta2) steps and
            more, scaling the early updates down; a skipped first step costs one step at the
            warm-up's smallest lr. On ``coat train``'s CPU default run (clip 1.0) both rules ended
            as close to the ordinary clipped step as another seed does. (Measured figures belong
            in benchmarks/RESULTS.md, not in docstrings, where they go stale.)
        norm_estimate: "running" (default): when a bucket launches, the norm is estimated as
            ``sqrt(D + R * D / P)``: D the sum of this iteration's squared norms released so far
            (this bucket's included), P the previous iteration's squared norms of the same
            parameters, R the previous iteration's squared norms of the parameters still to come
            (R alone while P is 0); the last
            bucket of a backward therefore clips by the iteration's exact norm, and a gradient that
            spikes is clipped in its own bucket. "previous": every bucket clips by the previous
            iteration's total norm, ``norm_{t-1}``. Why the default: under "previous" a spike
            passes unclipped (its norm is known only afterwards) and AdamW's second moment keeps
            its square for ~1 / (1 - beta2) steps, slowing every later update: on a 1000-step GPU
            run of ``coat train`` (clip 1.0) the validation loss lagged the ordinary clipped run
            mid-run and at the end (benchmarks/RESULTS.md section 5). Under FSDP2 the squared norms of a
            bucket's sharded parameters are summed over the ranks when it launches (one small
            all-reduce per bucket, on the current stream, no host synchronisation), so every
            rank clips by the same estimate and the last bucket by the exact norm. In both
            modes, once the norm of the gradients released in an iteration is infinite (an
            element above ~1.8e19 overflows its tensor's fp32 norm, as in ``clip_grad_norm_``)
            or NaN, that bucket and the later ones clip with coefficient 0 (or NaN), as
            ``clip_grad_norm_`` clips the whole iteration; the next iteration clips by the
            last finite norm.

    Returns a ``GradRelease`` handle: ``release.accumulate()``, ``release.grad_norm``,
    ``release.state_dict()`` / ``load_state_dict()`` (the carried norm: save it beside the
    optimizer's to resume a clipped run exactly), ``release.buckets`` (parameter names per
    launch group), ``release.stats`` (flushes, launches, incomplete buckets, skipped iterations),
    ``release.remove()`` (also as a context manager: ``with step_in_backward(opt, model): ...``
    removes the hooks on exit).

    The training loop stays the ordinary one::

        release = coat.optim.step_in_backward(opt, model, max_grad_norm=1.0)
        for batch in data:
            model(**batch).loss.backward()   # every layer is stepped here, its gradient freed
            opt.step()                       # ends the iteration (launches nothing already done)
            opt.zero_grad()                  # nothing left to zero
            scheduler.step()                 # the lr is read when a bucket steps: next iteration

    Same result as without release, bit for bit (same data, same seed, no clipping): each
    element's update depends only on its own gradient, state, step count and seed, and the
    stochastic-rounding seed derives from the parameter's position in the optimizer, not from
    which bucket or launch it is stepped in.

    What the ordinary step allows and how it is handled here:

    - ``optimizer.step()`` must be called once per iteration. It launches what is still pending,
      steps any parameter that still holds a gradient (one whose hook did not fire), computes
      ``grad_norm`` and the next clipping scale, and ends the iteration. A parameter that gets a
      second gradient before it raises ``RuntimeError`` (it would be stepped twice).
    - Gradient accumulation: run every micro-batch but the last inside ``release.accumulate()``
      (gradients accumulate in ``.grad``); the last backward releases the sums. Under FSDP2,
      ``model.set_requires_gradient_sync(False)`` on the earlier micro-batches works the same way
      (FSDP2 fires the hooks only when it reduce-scatters). A parameter already stepped in this
      iteration that gets a gradient inside ``accumulate()`` raises ``RuntimeError``.
    - Global-norm clipping of the current gradients is impossible (``clip_grad_norm_`` needs every
      gradient first, which release never holds): use ``max_grad_norm`` (the running estimate,
      or the previous iteration's norm). Parameters stepped by ``optimizer.step()`` (not
      released) are clipped by the previous iteration's norm (unclipped in a skipped first
      iteration) but are not in the norm.
    - ``torch.amp.GradScaler``: ``scaler.step(optimizer)`` raises ``RuntimeError`` (a skipped step
      needs every gradient before any write). Train bf16 without a scaler.
    - Parameters shared between modules (tied embeddings): autograd sums every use's gradient
      before the parameter's hook fires once, so they are stepped once with the full gradient (in
      the bucket of the module that owns them first; its gradient lives until its last use's
      backward). The same parameter in two *separate* backward passes of one iteration needs
      ``accumulate()`` around the first.
    - A parameter whose hook does not fire in a backward (no gradient) is not stepped; its bucket
      launches without it when the backward ends.
    - Activation checkpointing (reentrant or not): a layer's recomputed forward reads only its
      own weights, stepped after its backward.
    - lr schedulers and ``lr`` changes: the lr is read when a bucket launches.
    - ``nonfinite='raise'`` and ``DistributedDataParallel`` (which reduces after the hooks fire) are
      refused at attach time; ``state_dict`` / ``load_state_dict`` / distributed checkpoints are
      unchanged (resume and attach release again).
    """
    return GradRelease(optimizer, model, buckets=buckets, max_grad_norm=max_grad_norm, first_iteration=first_iteration,
                       norm_estimate=norm_estimate)
