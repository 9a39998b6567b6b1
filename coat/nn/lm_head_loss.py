"""Fused final RMSNorm + LM head + cross-entropy, chunked over the tokens so the [tokens, vocab]
logits never exist whole (neither in the compute dtype nor in fp32), with the gradients computed
in the forward: three [tokens x vocab x hidden] GEMMs in all, as Hugging Face's path does.

Forward, when a gradient is wanted: y = RMSNorm(x) (Hugging Face's arithmetic), cast to the
compute dtype (BF16 under autocast or for a BF16 model, as Hugging Face's ``lm_head`` computes),
and the denominator (the count of non-ignored positions, or ``num_items_in_batch``) is known
before the loop, as a device tensor (no host synchronization): ``inv = 1 / denominator``. Then
per chunk of token rows:

1. ``logits = y[chunk] @ W^T`` in the compute dtype (GEMM 1);
2. ``_ce_grad_`` turns the chunk into the per-row fp32 log-sum-exp and target logit, and
   overwrites the logits in place with their gradient ``inv * (softmax - onehot)`` (zero rows for
   ignored positions), in the compute dtype;
3. ``dY[chunk] = dlogits @ W`` (GEMM 2): each row is complete after one GEMM, so dY is kept in
   the compute dtype, like Hugging Face's;
4. ``dW += dlogits^T @ y[chunk]`` (GEMM 3). With one chunk, dW is that one GEMM in the weight's
   dtype (one rounding, as Hugging Face's). With several, it accumulates in an fp32 [vocab,
   hidden] buffer (on CUDA a bf16 x bf16 -> fp32 GEMM where torch has ``addmm(out_dtype=)``; the
   CPU and older torch multiply fp32 copies, a vocabulary slice at a time), cast once at the end:
   no rounding to BF16 per chunk.

After the loop the final norm's backward runs on dY (recomputed with autograd on the saved
input), and the finished gradients dx, d(norm weight) and dW (already divided by the denominator)
are kept for backward, which only scales them by the incoming gradient, in place. Without any
gradient wanted (``torch.no_grad``, evaluation, every input frozen) the forward computes the loss
alone: one GEMM per chunk, no gradient buffers. Inputs that are frozen get no gradient work (a
frozen LM head: no dW GEMM; a frozen trunk and norm: no dY GEMM).

Memory, beyond the inputs: the gradients (dW: the weight's size, dx: the input's) live from the
forward to the backward, as the logits' gradient path would have made them. During the forward:
dY ([tokens, hidden] in the compute dtype), one chunk of compute-dtype logits (``chunk_mib``),
and with several chunks the fp32 dW accumulator, 4 bytes x vocab x hidden (2 GiB for Llama-3-8B,
1 GiB with the BF16 dW beside it while it is cast at the end; for fp32 weights under autocast
the accumulator is dW itself). The torch implementation of ``_ce_grad_`` adds an fp32 working
copy of the chunk (twice its bytes in BF16), and the CPU's fp32 dW path up to one chunk's bytes
more. Under autocast the compute-dtype copy of the LM head weight exists during the forward (as
in Hugging Face's autocast). Nothing is saved through autograd's saved tensors: never the
logits, never the hidden states; a second backward through the same graph (``retain_graph``)
is refused, since the gradients are handed over once.

Precision: the LM head GEMMs run in the compute dtype (BF16 in mixed precision) by default; the
log-sum-exp, the target logit and softmax minus one-hot in fp32 per chunk, cast once to the
compute dtype. The forward GEMM stays BF16: per-tensor E4M3 operands there move the loss past its
0.1 % budget. FP8 gradient GEMMs (E5M2 dlogits with one scale per chunk, E4M3 y per chunk and W
per tensor) leave the loss untouched and keep dW and dX within the error of the FP8 decoder
layers' gradients: ``fp8_backward=True`` turns them on (off by default until training runs show
the head takes it). The accuracy of each choice against fp64: docs/numerics.md.

Semantics are Hugging Face's ``ForCausalLMLoss``: labels are shifted left by one (the last
position has no target) unless ``shift_labels`` is given, ``ignore_index`` positions contribute
nothing, the loss is the mean over the other positions (NaN when there are none, gradients zero),
or their sum divided by ``num_items_in_batch`` when the Trainer passes it.

``install_fused_loss`` (coat/nn/loss.py) puts this loss into Hugging Face models.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .._ops import loss as lops
from .._ops import quantize as qops
from .._ops._util import fmt_id
from . import _fp8mm as mm
from .fused import compute_dtype, wgrad_dtype
from .norm import hf_rms_norm
from .recipe import Fp8Recipe, resolve

__all__ = ["DEFAULT_CHUNK_MIB", "fused_lm_head_loss"]

#: Default bound on one chunk of compute-dtype logits (the tensor the chunk's three GEMMs read or
#: write; it is overwritten in place with its gradient). 512 MiB is 2048 token rows at Llama-3's
#: vocabulary of 128,256 in BF16 (8192 rows at 32,000): the dW GEMM of a chunk has K = rows, and
#: with several chunks it reads and writes the fp32 accumulator (8 bytes per output element), so
#: it does rows / 4 FLOP per byte of accumulator traffic, above the ~250 FLOP/byte at which an
#: H100/H200 stops being bandwidth-bound only from ~1000 rows; 2048 leaves a factor of two, and
#: 16k tokens take 8 chunks. Smaller chunks trade speed for transient memory.
DEFAULT_CHUNK_MIB = 512
_ROW_ALIGN = 64  # token rows of a chunk: multiples of this (GEMM-friendly K for the dW GEMM)


def _chunk_rows(total: int, row_bytes: int, chunk_bytes: int, align: int) -> int:
    """How many rows of ``row_bytes`` fit ``chunk_bytes`` (at least one), rounded down to a
    multiple of ``align`` when that many fit."""
    rows = chunk_bytes // max(row_bytes, 1)
    if rows >= align:
        rows = rows // align * align
    return max(1, min(rows, total))


def _no_autocast(device: torch.device):
    # The dtypes below are chosen explicitly (compute dtype decided by the caller); an ambient
    # autocast would re-cast the GEMMs and the fp32 reductions.
    return torch.autocast(device.type, enabled=False)


def _check_labels_in_range(labels: torch.Tensor, valid: torch.Tensor, vocab: int, ignore_index: int) -> None:
    bad = valid & ((labels < 0) | (labels >= vocab))
    msg = f"labels must lie in [0, {vocab}) or equal ignore_index ({ignore_index})"
    if labels.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(bad.any()):
            raise ValueError(msg)
    else:
        # On an accelerator: no host synchronization, it fails at the next sync point. Under
        # torch.compile (CPU too): a Python branch on a tensor's value would break the graph here,
        # the asynchronous assert is traced into it.
        torch._assert_async(~bad.any(), msg)


# ---- the per-chunk cross-entropy ----------------------------------------------------------------


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _ce_grad_(logits: torch.Tensor, safe_labels: torch.Tensor, valid: torch.Tensor,
              inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of one chunk and its gradient, in place:

    - ``logits``: [R, V], contiguous, bfloat16 / float16 / float32 (the compute dtype; float64
      on the CPU path, worked in fp64); read,
      then OVERWRITTEN with ``g[r, j] = inv * (softmax(logits[r])[j] - (j == safe_labels[r]))``
      where ``valid[r]``, and ``0`` in every column where not; the gradient is formed in fp32 and
      rounded once to ``logits.dtype`` (round to nearest even).
    - ``safe_labels``: [R] int64 in ``[0, V)`` (ignored rows carry 0: the caller replaced
      ``ignore_index``). ``valid``: [R] bool, False for ignored rows. ``inv``: 0-dim float32 on the
      same device, ``1 / denominator`` (inf when the denominator is 0; ignored rows stay 0).
    - returns ``(lse, target)``, both [R] float32: ``lse[r] = m + log(sum_j exp(logits[r, j] - m))``
      with ``m`` the row's max, computed from the logits as given (upcast to fp32), and
      ``target[r] = logits[r, safe_labels[r]]`` upcast (0 for ignored rows: the caller masks them).
    No host synchronization; R may be 1 and V any size (no alignment assumed).

    fp32/bf16/fp16 run the core's ``cross_entropy_rows`` (``csrc/include/coat/loss.h``: one CUDA
    kernel that reads the chunk twice and writes it once, or its CPU reference); float64 runs the
    same arithmetic in torch ops."""
    if logits.dtype in _KERNEL_DTYPES:  # the core's kernel (CUDA) or its CPU reference
        return lops.cross_entropy_rows_(logits, torch.where(valid, safe_labels, -1), inv.to(torch.float32))
    # float64 (CPU models only): the same arithmetic in torch.
    idx = safe_labels[:, None]
    target = logits.gather(1, idx).squeeze(1).float()
    m = logits.amax(1, keepdim=True)
    # One fp32 working copy (fp64 logits: in place): shifted by the row max (exact in the logits'
    # dtype), exponentiated, scaled to inv * softmax, the one-hot subtracted, rounded once into the
    # chunk.
    work = torch.promote_types(logits.dtype, torch.float32)
    p = logits.sub_(m) if logits.dtype == work else logits - m.to(work)
    p.exp_()
    s = p.sum(1)
    lse = (m.squeeze(1).to(work) + s.log()).float()
    p.mul_(torch.where(valid, inv / s, 0.0)[:, None])
    p.scatter_add_(1, idx, torch.where(valid, -inv, 0.0).to(work)[:, None])
    if p is not logits:
        logits.copy_(p)
    return lse, target


