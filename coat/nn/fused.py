"""The fused FP8 block of a decoder layer: [RMSNorm ->] one GEMM over concatenated weights
(fused QKV, fused gate/up, or a single projection) [+ bias].

What it saves for backward:
- with a norm: the norm INPUT in FP8 (1 x 16 groups) and rstd. The normed activation, its FP8
  copy and the GEMM input are recomputed in backward (one elementwise kernel + one quantization),
  so QKV (or gate/up) costs no saved memory of its own.
- without a norm: the GEMM input in FP8 E4M3, transposed, with its per-tensor scale.

Backward: dY is quantized once to E5M2 (with its transpose); dX = dY W and dW = dY^T X run as FP8
GEMMs; the norm backward reads dX in the compute dtype.
"""

from __future__ import annotations

import torch

from .._ops import norm as nops
from . import _fp8mm as mm
from .norm import fp8_norm_ok, hf_rms_norm
from .recipe import ACT_DTYPE, GRAD_DTYPE, Fp8Recipe


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The GEMM output dtype: the autocast dtype when autocast is on, else x's dtype."""
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


class _NormLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, meta, x, norm_w, *params):
        recipe, eps, n_w, cdt = meta
        weights, biases = params[:n_w], params[n_w:]
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        ctx.mode = "none"
        if norm_w is not None and fp8_norm_ok(k):
            y, rstd, xq, xs = nops.rmsnorm_fwd(x2, norm_w.contiguous(), eps, True, ACT_DTYPE, recipe.e8m0)
            yq, _, ys = mm.quantize(y, ACT_DTYPE, False)
            ctx.mode = "fp8norm"
            saved = (xq, xs, rstd)
        elif norm_w is not None:  # width not a multiple of 16: BF16 norm, input kept for recompute
            y = hf_rms_norm(x2, norm_w, eps)
            yq, _, ys = mm.quantize(y.contiguous(), ACT_DTYPE, False)
            ctx.mode = "bf16norm"
            saved = (x2,)
        else:
            yq, yq_t, ys = mm.quantize(x2, ACT_DTYPE, True)
            saved = (yq_t, ys)
        w8 = mm.fp8_weight(tuple(weights), recipe.weight_cache)
        out = mm.fp8_mm(yq, ys, w8.data, w8.scale, cdt, recipe.fast_accum_fwd)
        if biases:
            out = out + (biases[0] if len(biases) == 1 else torch.cat(biases)).to(cdt)
        ctx.save_for_backward(*saved)
        ctx.meta = (recipe, eps, n_w, cdt)
        ctx.norm_w = norm_w
        ctx.params = params
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        recipe, eps, n_w, cdt = ctx.meta
        params, norm_w = ctx.params, ctx.norm_w
        weights, biases = params[:n_w], params[n_w:]
        saved = ctx.saved_tensors
        n = dout.shape[-1]
        d2 = dout.reshape(-1, n).to(cdt).contiguous()
        dq, dq_t, ds = mm.quantize(d2, GRAD_DTYPE, True)
        w8 = mm.fp8_weight(tuple(weights), recipe.weight_cache)
        dy = mm.fp8_mm(dq, ds, w8.data_t, w8.scale, cdt)  # [M, K]

        # The GEMM input for dW, recomputed from what was saved.
        if ctx.mode == "fp8norm":
            xq, xs, rstd = saved
            y = nops.rmsnorm_fwd_fp8(xq, xs, rstd, norm_w.contiguous(), ctx.x_dtype)
            _, y_t, ys = mm.quantize(y, ACT_DTYPE, True)
        elif ctx.mode == "bf16norm":
            (x2,) = saved
            with torch.enable_grad():
                xr = x2.detach().requires_grad_()
                wr = norm_w.detach().requires_grad_()
                y = hf_rms_norm(xr, wr, eps)
            _, y_t, ys = mm.quantize(y.detach().contiguous(), ACT_DTYPE, True)
        else:
            y_t, ys = saved

        grads_w = [None] * n_w
        if any(ctx.needs_input_grad[3 : 3 + n_w]):
            wdt = weights[0].dtype
            dw = mm.fp8_mm(dq_t, ds, y_t, ys, wdt if wdt in (torch.float32, torch.bfloat16, torch.float16) else torch.float32)
            grads_w = list(torch.split(dw, [w.shape[0] for w in weights], 0))
        grads_b = []
        if biases:
            db = d2.float().sum(0)
            grads_b = [g.to(b.dtype) for g, b in zip(torch.split(db, [b.shape[0] for b in biases]), biases)]

        dnorm = None
        if ctx.mode == "fp8norm":
            dx, dnw = nops.rmsnorm_bwd(xq, xs, rstd, norm_w.contiguous(), dy)
            dnorm = dnw.to(norm_w.dtype)
        elif ctx.mode == "bf16norm":
            dx, dnw = torch.autograd.grad(y, (xr, wr), dy.to(y.dtype))
            dnorm = dnw
        else:
            dx = dy
        dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        return (None, dx, dnorm, *grads_w, *grads_b)


def norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor],
    recipe: Fp8Recipe,
) -> torch.Tensor:
    """``[rms_norm(x)] @ cat(weights).T + cat(biases)`` with FP8 GEMMs and the memory plan above.
    ``biases`` is empty or has one entry per weight."""
    if biases and len(biases) != len(weights):
        raise ValueError("biases must be empty or one per weight")
    for w in weights:
        if w.dim() != 2 or w.shape[1] != x.shape[-1]:
            raise ValueError(f"weight of shape {tuple(w.shape)} does not take inputs of width {x.shape[-1]}")
    meta = (recipe, float(eps), len(weights), compute_dtype(x))
    return _NormLinearFn.apply(meta, x, norm_weight, *weights, *biases)
