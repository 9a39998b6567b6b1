"""Opt-in statistics of the FP8 GEMM operands: how much of each tensor per-tensor scaling loses.

For every converted projection (a fused group such as q/k/v counts as one) and every operand
role, an ``Fp8Stats`` collector accumulates on the operand's device, with no host sync:

- ``x``: the forward GEMM's activation input (E4M3), ``w``: the (stacked) weight (E4M3; the
  backward reads the same codes transposed), ``dy``: the output gradient (E5M2, read by both
  backward GEMMs), ``x_wgrad``: the weight-gradient GEMM's activation input where the backward
  recomputes it (after a fused RMSNorm or SwiGLU) and quantizes it with a scale of its own;
- per role: elements, non-zero elements, **underflow** (non-zero elements whose FP8 code is zero:
  ``|x| / s`` at most half the format's smallest subnormal, which rounds to zero), **saturated**
  (``|x| / s`` that would round past the format's max, above 464 for E4M3 and from 61440 for
  E5M2: the values saturation clips; an amax-derived scale clips only infinities) and ``amax``
  (max |x|; NaN once one was seen).

Computed with torch ops from the unquantized operand and the scale the quantizer used, exactly as
the quantizer rounds (``|x| * fp32(1/s)``). With row or block scaling (``Fp8Recipe.granularity``)
the operands are quantized anew by the same scaled quantizer the layers use, and counted from its
codes; ``dy`` is then the input-gradient GEMM's operand (the weight gradient's, scaled along the
tokens, is not recorded) and ``x_wgrad`` every weight-gradient input, saved or recomputed. Several full passes over each operand: this is a
diagnostic, not free (``benchmarks/bench_fp8_stats.py`` measures it); sample a step now and then.
While a collector records, each block op (``coat._ops.block``) also returns the GEMM inputs it
makes inside (the normed and SwiGLU activations, the recomputed weight-gradient inputs) and their
scales; they live until recorded, and the results are unchanged. Not recorded: FP8-frozen weights (already codes), calls
inside ``torch.compile`` or a CUDA graph capture, the fused LM head's ``fp8_backward``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._ops import quantize as qops
from .._ops.enums import FP8_DTYPE_IDS

__all__ = ["Fp8Stats", "fp8_stats", "ROLES"]

ROLES = ("x", "w", "dy", "x_wgrad")

#: The collector recording now (None: nothing records; the layers check only this).
active: "Fp8Stats | None" = None

_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# format -> (half its smallest subnormal: |x|/s at or below it rounds to the zero code (the tie goes
# to the even zero); the smallest fp32 |x|/s that would round past the max, which saturation clips:
# max + half the spacing there, a tie that E4M3 rounds down to its even max and E5M2 up)
_LIMITS = {_E4M3: (2.0**-10, 464.0 + 2.0**-15), _E5M2: (2.0**-17, 61440.0)}


def _add_counts(entry: "_Entry", x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> None:
    """Adds one operand, quantized with ``scale``, to ``entry``: [non-zero, underflow, saturated]
    counts and amax, in one pass of the core (coat/operand_stats.h) on x's device, no host sync."""
    half_sub, clip = _LIMITS[fp8_dtype]
    qops.fp8_operand_stats(x.contiguous(), scale.float().reshape(1), half_sub, clip, entry.counts, entry.amax)


def _add_scaled_counts(entry: "_Entry", x, mode: str, transposed: bool, fp8_dtype: torch.dtype) -> None:
    """Adds one operand quantized at row or block granularity (``mode``, a ``quantize.SCALE_MODES``
    name; ``transposed``: as the weight-gradient GEMM's transposed operand) by coat's own scaled
    quantizer: the same counts, from its codes (a zero code of a non-zero element is an underflow;
    with a scale per group from its amax only infinities saturate). ``x``: a tensor or the stacked
    parts of a weight, quantized as one matrix (its 128x128 tiles cross the parts)."""
    parts = [p.reshape(-1, p.shape[-1]).contiguous() for p in (x if isinstance(x, (list, tuple)) else (x,))]
    rows, cols = sum(p.shape[0] for p in parts), parts[0].shape[1]
    if rows * cols == 0:
        return
    q, _, q_t, _ = qops.quantize_scaled(parts, rows, cols, FP8_DTYPE_IDS[fp8_dtype], None if transposed else mode,
                                        mode if transposed else None)
    codes = (q_t.t() if transposed else q).view(torch.uint8)
    whole = parts[0] if len(parts) == 1 else torch.cat(parts)
    nz = whole != 0  # NaN included, as the per-tensor count
    entry.counts[0] += nz.sum()
    entry.counts[1] += (nz & ((codes & 0x7F) == 0)).sum()
    entry.counts[2] += torch.isinf(whole).sum()
    entry.amax.copy_(torch.maximum(entry.amax, whole.abs().amax().float()))  # NaN stays NaN


class _Entry:
    __slots__ = ("counts", "amax", "numel", "calls")

    def __init__(self, device: torch.device):
        self.counts = torch.zeros(3, dtype=torch.int64, device=device)
        self.amax = torch.zeros((), dtype=torch.float32, device=device)
        self.numel = 0
        self.calls = 0