def _lse_target(logits: torch.Tensor, safe_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss-only half of ``_ce_grad_`` (no gradient wanted): the same ``(lse, target)``, fp32
    [R]; ``logits`` is scratch (may be overwritten)."""
    if logits.dtype in _KERNEL_DTYPES:
        return lops.cross_entropy_rows_(logits, safe_labels, None)
    target = logits.gather(1, safe_labels[:, None]).squeeze(1).float()
    m = logits.amax(1, keepdim=True)
    work = torch.promote_types(logits.dtype, torch.float32)
    e = logits.sub_(m) if logits.dtype == work else logits - m.to(work)
    return (m.squeeze(1).to(work) + e.exp_().sum(1).log()).float(), target


# ---- the weight gradient's fp32 accumulation ----------------------------------------------------


def _add_wgrad_(acc: torch.Tensor, dl: torch.Tensor, y: torch.Tensor, slice_bytes: int) -> None:
    """acc += dl^T @ y: acc [V, H] fp32, dl [R, V] and y [R, H] in the compute dtype; the product
    is accumulated in fp32, never rounded to the compute dtype. Paths without an fp32-output GEMM
    go one vocabulary slice at a time, so their fp32 temporaries stay within ``slice_bytes``."""
    if dl.dtype == torch.float32:
        acc.addmm_(dl.t(), y)
        return
    mode = mm.f32_out_gemm(acc.device.type, dl.dtype)
    if mode == "addmm":
        torch.addmm(acc, dl.t(), y, out_dtype=torch.float32, out=acc)
        return
    v, r = acc.shape[0], dl.shape[0]
    # "mm": an fp32 [slice, H] product per slice; "none": an fp32 copy [R, slice] of the slice.
    cols = _chunk_rows(v, 4 * (acc.shape[1] if mode == "mm" else r), slice_bytes, 128)
    yf = y if mode == "mm" else y.float()
    for v0 in range(0, v, cols):
        if mode == "mm":
            acc[v0:v0 + cols] += torch.mm(dl[:, v0:v0 + cols].t(), yf, out_dtype=torch.float32)
        else:
            acc[v0:v0 + cols].addmm_(dl[:, v0:v0 + cols].float().t(), yf)


def _add_wgrad_fp8_(acc: torch.Tensor, dq_t, ds, y_t, ys, slice_bytes: int) -> None:
    """acc += (dq_t * ds) @ (y_t * ys)^T for FP8 row-major dq_t [V, R] and y_t [H, R]: fp32
    outputs of one vocabulary slice at a time, within ``slice_bytes``."""
    v, h = acc.shape
    cols = _chunk_rows(v, 4 * h, slice_bytes, 128)
    for v0 in range(0, v, cols):
        acc[v0:v0 + cols] += mm.fp8_mm(dq_t[v0:v0 + cols], ds, y_t, ys, torch.float32)


# ---- the autograd function ----------------------------------------------------------------------


class _NormHeadCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, meta, x, norm_w, weight, labels, num_items):
        (eps, unit_offset), ignore_index, chunk_bytes, cdt, rec, grad_on = meta
        fp8 = rec is not None  # the FP8 backward, in the recipe's formats
        # Inside forward grad mode is always off and needs_input_grad ignores an outer no_grad:
        # the caller's grad mode arrives in meta.
        need_x, need_nw, need_w = (grad_on and bool(n) for n in ctx.needs_input_grad[1:4])
        need_dy = need_x or need_nw
        t, v = x.shape[0], weight.shape[0]
        dev = x.device
        dx = dnw = dw = None
        with _no_autocast(dev):
            yc = (hf_rms_norm(x, norm_w, eps, unit_offset) if norm_w is not None else x).to(cdt)
            wc = weight.to(cdt)
            valid = labels != ignore_index
            safe = torch.where(valid, labels, 0)
            denom = valid.sum().float() if num_items is None else num_items.to(dev, torch.float32)
            inv = 1.0 / denom
            lse = torch.empty(t, dtype=torch.float32, device=dev)
            target = torch.empty(t, dtype=torch.float32, device=dev)
            rows = _chunk_rows(t, v * cdt.itemsize, chunk_bytes, _ROW_ALIGN)
            several = t > rows
            wdt = wgrad_dtype(weight)
            acc = None
            if need_w and several:  # fp32 accumulator; for an fp32 weight it is dW itself
                acc = torch.zeros(weight.shape, dtype=torch.float32, device=dev)
            dy = torch.empty(x.shape, dtype=cdt, device=dev) if need_dy else None
            w_t = w_scale = None
            if fp8 and need_dy:  # W^T [H, V] in FP8 for every chunk's dY GEMM, made once
                w_scale = _w_scale(weight, rec.act_dtype)
                w_t = qops.quantize_stacked([weight.contiguous()], w_scale, fmt_id(rec.act_dtype), False,
                                            True)[1].view(rec.act_dtype)
            for t0 in range(0, t, rows):
                t1 = min(t0 + rows, t)
                logits = yc[t0:t1] @ wc.t()  # [rows, V] in the compute dtype, as HF's lm_head
                if not (need_dy or need_w):
                    lse[t0:t1], target[t0:t1] = _lse_target(logits, safe[t0:t1])
                    continue
                lse[t0:t1], target[t0:t1] = _ce_grad_(logits, safe[t0:t1], valid[t0:t1], inv)
                dl, y_chunk = logits, yc[t0:t1]
                if not fp8:
                    if need_dy:
                        torch.mm(dl, wc, out=dy[t0:t1])
                    if need_w:
                        if acc is None:
                            dw = (dl.t() @ y_chunk).to(wdt)
                        else:
                            _add_wgrad_(acc, dl, y_chunk, chunk_bytes)
                else:  # dlogits with one scale per chunk, as the FP8 layers quantize dY
                    dq, dq_t, ds = mm.quantize(dl, rec.grad_dtype, need_w)
                    if need_dy:
                        dy[t0:t1] = mm.fp8_mm(dq, ds, w_t, w_scale, cdt)
                    if need_w:
                        _, y_t, ys = mm.quantize(y_chunk, rec.act_dtype, True)
                        if acc is None:
                            dw = mm.fp8_mm(dq_t, ds, y_t, ys, wdt)
                        else:
                            _add_wgrad_fp8_(acc, dq_t, ds, y_t, ys, chunk_bytes)
                    del dq, dq_t
                del logits, dl
            del yc, wc, w_t
            total = torch.where(valid, lse - target, 0.0).sum()
            loss = total / denom
            if need_w:
                dw = _finished_wgrad(acc, dw, weight, wdt)
                del acc
            if need_dy:
                dx, dnw = _norm_grads(x, norm_w, (eps, unit_offset), dy, need_x, need_nw)
                del dy
        # Finished gradients, handed to backward as plain attributes (not saved tensors: they are
        # no activations, and backward scales them in place and gives them away).
        ctx.grads = (dx, dnw, dw)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("fused_lm_head_loss: this loss's backward already ran; its gradients are computed "
                               "in the forward and handed over once (retain_graph / a second backward through "
                               "the same loss is not supported: compute the loss again)")
        ctx.grads = None
        return (None, *(None if g is None else g.mul_(grad) for g in grads), None, None)


def _finished_wgrad(acc: torch.Tensor | None, dw: torch.Tensor | None, weight: torch.Tensor,
                    wdt: torch.dtype) -> torch.Tensor:
    """dW after the last chunk: the fp32 accumulator in dW's dtype (several chunks), the one
    chunk's GEMM output, or zeros when there were no tokens at all."""
    if acc is not None:
        return acc if acc.dtype == wdt else acc.to(wdt)
    if dw is None:  # no tokens at all
        return torch.zeros_like(weight, dtype=wdt)
    return dw


def _norm_grads(x: torch.Tensor, norm_w: torch.Tensor | None, norm: tuple[float, bool], dy: torch.Tensor,
                need_x: bool, need_nw: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx, d(norm weight)) from dY, the gradient of the final norm's output: the norm's backward,
    recomputed with autograd on the saved input (no norm: dx is dY). ``norm``: (eps, unit_offset)."""
    if norm_w is None:
        return dy.to(x.dtype), None
    # The recomputed norm's graph lives only for the next line: identity hooks keep
    # it from the caller's saved-tensor hooks (offloading, memory accounting).
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
        xr = x.detach().requires_grad_(need_x)
        wr = norm_w.detach().requires_grad_(need_nw)
        yr = hf_rms_norm(xr, wr, *norm)
    wanted = [tt for tt, n in ((xr, need_x), (wr, need_nw)) if n]
    got = list(torch.autograd.grad(yr, wanted, dy.to(yr.dtype)))
    del yr
    return (got.pop(0) if need_x else None), (got.pop(0) if need_nw else None)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _w_scale(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor FP8 scale of w (max(amax / the format's max, 2^-126); 1 when w is all zeros)
    without an |w| temporary: the numerics contract of csrc/common/fp8.h scale_for."""
    lo, hi = torch.aminmax(w)
    amax = torch.maximum(hi, -lo).float().reshape(1)
    scale = (amax / torch.finfo(dtype).max).clamp_min(2.0**-126)
    return torch.where(amax > 0, scale, torch.ones_like(amax))


def _shifted(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Hugging Face's shift: position i predicts labels[..., i + 1]; the last predicts nothing."""
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _check_tensors(hidden: torch.Tensor, lm_head_weight: torch.Tensor, norm_weight: torch.Tensor | None) -> None:
    """The shapes, dtypes and devices of ``fused_lm_head_loss``'s tensors."""
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
        got = getattr(hidden, "dtype", type(hidden))
        raise ValueError(f"hidden must be a floating-point tensor [..., H], got {got}")
    h = hidden.shape[-1]
    if not isinstance(lm_head_weight, torch.Tensor) or lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != h:
        raise ValueError(
            f"lm_head_weight must have shape [vocab, {h}], got {list(getattr(lm_head_weight, 'shape', []))}"
        )
    if lm_head_weight.shape[0] == 0 or not lm_head_weight.is_floating_point():
        raise ValueError("lm_head_weight must be a floating-point [vocab, hidden] tensor with vocab > 0")
    if norm_weight is not None and (not isinstance(norm_weight, torch.Tensor) or norm_weight.shape != (h,)):
        raise ValueError(f"norm_weight must have shape ({h},), got {list(getattr(norm_weight, 'shape', []))}")
    for name, t in (("lm_head_weight", lm_head_weight), ("norm_weight", norm_weight)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device}, hidden on {hidden.device}")


def _num_items(num_items_in_batch: torch.Tensor | int | None) -> torch.Tensor | None:
    """``num_items_in_batch`` as a 0-dim tensor (None stays None)."""
    if num_items_in_batch is None:
        return None
    if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, float, torch.Tensor)):
        got = type(num_items_in_batch).__name__
        raise ValueError(f"num_items_in_batch must be a number or a tensor, got {got}")
    if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() != 1:
        raise ValueError(f"num_items_in_batch must hold one number, got shape {list(num_items_in_batch.shape)}")
    return torch.as_tensor(num_items_in_batch).reshape(())


