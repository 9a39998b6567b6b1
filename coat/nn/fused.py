"""The fused FP8 block of a decoder layer: [RMSNorm ->] one GEMM over the stacked weights (fused
QKV, fused gate/up, or a single projection) [+ bias].

What it saves for backward:
- with a norm: the norm INPUT in FP8 (1 x 16 groups) and rstd. The normed activation, its FP8
  copy and the GEMM input are recomputed in backward (one elementwise kernel + one quantization),
  so QKV (or gate/up) costs no saved memory of its own.
- without a norm: the GEMM input in FP8 E4M3, transposed, with its per-tensor scale (nothing when
  no weight trains).
- the weights' FP8 scale (4 bytes); the FP8 weights themselves are made in forward and again,
  transposed, in backward (``weights.py``), never kept in between.

Backward: dY is quantized once to E5M2 (with its transpose); dX = dY W and dW = dY^T X run as FP8
GEMMs; the norm backward reads dX in the compute dtype.
"""

from __future__ import annotations

import torch

from .._ops import block as blk
from .._ops import norm as nops
from . import _fp8mm as mm
from . import stats as S
from . import weights as W
from .norm import fp8_norm_ok, hf_rms_norm
from .recipe import ACT_DTYPE, GRAD_DTYPE, Fp8Recipe

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The GEMM output dtype: the autocast dtype when autocast is on, else x's dtype."""
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def wgrad_dtype(w: torch.Tensor) -> torch.dtype:
    return w.dtype if w.dtype in _FLOATS else torch.float32


def _recompute_bf16_norm(x2: torch.Tensor, norm_w: torch.Tensor, eps: float, unit_offset: bool):
    """Hugging Face's RMSNorm of the saved input, with a graph for its backward: (y, x, w)."""
    with torch.enable_grad():
        xr = x2.detach().requires_grad_()
        wr = norm_w.detach().requires_grad_()
        return hf_rms_norm(xr, wr, eps, unit_offset), xr, wr


class _NormLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, meta, x, norm_w, *params):
        recipe, eps, n_w, cdt, cache, frozen_scales, flat, unit_offset = meta
        weights, biases = params[:n_w], params[n_w:]
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        need_wgrad = any(w.requires_grad for w in weights)
        fp8norm = norm_w is not None and fp8_norm_ok(k)
        ctx.mode = "fp8norm" if fp8norm else "bf16norm" if norm_w is not None else "none"
        if (ctx.mode != "bf16norm" and not cache and frozen_scales is None and x2.shape[0]
                and mm.one_call(x2, weights[0], (k, sum(w.shape[0] for w in weights)), cdt)):
            out, w_scale, s = blk.forward(x2, blk.NORM if fp8norm else blk.NONE, norm_w, eps, recipe.e8m0, weights,
                                          need_wgrad, cdt, recipe.fast_accum_fwd, unit_offset=unit_offset)
            W.count("forward")
            saved = s if fp8norm else (None if s[0] is None else s[0].view(ACT_DTYPE), s[1])
        else:
            if fp8norm:
                y, rstd, xq, xs = nops.rmsnorm_fwd(x2, norm_w, eps, True, ACT_DTYPE, recipe.e8m0, unit_offset)
                yq, _, ys = mm.quantize(y, ACT_DTYPE, False)
                saved = (xq, xs, rstd)
            elif norm_w is not None:  # width not a multiple of 16: BF16 norm, input kept for recompute
                y = hf_rms_norm(x2, norm_w, eps, unit_offset).contiguous()
                yq, _, ys = mm.quantize(y, ACT_DTYPE, False)
                saved = (x2,)
            else:  # the GEMM input itself, transposed for dW (not kept when no weight trains)
                y = x2
                yq, yq_t, ys = mm.quantize(x2, ACT_DTYPE, need_wgrad)
                saved = (yq_t, ys)
            w8 = W.forward_weight(weights, cache, frozen_scales)
            if S.active is not None:
                S.active.record(weights, "x", y, ys, ACT_DTYPE)
                if frozen_scales is None:  # FP8-frozen weights are codes already
                    S.active.record(weights, "w", list(weights), w8.scale, ACT_DTYPE)
            del y
            out = mm.fp8_mm(yq, ys, w8.data, w8.scale, cdt, recipe.fast_accum_fwd)
            w_scale = w8.scale
        if biases:
            out = out + (biases[0] if len(biases) == 1 else torch.cat(biases)).to(cdt)
        # Parameters go through save_for_backward: an in-place change before backward is an error.
        ctx.save_for_backward(*saved, w_scale, norm_w, *weights)
        ctx.meta = (recipe, eps, n_w, cdt, cache, len(saved), unit_offset)
        ctx.bias_meta = tuple((b.shape[0], b.dtype) for b in biases)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return out if flat else out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        recipe, eps, n_w, cdt, cache, n_saved, unit_offset = ctx.meta
        tensors = ctx.saved_tensors
        saved, w_scale, norm_w, weights = tensors[:n_saved], tensors[n_saved], tensors[n_saved + 1], tensors[n_saved + 2:]
        n = dout.shape[-1]
        d2 = dout.reshape(-1, n)
        if d2.dtype != cdt:
            d2 = d2.to(cdt)
        if not d2.is_contiguous():
            d2 = d2.contiguous()
        need_w = any(ctx.needs_input_grad[3 : 3 + n_w])
        k, m = ctx.x_shape[-1], d2.shape[0]
        wdt = wgrad_dtype(weights[0])
        if (ctx.mode != "bf16norm" and not cache and weights[0].dtype != ACT_DTYPE and m
                and mm.one_call(d2, weights[0], (n, k, m) if need_w else (n, k), cdt, wdt if need_w else cdt)):
            dx, dnorm, dw = blk.backward(d2, blk.NORM if ctx.mode == "fp8norm" else blk.NONE, need_w, weights,
                                         w_scale, (*saved, None)[:3], norm_w, ctx.x_dtype, wdt, unit_offset=unit_offset)
            W.count("backward")
        else:
            dx, dnorm, dw = _backward_steps(ctx, d2, need_w, saved, w_scale, norm_w, weights, cache, cdt, (eps, unit_offset),
                                            wdt)
        grads_w = [None] * n_w
        if need_w:
            grads_w = list(torch.split(dw, [w.shape[0] for w in weights], 0)) if n_w > 1 else [dw]
        grads_b = []
        if ctx.bias_meta:
            db = d2.float().sum(0)
            grads_b = [g.to(dt) for g, (_, dt) in zip(torch.split(db, [m for m, _ in ctx.bias_meta]), ctx.bias_meta)]
        if dnorm is not None:
            dnorm = dnorm.to(norm_w.dtype)
        dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        return (None, dx, dnorm, *grads_w, *grads_b)


