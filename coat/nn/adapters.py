"""Projections as coat's FP8 blocks see them: a plain ``nn.Linear``, or a PEFT LoRA layer around
one. The base weight always goes through coat's FP8 path (fused with its siblings: q/k/v,
gate/up); each active LoRA adapter adds ``lora_B(lora_A(dropout(x))) * scaling`` beside it in the
adapter's own dtype (BF16), exactly as ``peft.tuners.lora.Linear.forward`` computes it.

Anything else in a projection's place is refused with an error naming it, at ``coat.convert`` and
again at forward (a wrapper added after conversion): a layer whose weight coat would silently
read past (a quantized ``bnb`` layer, another PEFT tuner, DoRA) must never train as if it were
plain. PEFT itself is optional: without it only plain ``nn.Linear`` projections exist.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _lora_linear_type():
    # Looked up once: every converted forward asks, and a failed import is not cached by Python
    # (it searches sys.path again each time).
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # peft not installed: no LoRA layers can exist
        return None
    return Linear


@functools.cache
def _plain_linear_types() -> tuple:
    from .linear import Fp8Linear  # linear.py imports this module's users: resolved lazily, once

    return (nn.Linear, Fp8Linear)


def is_lora(mod: nn.Module) -> bool:
    t = _lora_linear_type()
    return t is not None and type(mod) is t


def _describe(mod: nn.Module) -> str:
    return f"{type(mod).__module__}.{type(mod).__qualname__}"


def base_linear(mod: nn.Module, name: str) -> nn.Linear:
    """The ``nn.Linear`` whose weight coat multiplies in FP8; raises for anything coat cannot run."""
    base = mod.base_layer if is_lora(mod) else mod
    # Exact types: subclasses of nn.Linear (bitsandbytes' Linear4bit/8bitLt, ...) keep weights coat
    # cannot read as a floating-point matrix.
    if type(base) not in _plain_linear_types():
        raise ValueError(
            f"coat.convert: {name} is a {_describe(mod)}"
            + (f" around a {_describe(base)}" if base is not mod else "")
            + "; coat's FP8 layers run plain torch.nn.Linear projections and PEFT LoRA layers around them"
        )
    if base.weight.dtype not in _FLOATS and not is_frozen_fp8(base):
        raise ValueError(f"coat.convert: {name}.weight is {base.weight.dtype}; coat needs float32, bfloat16 or float16")
    return base


def is_frozen_fp8(linear: nn.Module) -> bool:
    """Whether ``linear`` holds its (frozen) weight only as FP8 codes (see ``frozen.py``)."""
    return getattr(linear, "weight_scale", None) is not None and linear.weight.dtype == torch.float8_e4m3fn


def frozen_scales(bases) -> Optional[list]:
    """The FP8 scales of a projection group stored FP8-frozen, or None for floating-point weights."""
    if not is_frozen_fp8(bases[0]):
        return None
    return [b.weight_scale for b in bases]


def check_adapters(mod: nn.Module, name: str) -> None:
    """Refuses LoRA variants coat does not compute (DoRA and the other ``lora_variant`` kinds)."""
    if not is_lora(mod):
        return
    variants = getattr(mod, "lora_variant", {}) or {}
    dora = getattr(mod, "use_dora", {}) or {}
    for a in mod.lora_A.keys():
        if a in variants or dora.get(a, False):
            kind = type(variants[a]).__name__ if a in variants else "DoRA"
            raise ValueError(
                f"coat.convert: {name} has the LoRA adapter {a!r} of variant {kind}; coat computes plain LoRA "
                "beside its FP8 base GEMM only (use a LoraConfig without use_dora, or do not convert this model)"
            )


def has_delta(mod: nn.Module) -> bool:
    """Whether ``mod`` adds an adapter output now (an active, enabled, unmerged LoRA adapter)."""
    if not is_lora(mod) or mod.disable_adapters or mod.merged:
        return False
    return any(a in mod.lora_A.keys() for a in mod.active_adapters)


def lora_delta(mod: nn.Module, x: torch.Tensor, name: str) -> Optional[torch.Tensor]:
    """The sum over active adapters of ``lora_B(lora_A(dropout(x))) * scaling``, or None."""
    if not has_delta(mod):
        return None
    check_adapters(mod, name)
    out = None
    for a in mod.active_adapters:
        if a not in mod.lora_A.keys():
            continue
        lora_a = mod.lora_A[a]
        xa = mod._cast_input_dtype(x, lora_a.weight.dtype)
        d = mod.lora_B[a](lora_a(mod.lora_dropout[a](xa))) * mod.scaling[a]
        out = d if out is None else out + d
    return out


def any_delta(mods) -> bool:
    return any(has_delta(m) for m in mods)


def _plain_adapter(mod: nn.Module):
    """(A weight, B weight, scaling) of ``mod``'s single active adapter when it is plain LoRA with
    no dropout and no bias on B (the common configuration), else None."""
    if not has_delta(mod):
        return None
    active = [a for a in mod.active_adapters if a in mod.lora_A.keys()]
    if len(active) != 1:
        return None
    a = active[0]
    lora_a, lora_b = mod.lora_A[a], mod.lora_B[a]
    if not isinstance(mod.lora_dropout[a], nn.Identity) or lora_a.bias is not None or lora_b.bias is not None:
        return None
    if not getattr(mod, "cast_input_dtype_enabled", True):
        return None
    return lora_a.weight, lora_b.weight, float(mod.scaling[a])


class _LoraGroupFn(torch.autograd.Function):
    """The adapters of a projection group on one input: delta_i = (x A_i^T) B_i^T s_i, computed in
    the adapters' dtype as PEFT does, returned as one [.., sum N_i] tensor (zeros where a projection
    has no adapter). Saves x once for the whole group (PEFT's modules each save their own copy of x
    cast to the adapter dtype: three fp32 copies for q/k/v) and the small [M, r] products."""

    @staticmethod
    def forward(ctx, x, meta, *ab):
        widths, scalings, present = meta
        x2 = x.reshape(-1, x.shape[-1])
        outs, us, k = [], [], 0
        for w, s, has in zip(widths, scalings, present):
            if not has:
                outs.append(None)
                continue
            a, b = ab[2 * k], ab[2 * k + 1]
            k += 1
            u = x2.to(a.dtype) @ a.t()
            outs.append((u @ b.t()) * s)
            us.append(u)
        dt = next(o.dtype for o in outs if o is not None)
        full = torch.cat([o if o is not None else x2.new_zeros(x2.shape[0], w, dtype=dt)
                          for o, w in zip(outs, widths)], -1)
        ctx.save_for_backward(x, *us, *ab)
        ctx.meta = meta
        return full.reshape(*x.shape[:-1], full.shape[-1])

    @staticmethod
    def backward(ctx, dfull):
        widths, scalings, present = ctx.meta
        n = sum(present)
        x, us, ab = ctx.saved_tensors[0], ctx.saved_tensors[1:1 + n], ctx.saved_tensors[1 + n:]
        x2 = x.reshape(-1, x.shape[-1])
        d2 = dfull.reshape(-1, dfull.shape[-1])
        dx = None
        grads = []
        col, k = 0, 0
        for w, s, has in zip(widths, scalings, present):
            if has:
                a, b = ab[2 * k], ab[2 * k + 1]
                u = us[k]
                k += 1
                dd = d2[:, col:col + w].to(b.dtype) * s
                db = dd.t() @ u
                du = dd @ b
                xa = x2.to(a.dtype)
                da = du.t() @ xa
                dxi = du @ a
                dx = dxi if dx is None else dx + dxi
                grads += [da if ctx.needs_input_grad[2 + 2 * (k - 1)] else None,
                          db if ctx.needs_input_grad[3 + 2 * (k - 1)] else None]
            col += w
        if dx is not None and ctx.needs_input_grad[0]:
            dx = dx.to(x.dtype).reshape(x.shape)
        else:
            dx = None
        return (dx, None, *grads)


def add_deltas(out: torch.Tensor, mods, names, x: torch.Tensor) -> torch.Tensor:
    """``out`` (the fused FP8 output of ``mods``, columns in their order) plus their adapters'
    outputs on input ``x``; projections without an active adapter contribute nothing."""
    active = [has_delta(m) for m in mods]
    if not any(active):  # the common case (no adapters): nothing else to look at
        return out
    for m, n in zip(mods, names):
        check_adapters(m, n)
    widths = [base_linear(m, n).out_features for m, n in zip(mods, names)]
    plain = [_plain_adapter(m) for m in mods]
    if all(p is not None or not act for p, act in zip(plain, active)):  # the grouped path
        present = tuple(p is not None for p in plain)
        ab = [t for p in plain if p is not None for t in p[:2]]
        scalings = tuple(p[2] if p is not None else 0.0 for p in plain)
        delta = _LoraGroupFn.apply(x, (tuple(widths), scalings, present), *ab)
        return out + delta.to(out.dtype)
    deltas = [lora_delta(m, x, n) for m, n in zip(mods, names)]
    if all(d is None for d in deltas):
        return out
    if len(mods) == 1:
        return out + deltas[0].to(out.dtype)
    full = torch.cat([d.to(out.dtype) if d is not None else out.new_zeros(*out.shape[:-1], w)
                      for d, w in zip(deltas, widths)], -1)
    return out + full
