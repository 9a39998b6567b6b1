"""The FP8 block layer: one autograd Function over the block op (``coat._ops.block``, one core
call per direction on CPU and CUDA alike) for the three kinds of layer block:

- norm + GEMM: RMSNorm -> one GEMM over the stacked weights (fused QKV, fused gate/up);
- SwiGLU + GEMM: act(gate) * up -> down projection;
- plain GEMM: a projection of x itself (o_proj, ``Fp8Linear``).

The block's weight comes from a source (``weights.py``: live, cached, FP8-frozen) and its
quantizers from the recipe (``Fp8Recipe``: the formats of activations and weights and of
gradients, the saved inputs' group scale kind, the forward GEMM's accumulation).

What a block saves for backward:
- with a norm: the norm INPUT in FP8 (1 x 16 groups) and rstd. The normed activation, its FP8
  copy and the GEMM input are recomputed in backward, so QKV (or gate/up) costs no saved memory
  of its own.
- with SwiGLU: the gate/up input in FP8 (1 x 16 groups); act(gate) * up is recomputed in the
  kernel that computes dgate and dup, and feeds the weight gradient.
- plain: the GEMM input in FP8 E4M3, transposed, with its per-tensor scale (nothing when no
  weight trains).
- the weight's FP8 scale (4 bytes); the FP8 weight itself is made in forward and again,
  transposed, in backward, never kept in between (unless the source is a cache).

Widths that are not a multiple of 16 (the FP8 group) have no FP8 norm or SwiGLU kernel: there
the pre-op runs in torch with Hugging Face's arithmetic before a plain block, its input is saved
in its own dtype, and backward recomputes it, hands its output to the block op for the weight
gradient and differentiates it with autograd.

An ``Fp8Stats`` collector that records gets the GEMM operands from the block op's outputs (the op
returns the inputs it makes when asked): the same results, the same one call.
"""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .._ops import block as blk
from .._ops import swiglu as sops
from . import stats as S
from . import weights as W
from .norm import fp8_norm_ok, hf_rms_norm
from .recipe import Fp8Recipe

NONE, NORM, SWIGLU = blk.NONE, blk.NORM, blk.SWIGLU
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

#: The gated activations (``coat.models.family.ACTIVATIONS``' values) -> the kernels' ids.
ACT_IDS = {"silu": sops.SILU, "gelu_tanh": sops.GELU_TANH}


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The GEMM output dtype: the autocast dtype when autocast is on, else x's dtype."""
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def wgrad_dtype(w: torch.Tensor) -> torch.dtype:
    return w.dtype if w.dtype in _FLOATS else torch.float32


def fp8_swiglu_ok(inter: int) -> bool:
    return inter > 0 and inter % sops.GROUP == 0


