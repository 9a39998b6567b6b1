"""Clipping under gradient release: the norm estimate a bucket clips by when it launches, and the
iteration's total norm that the next iteration starts from (coat/optim/release.py uses it through
``_NormClip``, a base of ``GradRelease``). The total is computed as ``clip_grad_norm_`` computes it
over the optimizer's parameters; sums of squares are fp64, so squaring an fp32 norm cannot overflow."""

from __future__ import annotations

import math
from typing import Any

import torch

from . import _state
from ._state import _local


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


class _NormClip:
    """The clipping half of GradRelease. It reads the release's ``max_grad_norm``,
    ``norm_estimate``, ``first_iteration``, ``_buckets``, ``_sharded_of``, ``_names``, ``_norms``
    and ``_position``, and keeps the carried norm (``_carried``, ``_prev_norms``,
    ``_prev_total_sq``, ``_clip_scale``), this iteration's partial sums (``_done_cur_sq``,
    ``_done_prev_sq``), ``_norm_group`` and ``grad_norm``."""

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
