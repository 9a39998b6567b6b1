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
from torch.autograd.function import once_differentiable

from ..fp8.formats import DTYPES as _FP8
from ._fp8mm import mm_f32

FP8_DTYPES = tuple(_FP8.values())

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


#: The exact linear classes whose weight coat reads as a floating-point matrix: nn.Linear, and
#: coat's own (coat.nn.linear registers Fp8Linear, so this low module imports no layer above it).
_PLAIN_LINEAR_TYPES: list[type] = [nn.Linear]


def register_plain_linear(cls: type) -> None:
    """Accept ``cls`` (exactly, not its subclasses) as a plain linear projection."""
    if cls not in _PLAIN_LINEAR_TYPES:
        _PLAIN_LINEAR_TYPES.append(cls)


def transformers_class(cls: type) -> type:
    """The class ``cls`` was made from: the first class of its MRO that is not one of coat's
    (``coat.convert`` and ``install_fused_loss`` give modules subclasses of their own class, defined
    in coat's modules; ``cls`` itself when it is no such subclass)."""
    return next((c for c in cls.__mro__ if not c.__module__.startswith("coat.")), cls)


def plain_peft_auto_mapping() -> None:
    """Makes ``PeftModel.save_pretrained`` record the original transformers class of a converted model
    in ``adapter_config.json``'s ``auto_mapping`` (written when the LoraConfig has no task_type), as
    it does for the unconverted model: the converted model's own class lives in ``coat.nn.loss``,
    which ``peft.AutoPeftModel*.from_pretrained`` refuses ("not in the import allowlist") and which
    needs coat installed. Wraps ``PeftModel._get_base_model_class`` once (it is only used there);
    for every class that is not coat's it returns what it returned before. Does nothing without
    peft."""
    if _lora_linear_type() is None:
        return
    from peft import PeftModel

    original = PeftModel._get_base_model_class
    if getattr(original, "_coat_plain", False):
        return

    @functools.wraps(original)
    def _get_base_model_class(self, *args, **kwargs):
        return transformers_class(original(self, *args, **kwargs))

    _get_base_model_class._coat_plain = True
    PeftModel._get_base_model_class = _get_base_model_class


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
    if type(base) not in _PLAIN_LINEAR_TYPES:
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
    return getattr(linear, "weight_scale", None) is not None and linear.weight.dtype in FP8_DTYPES


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
    """The plain LoRA adapters of a projection group added IN PLACE to the group's fused FP8 output
    ``out`` [.., sum N_i]: out[:, cols_i] += (x (s_i A_i)^T) B_i^T.

    All adapters of the group share one input GEMM: u = x A_s^T with A_s = [s_1 A_1; s_2 A_2; ..]
    ([sum r_i, K]), then one rank-r GEMM per adapter accumulates into its own columns of ``out``
    (no delta tensor, no concatenation, no separate add). The GEMMs run in ``out``'s dtype (BF16
    in mixed precision) with fp32 accumulation; A and B are rounded to it once per call. PEFT
    computes the adapters of a BF16 model in fp32 (its adapters are fp32 parameters): the
    difference is the BF16 rounding of x A^T and of the adapter weights, far inside the FP8
    tolerance of the base GEMM beside them (tested against PEFT's own modules). Gradients of the
    adapters come out in fp32 from fp32-accumulated GEMMs.

    Saved: x (once for the whole group; PEFT's modules each save their own fp32 copy of it), the
    small [M, sum r_i] product u, and the rounded adapter weights."""

    @staticmethod
    def forward(ctx, x, out, meta, *ab):
        cols, scalings = meta  # per adapter: (first, last) column of out; its scaling
        dt = out.dtype
        k = x.shape[-1]
        x2 = x.reshape(-1, k).to(dt)
        o2 = out.view(-1, out.shape[-1])
        a_s = torch.cat([ab[2 * i] * s for i, s in enumerate(scalings)]).to(dt)
        u = x2 @ a_s.t()
        bs, r0 = [], 0
        for i, (c0, c1) in enumerate(cols):
            b = ab[2 * i + 1].to(dt)
            r = b.shape[1]
            o2[:, c0:c1].addmm_(u[:, r0:r0 + r], b.t())
            bs.append(b)
            r0 += r
        ctx.mark_dirty(out)
        ctx.save_for_backward(x2, u, a_s, *bs)
        ctx.meta = meta
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        cols, scalings = ctx.meta
        x2, u, a_s, *bs = ctx.saved_tensors
        d2 = dout.reshape(-1, dout.shape[-1]).to(u.dtype)
        grads, dus, r0 = [], [], 0
        for i, ((c0, c1), b) in enumerate(zip(cols, bs)):
            r = b.shape[1]
            dd = d2[:, c0:c1]
            dus.append(dd @ b)
            want_b = ctx.needs_input_grad[4 + 2 * i]
            grads.append(mm_f32(dd.t(), u[:, r0:r0 + r]) if want_b else None)  # dB_i = dd_i^T u_i
            r0 += r
        du = dus[0] if len(dus) == 1 else torch.cat(dus, 1)
        d_as = mm_f32(du.t(), x2) if any(ctx.needs_input_grad[3::2]) else None  # d(A_s) = du^T x
        out_grads, r0 = [], 0
        for i, s in enumerate(scalings):
            r = bs[i].shape[1]
            a_grad = d_as[r0:r0 + r] * s if ctx.needs_input_grad[3 + 2 * i] else None
            out_grads += [a_grad, grads[i]]
            r0 += r
        dx = (du @ a_s).to(ctx.x_dtype).reshape(ctx.x_shape) if ctx.needs_input_grad[0] else None
        return (dx, dout, None, *out_grads)


def add_deltas(out: torch.Tensor, mods, names, x: torch.Tensor) -> torch.Tensor:
    """``out`` (the fused FP8 output of ``mods`` as [tokens, sum N_i], columns in their order: the
    ``flat`` output of ``norm_linear``) plus their adapters' outputs on input ``x`` [..., K],
    shaped [..., sum N_i]; projections without an active adapter contribute nothing. Plain
    adapters add into ``out`` in place (``_LoraGroupFn``)."""
    shape = (*x.shape[:-1], out.shape[-1])
    active = [has_delta(m) for m in mods]
    if not any(active):  # the common case (no adapters): nothing else to look at
        return out.view(shape)
    for m, n in zip(mods, names):
        check_adapters(m, n)
    widths = [base_linear(m, n).out_features for m, n in zip(mods, names)]
    plain = [_plain_adapter(m) for m in mods]
    if all(p is not None or not act for p, act in zip(plain, active)):  # the grouped path
        cols, ab, scalings, c0 = [], [], [], 0
        for p, w in zip(plain, widths):
            if p is not None:
                cols.append((c0, c0 + w))
                ab += [p[0], p[1]]
                scalings.append(p[2])
            c0 += w
        return _LoraGroupFn.apply(x, out, (tuple(cols), tuple(scalings)), *ab).view(shape)
    out = out.view(shape)
    deltas = [lora_delta(m, x, n) for m, n in zip(mods, names)]
    if all(d is None for d in deltas):
        return out
    if len(mods) == 1:
        return out + deltas[0].to(out.dtype)
    full = torch.cat([d.to(out.dtype) if d is not None else out.new_zeros(*out.shape[:-1], w)
                      for d, w in zip(deltas, widths)], -1)
    return out + full