def gated(gu: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up in gu's dtype, as Hugging Face's MLPs compute it (the reference and the fallback)."""
    g, u = gu.chunk(2, -1)
    return (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u


class Spec(NamedTuple):
    """What a block call is, beside its tensors."""

    pre: int  # NONE, NORM or SWIGLU
    recipe: Fp8Recipe
    eps: float  # the norm's
    unit_offset: bool  # the norm's weight applies as 1 + w (Gemma)
    act: str  # the gate's activation ("silu", "gelu_tanh")
    n_w: int  # weights (their biases follow them)
    cdt: torch.dtype  # the GEMM output dtype
    source: str  # the weight's source (weights.LIVE, CACHED, FROZEN, GATHERED)
    frozen_scales: Optional[tuple]  # with the FROZEN source
    flat: bool  # return the [tokens, N] output itself
    train: bool = False  # a training forward (grad on, a weight trains): it may take the optimizer's weight amax


def _fp8_pre(spec: Spec, width: int) -> bool:
    """Whether the pre-op runs in the block op's FP8 kernel (else in torch, ``_torch_pre``)."""
    if spec.pre == NORM:
        return fp8_norm_ok(width)
    return spec.pre == SWIGLU and fp8_swiglu_ok(width // 2)


def _torch_pre(spec: Spec, x2: torch.Tensor, norm_w: Optional[torch.Tensor]) -> torch.Tensor:
    if spec.pre == NORM:
        return hf_rms_norm(x2, norm_w, spec.eps, spec.unit_offset)
    return gated(x2, spec.act)


def _want_stats() -> bool:
    return S.active is not None and not torch.compiler.is_compiling()


# Group scaling across blocks: a SwiGLU backward writes the amax of the gradient it returns (dgu),
# which the gate/up block's backward quantizes next. It is handed over per thread (autograd runs
# each device's backward on its own thread) as (weak reference to the returned gradient, its
# version, amax) and taken only by a backward that receives that very tensor unchanged: a hook that
# returned another tensor, an in-place edit, a sum with another gradient or a cast all fall back
# to an amax pass.
_handoff = threading.local()


# A traced backward neither gives nor takes (its tensors are not the run's) and leaves the thread-local
# alone: torch 2.11's dynamo refuses a mutation of outside state inside an autograd.Function, and a
# stale item left behind is refused by the identity check of the next eager take.
def _give_amax(dx: torch.Tensor, amax: Optional[torch.Tensor]) -> None:
    if not torch.compiler.is_compiling():
        _handoff.item = None if amax is None else (weakref.ref(dx), dx._version, amax)


def _take_amax(dout: torch.Tensor) -> Optional[torch.Tensor]:
    if torch.compiler.is_compiling():
        return None
    item, _handoff.item = getattr(_handoff, "item", None), None
    if item is None:
        return None
    ref, version, amax = item
    return amax if ref() is dout and dout._version == version else None


class _BlockFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, meta: tuple, x, norm_w, *params):
        spec = Spec(*meta)
        weights, biases = params[:spec.n_w], params[spec.n_w:]
        x2 = x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        fp8_pre = _fp8_pre(spec, x2.shape[1])
        pre = spec.pre if fp8_pre else NONE
        gemm_in = x2 if fp8_pre or spec.pre == NONE else _torch_pre(spec, x2, norm_w).contiguous()
        codes = W.forward_codes(spec.source, weights, spec.frozen_scales, spec.recipe.act_dtype)
        w_amax = W.optimizer_amax(spec.source, weights, spec.recipe.granularity) if spec.train else None
        stats = _want_stats()
        # A recomputed torch pre-op hands its output to the backward: nothing is saved for dW.
        save_t = spec.pre == NONE and any(w.requires_grad for w in weights)
        f = blk.forward(gemm_in, pre, norm_w if pre == NORM else None, spec.eps, spec.recipe.e8m0,
                        weights if codes is None else [], *(codes or (None, None)), save_t, spec.cdt,
                        spec.recipe.fast_accum_fwd, spec.unit_offset, ACT_IDS[spec.act], stats, spec.recipe.act_dtype,
                        blk.GRANULARITY_IDS[spec.recipe.granularity], w_amax)
        w_scale = f.w_scale if codes is None else codes[1]
        if stats:
            fmt, gran = spec.recipe.act_dtype, spec.recipe.granularity
            x_in = gemm_in if pre == NONE else f.stat_in
            if gran == "tensor":
                S.active.record(weights, "x", x_in, f.saved[1] if pre == NONE else f.stat_scale, fmt)
                if spec.source not in (W.FROZEN, W.GATHERED):  # FP8-frozen or -gathered weights are codes already
                    S.active.record(weights, "w", list(weights), w_scale, fmt)
            else:  # the operands quantized anew at the recipe's scale modes
                act_mode, w_mode = blk.MODES[gran]
                S.active.record(weights, "x", x_in, None, fmt, mode=act_mode)
                if save_t:  # the saved input's own codes for dW (its transpose, scaled along the tokens)
                    S.active.record(weights, "x_wgrad", x_in, None, fmt, mode=act_mode, transposed=True)
                S.active.record(weights, "w", list(weights), None, fmt, mode=w_mode)
        del gemm_in
        out = f.out
        if biases:
            out = out + (biases[0] if len(biases) == 1 else torch.cat(biases)).to(spec.cdt)
        saved = f.saved if fp8_pre or spec.pre == NONE else (x2, None, None)
        # Parameters go through save_for_backward: an in-place change before backward is an error.
        ctx.save_for_backward(*saved, w_scale, norm_w, *weights)
        ctx.spec, ctx.fp8_pre = spec, fp8_pre
        ctx.bias_meta = tuple((b.shape[0], b.dtype) for b in biases)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return out if spec.flat else out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        spec = ctx.spec
        tensors = ctx.saved_tensors  # read once: checkpointing unpacks each saved tensor only once
        saved, (w_scale, norm_w), weights = tensors[:3], tensors[3:5], tensors[5:]
        d_amax = _take_amax(dout)
        d2 = dout.reshape(-1, dout.shape[-1])
        if d2.dtype != spec.cdt:
            d2, d_amax = d2.to(spec.cdt), None
        if not d2.is_contiguous():
            d2 = d2.contiguous()
        need_w = any(ctx.needs_input_grad[3:3 + spec.n_w])
        if ctx.fp8_pre or spec.pre == NONE:
            dx, dnorm, dw, dx_amax = _backward(ctx, d2, need_w, saved, w_scale, norm_w, weights, d_amax)
        else:
            dx, dnorm, dw = _backward_torch_pre(ctx, d2, need_w, saved[0], w_scale, norm_w, weights, d_amax)
            dx_amax = None
        grads_w = [None] * spec.n_w
        if need_w:
            grads_w = list(torch.split(dw, [w.shape[0] for w in weights], 0)) if spec.n_w > 1 else [dw]
        grads_b = []
        if ctx.bias_meta:
            db = d2.float().sum(0)
            grads_b = [g.to(dt) for g, (_, dt) in zip(torch.split(db, [m for m, _ in ctx.bias_meta]), ctx.bias_meta)]
        if dnorm is not None:
            dnorm = dnorm.to(norm_w.dtype)
        same = dx.dtype == ctx.x_dtype
        dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        _give_amax(dx, dx_amax if same else None)
        return (None, dx, dnorm, *grads_w, *grads_b)


def _block_backward(ctx, d2, pre, need_w, saved, w_scale, norm_w, weights, wgrad_input=None, d_amax=None) -> blk.Bwd:
    """The block op's backward (the weight from the forward's source), recording for ``Fp8Stats``."""
    spec = ctx.spec
    codes_t = W.backward_codes(spec.source, weights, w_scale, spec.recipe.act_dtype)
    stats = _want_stats()
    r = spec.recipe
    b = blk.backward(d2, pre, need_w, weights if codes_t is None else [], w_scale, codes_t, saved, norm_w,
                     wgrad_input, ctx.x_dtype, wgrad_dtype(weights[0]), spec.unit_offset, ACT_IDS[spec.act], stats,
                     r.act_dtype, r.grad_dtype, blk.GRANULARITY_IDS[r.granularity], d_amax)
    if stats and r.granularity == "tensor":
        S.active.record(weights, "dy", d2, b.d_scale, r.grad_dtype)
        if b.stat_scale is not None:  # the weight gradient's input, recomputed and quantized anew
            S.active.record(weights, "x_wgrad", wgrad_input if b.stat_in is None else b.stat_in, b.stat_scale,
                            r.act_dtype)
    elif stats:  # row/block: dY as dX's operand; the recomputed input as dW's (its transpose)
        act_mode = blk.MODES[r.granularity][0]
        S.active.record(weights, "dy", d2, None, r.grad_dtype, mode=act_mode)
        x_w = wgrad_input if b.stat_in is None else b.stat_in
        if need_w and x_w is not None:
            S.active.record(weights, "x_wgrad", x_w, None, r.act_dtype, mode=act_mode, transposed=True)
    return b


def _backward(ctx, d2, need_w, saved, w_scale, norm_w, weights, d_amax):
    """(dx, dnorm, dw, dx_amax) of a block whose pre-op (if any) ran in the block op."""
    pre = ctx.spec.pre
    b = _block_backward(ctx, d2, pre, need_w, tuple(saved), w_scale, norm_w if pre == NORM else None, weights,
                        d_amax=d_amax)
    return b.dx, b.dnorm, b.dw, b.dx_amax


def _backward_torch_pre(ctx, d2, need_w, x2, w_scale, norm_w, weights, d_amax):
    """(dx, dnorm, dw) of a block whose pre-op ran in torch: recomputed here with a graph, its
    output the weight gradient's input, differentiated by autograd."""
    spec = ctx.spec
    with torch.enable_grad():
        xr = x2.detach().requires_grad_()
        wr = norm_w.detach().requires_grad_() if spec.pre == NORM else None
        y = _torch_pre(spec, xr, wr)
    yin = y.detach().contiguous() if need_w else None
    b = _block_backward(ctx, d2, NONE, need_w, (None, None, None), w_scale, None, weights, yin, d_amax)
    del yin
    inputs = (xr, wr) if wr is not None else (xr,)
    grads = torch.autograd.grad(y, inputs, b.dx.to(y.dtype))
    return grads[0], grads[1] if wr is not None else None, b.dw


def block(x: torch.Tensor, spec: Spec, norm_weight: Optional[torch.Tensor], weights, biases) -> torch.Tensor:
    """The block ``spec`` describes over x ([..., K], or [..., 2I] gate/up with SwiGLU)."""
    # A plain tuple crosses apply(): Dynamo does not take a NamedTuple holding tensors (frozen scales) apart.
    return _BlockFn.apply(tuple(spec), x, norm_weight, *weights, *biases)


def make_spec(pre: int, recipe: Fp8Recipe, x: torch.Tensor, weights, *, eps: float = 0.0, unit_offset: bool = False,
              act: str = "silu", frozen_scales=None, flat: bool = False) -> Spec:
    """The Spec of a call over x with these weights: its compute dtype and weight source decided
    here, where grad mode is the caller's (an autograd Function's forward runs without it)."""
    if act not in ACT_IDS:
        raise ValueError(f"act must be one of {tuple(ACT_IDS)}, got {act!r}")
    cache = frozen_scales is None and W.use_cache(recipe.weight_cache, weights)
    src = W.source(cache, frozen_scales, weights)
    if src == W.GATHERED and recipe.granularity != "tensor":
        raise ValueError(f"FP8 all-gather gives per-tensor weight codes, but the recipe scales {recipe.granularity}-"
                         "wise: shard with fp8_all_gather=False for row or block granularity")
    # Evaluation forwards (no grad, inference mode) run the amax pass: weights swapped in through
    # p.data for evaluation (EMA weights) move no version counter (coat.nn.weight_amax).
    # (Compiled forwards never take it: Dynamo cannot trace is_inference_mode_enabled.)
    train = (src == W.LIVE and not torch.compiler.is_compiling() and torch.is_grad_enabled()
             and not torch.is_inference_mode_enabled() and any(w.requires_grad for w in weights))
    return Spec(pre, recipe, float(eps), bool(unit_offset), act, len(weights), compute_dtype(x),
                src, None if frozen_scales is None else tuple(frozen_scales), flat, train)