def _backward_steps(ctx, d2, need_w, saved, w_scale, norm_w, weights, cache, cdt, norm_kind, wdt):
    """The block's backward op by op (every case the one-call path does not take): (dx, dnorm, dw).
    ``norm_kind``: (eps, unit_offset) of the norm."""
    eps, unit_offset = norm_kind
    dq, dq_t, ds = mm.quantize(d2, GRAD_DTYPE, need_w)
    if S.active is not None:
        S.active.record(weights, "dy", d2, ds, GRAD_DTYPE)
    w8_t = W.backward_weight(weights, w_scale, cache)
    dy = mm.fp8_mm(dq, ds, w8_t, w_scale, cdt)  # [M, K]
    del w8_t, dq
    dw = None
    if need_w:
        # The GEMM input for dW, recomputed from what was saved.
        if ctx.mode == "fp8norm":
            xq, xs, rstd = saved
            y = nops.rmsnorm_fwd_fp8(xq, xs, rstd, norm_w, ctx.x_dtype, unit_offset)
        elif ctx.mode == "bf16norm":
            norm_graph = _recompute_bf16_norm(saved[0], norm_w, eps, unit_offset)
            y = norm_graph[0].detach().contiguous()
        if ctx.mode != "none":
            _, y_t, ys = mm.quantize(y, ACT_DTYPE, True)
            if S.active is not None:
                S.active.record(weights, "x_wgrad", y, ys, ACT_DTYPE)
            del y
        else:
            y_t, ys = saved
        dw = mm.fp8_mm(dq_t, ds, y_t, ys, wdt)
        del y_t
    if ctx.mode == "fp8norm":
        xq, xs, rstd = saved
        return (*nops.rmsnorm_bwd(xq, xs, rstd, norm_w, dy, unit_offset), dw)
    if ctx.mode == "bf16norm":  # the recompute of the dW input, or a fresh one when no weight trains
        y, xr, wr = norm_graph if need_w else _recompute_bf16_norm(saved[0], norm_w, eps, unit_offset)
        return (*torch.autograd.grad(y, (xr, wr), dy.to(y.dtype)), dw)
    return dy, None, dw


def norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor],
    recipe: Fp8Recipe,
    frozen_scales: list[torch.Tensor] | None = None,
    flat: bool = False,
    unit_offset: bool = False,
) -> torch.Tensor:
    """``[rms_norm(x)] @ cat(weights).T + cat(biases)`` with FP8 GEMMs and the memory plan above.
    ``unit_offset``: the norm is Gemma's, ``T(h * (1 + w))`` (``norm.hf_rms_norm``).
    ``biases`` is empty or has one entry per weight. ``frozen_scales``: the weights are FP8-frozen
    codes (``frozen.py``) with these scales. ``flat``: return the [tokens, N] output itself, not a
    view of it shaped like x (LoRA adapters then add into it in place)."""
    if biases and len(biases) != len(weights):
        raise ValueError("biases must be empty or one per weight")
    for w in weights:
        if w.dim() != 2 or w.shape[1] != x.shape[-1]:
            raise ValueError(f"weight of shape {tuple(w.shape)} does not take inputs of width {x.shape[-1]}")
        if w.dtype != weights[0].dtype:
            raise ValueError(f"fused weights must share one dtype, got {weights[0].dtype} and {w.dtype}")
    cache = frozen_scales is None and W.use_cache(recipe.weight_cache, weights)
    meta = (recipe, float(eps), len(weights), compute_dtype(x), cache, frozen_scales, flat, bool(unit_offset))
    return _NormLinearFn.apply(meta, x, norm_weight, *weights, *biases)