def fused_lm_head_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_unit_offset: bool = False,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
    chunk_mib: float = DEFAULT_CHUNK_MIB,
    fp8_backward: bool = False,
    recipe: Fp8Recipe | str | None = None,
) -> torch.Tensor:
    """Hugging Face's causal-LM loss of ``lm_head(norm(hidden))`` without materializing the logits.

    ``hidden``: [..., H], the final norm's input (or its output when ``norm_weight`` is None);
    ``norm_unit_offset``: the final norm is Gemma's, ``T(h * (1 + w))``, not Llama's ``w * T(h)``.
    ``lm_head_weight``: [V, H]. ``labels``: the inputs' token ids ([...], shifted here as Hugging
    Face does), or None with ``shift_labels`` (already aligned with ``hidden``). Returns the fp32
    scalar loss: the mean over non-ignored positions, or their sum / ``num_items_in_batch``.
    The GEMMs run in the autocast dtype when autocast is on, else in ``hidden``'s dtype;
    ``fp8_backward`` runs the two gradient GEMMs (dX, dW) in FP8 instead (the loss is unchanged),
    in the formats of ``recipe`` (an ``Fp8Recipe`` or its name; default "fp8").
    The gradients are computed in this call when grad mode is on and an input requires them (see
    the module docstring); under ``torch.no_grad`` only the loss is.
    ``chunk_mib``: the most MiB of compute-dtype logits one chunk of token rows holds (at least
    one row); the torch fallback of the per-chunk softmax adds an fp32 working copy of it.
    """
    _check_tensors(hidden, lm_head_weight, norm_weight)
    h = hidden.shape[-1]
    if not isinstance(chunk_mib, (int, float)) or isinstance(chunk_mib, bool) or not chunk_mib > 0:
        raise ValueError(f"chunk_mib must be a positive number, got {chunk_mib!r}")
    if not isinstance(fp8_backward, bool):
        raise ValueError(f"fp8_backward must be True or False, got {fp8_backward!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    if shift_labels is not None:
        targets, name = shift_labels, "shift_labels"
    elif labels is not None:
        targets, name = labels, "labels"
    else:
        raise ValueError("labels (or shift_labels) must be given to compute the loss")
    if not isinstance(targets, torch.Tensor) or targets.dtype == torch.bool or targets.is_floating_point() \
            or targets.is_complex():
        got = getattr(targets, "dtype", type(targets))
        raise ValueError(f"{name} must be an integer tensor of token ids, got {got}")
    if shift_labels is None:
        if targets.dim() == 0:
            raise ValueError("labels must have a sequence dimension")
        targets = _shifted(targets, ignore_index)
    positions = hidden.numel() // h if h else hidden.shape[:-1].numel()
    if targets.numel() != positions:
        raise ValueError(
            f"{name} has {targets.numel()} positions ({list(targets.shape)}) but hidden has {positions} "
            f"({list(hidden.shape[:-1])})"
        )
    num_items_in_batch = _num_items(num_items_in_batch)
    x2 = hidden.reshape(-1, h)
    lab = targets.reshape(-1).to(device=hidden.device, dtype=torch.int64)
    _check_labels_in_range(lab, lab != ignore_index, lm_head_weight.shape[0], ignore_index)
    cdt = compute_dtype(hidden)
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, norm_weight, lm_head_weight))
    if cdt == torch.float16 and wants_grad:
        # The gradient is formed in the forward, before GradScaler's scale reaches it: in fp16 most
        # softmax-gradient entries (below 2^-24 once divided by the token count) would flush to zero.
        raise ValueError("fused_lm_head_loss cannot compute gradients in float16 (its logit gradients are "
                         "formed before GradScaler scales them and would underflow): train in bfloat16 "
                         "(torch.autocast(dtype=torch.bfloat16) or model.to(torch.bfloat16)), or set "
                         "model.coat_fused_loss = False to use Hugging Face's unfused loss")
    rec = resolve(recipe) if fp8_backward else None
    meta = ((float(eps), bool(norm_unit_offset)), ignore_index, int(chunk_mib * 2**20), cdt, rec, torch.is_grad_enabled())
    return _NormHeadCrossEntropyFn.apply(meta, x2, norm_weight, lm_head_weight, lab, num_items_in_batch)