class Fp8Stats:
    """Collects FP8 operand statistics while entered (``with stats: ...``); may be entered again
    (it keeps accumulating until ``reset``). ``model``: names projections by their modules' names
    in it (a fused group by its members', e.g. ``layers.0.self_attn.q_proj+k_proj+v_proj``);
    projections it does not hold are named ``linear<i>`` in the order they are first seen."""

    def __init__(self, model: nn.Module | None = None):
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        self._names: dict[int, str] = {}
        if model is not None:
            for name, mod in model.named_modules():
                w = getattr(mod, "weight", None)
                if isinstance(w, torch.Tensor) and w.dim() == 2:
                    self._names.setdefault(id(w), name.removesuffix(".base_layer"))  # PEFT's wrapped Linear
        self._groups: dict[tuple[int, ...], str] = {}
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._outer: Fp8Stats | None = None

    # ---- recording ------------------------------------------------------------------------

    def __enter__(self) -> "Fp8Stats":
        global active
        if active is self:
            raise RuntimeError("this Fp8Stats is already recording")
        self._outer, active = active, self
        return self

    def __exit__(self, *exc: Any) -> None:
        global active
        active, self._outer = self._outer, None

    def _group_name(self, weights) -> str:
        ids = tuple(id(w) for w in weights)
        name = self._groups.get(ids)
        if name is None:
            names = [self._names.get(i) for i in ids]
            if None in names:
                name = f"linear{sum(1 for n in self._groups.values() if n.startswith('linear'))}"
            elif len(names) == 1:
                name = names[0]
            else:  # "a.b.q_proj", "a.b.k_proj" -> "a.b.q_proj+k_proj"
                head = names[0].rpartition(".")[0]
                same = all(n.rpartition(".")[0] == head for n in names)
                name = "+".join([names[0]] + [n.rpartition(".")[2] if same else n for n in names[1:]])
            self._groups[ids] = name
        return name

    def record(self, weights, role: str, x: torch.Tensor, scale: torch.Tensor | None, fp8_dtype: torch.dtype,
               mode: str | None = None, transposed: bool = False) -> None:
        """Adds one operand, quantized to ``fp8_dtype`` with the per-tensor ``scale``, of the
        projection whose weights are ``weights`` (``x``: one tensor or the list of stacked weight
        parts); with ``mode`` (row or block granularity: ``quantize.SCALE_MODES``), quantized in
        that mode instead (``transposed``: as a weight-gradient operand), ``scale`` unused."""
        parts = x if isinstance(x, (list, tuple)) else (x,)
        if torch.compiler.is_compiling() or (parts[0].is_cuda and torch.cuda.is_current_stream_capturing()):
            return
        key = (self._group_name(weights), role)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(parts[0].device)
        if mode is not None:
            _add_scaled_counts(entry, list(parts), mode, transposed, fp8_dtype)
        else:
            for part in parts:
                _add_counts(entry, part, scale, fp8_dtype)
        entry.numel += sum(p.numel() for p in parts)
        entry.calls += 1

    # ---- reading --------------------------------------------------------------------------

    def reset(self) -> None:
        """Forgets everything recorded so far (names are kept)."""
        self._entries.clear()

    def read(self, reset: bool = False) -> dict[str, dict[str, dict[str, float | int]]]:
        """``{projection: {role: {...}}}`` of what was recorded, with one host sync. Each role:
        ``numel``, ``nonzero``, ``underflow``, ``saturated`` (counts summed over ``calls``),
        ``underflow_frac`` (of the non-zero elements), ``saturated_frac`` (of all elements),
        ``amax`` (the largest |x| seen)."""
        out: dict[str, dict[str, dict[str, float | int]]] = {}
        if self._entries:
            keys = list(self._entries)
            # One copy per device (a model spread over several is rare; one is the rule).
            per_dev: dict[torch.device, list[int]] = {}
            for i, k in enumerate(keys):
                per_dev.setdefault(self._entries[k].amax.device, []).append(i)
            rows: list[list[float]] = [[] for _ in keys]
            for idx in per_dev.values():
                es = [self._entries[keys[i]] for i in idx]
                host = torch.cat([torch.cat([e.counts.double(), e.amax.double().reshape(1)]) for e in es]).tolist()
                for j, i in enumerate(idx):
                    rows[i] = host[4 * j: 4 * j + 4]
            for (name, role), (nz, under, sat, amax) in zip(keys, rows):
                e = self._entries[(name, role)]
                out.setdefault(name, {})[role] = {
                    "calls": e.calls, "numel": e.numel, "nonzero": int(nz), "underflow": int(under),
                    "saturated": int(sat), "underflow_frac": under / nz if nz else 0.0,
                    "saturated_frac": sat / e.numel if e.numel else 0.0, "amax": amax}
        if reset:
            self.reset()
        return out

    @staticmethod
    def table(data: dict[str, dict[str, dict[str, float | int]]], top: int | None = None) -> str:
        """A compact text table of ``read()``'s result: one line per projection and role (``top``:
        only the ``top`` lines with the largest saturated, then underflow, fractions)."""
        if top is not None and (not isinstance(top, int) or top < 1):
            raise ValueError(f"top must be a positive int or None, got {top!r}")
        rows = [(name, role, roles[role]) for name, roles in data.items() for role in ROLES if role in roles]
        if not rows:
            return "fp8 stats: nothing recorded"
        if top is not None:
            rows = sorted(rows, key=lambda r: (r[2]["saturated_frac"], r[2]["underflow_frac"]), reverse=True)[:top]
        width = max(len(name) for name, _, _ in rows)
        lines = [f"{'projection':<{width}}  role     underflow  saturated        amax"]
        for name, role, r in rows:
            lines.append(f"{name:<{width}}  {role:<7} {r['underflow_frac']:>10.2e} {r['saturated_frac']:>10.2e}"
                         f" {r['amax']:>11.4g}")
        return "\n".join(lines)


def fp8_stats(model: nn.Module | None = None) -> Fp8Stats:
    """A new collector of FP8 operand statistics (``Fp8Stats``): ``with coat.fp8_stats(model) as s:
    ...; print(s.table(s.read()))``."""
    return Fp8Stats(model)
