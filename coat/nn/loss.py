"""Fused final RMSNorm + LM head + cross-entropy, chunked so the [tokens, vocab] logits never exist
whole (neither in the compute dtype nor in fp32).

Forward: the token rows are processed in chunks of ``chunk_mib`` MiB of fp32 logits; per chunk the
logits are one GEMM in the compute dtype (BF16 under autocast or for a BF16 model, as Hugging
Face's ``lm_head`` produces them), upcast to fp32 for a max-shifted log-sum-exp, and only the
per-token log-sum-exp (4 bytes per token) survives the chunk.

Backward recomputes the logits, chunked over the VOCABULARY: per slice ``W[v0:v1]`` the tile
[tokens, slice] is recomputed and turned into ``s * (softmax - onehot)`` with the saved
log-sum-exp (the scale ``s = grad / denominator`` folded into the exponent's shift as ``log|s|``,
so no separate scaling pass), cast to the compute dtype, and fed to two GEMMs:

- ``dW[v0:v1] = dlogits^T @ y``: each slice of the weight gradient is complete after one GEMM over
  all tokens, so dW is never accumulated across chunks (one rounding to the compute dtype, as in
  Hugging Face's single GEMM) and no fp32 [vocab, hidden] buffer exists;
- ``dY += dlogits @ W[v0:v1]``: the hidden-state gradient accumulates over the slices in an fp32
  [tokens, hidden] buffer.

Transient memory: a forward chunk is ``chunk_mib`` of fp32 logits plus half that in the compute
dtype; a backward tile the same, plus [tokens, hidden] tensors (recomputed y, its signed copy,
the fp32 dY, one GEMM output: about 10 bytes x tokens x hidden) and the weight gradient itself.
Under autocast the forward also holds the compute-dtype copy of the LM head weight (as Hugging
Face's autocast does); the backward casts one vocabulary slice at a time.

Saved for backward: the final norm's INPUT in its own dtype (the last decoder layer's output, one
[tokens, hidden] tensor), the norm and LM head weights (references), the labels and the fp32
log-sum-exp per token. Never the logits, never the normed hidden states (recomputed: a cheap
elementwise pass). The norm keeps Hugging Face's LlamaRMSNorm arithmetic, so the loss of an fp32
model agrees with Hugging Face's to fp32 rounding.

Precision: the LM head GEMMs run in the compute dtype (BF16 in mixed precision) by default.
Measured against fp64 (``benchmarks/bench_loss.py --accuracy``, 256 tokens, hidden 256, vocab
8192): per-tensor E4M3 operands in the forward GEMM move the loss by 0.4-0.5 % on trained-like
logit distributions (1e-5 at random init), past the 0.1 % budget for the loss, where BF16 moves
it by 0.02 %; so the forward stays BF16. FP8 backward GEMMs (E5M2 dlogits, E4M3 y and W) leave
the loss untouched and put 5-6 % relative error on dW and dX (BF16: 0.7-0.8 %), within the error
of the FP8 decoder layers' gradients (7-15 %): ``fp8_backward=True`` turns them on (off by
default until training runs show the head takes it).

Semantics are Hugging Face's ``ForCausalLMLoss``: labels are shifted left by one (the last
position has no target) unless ``shift_labels`` is given, ``ignore_index`` positions contribute
nothing, the loss is the mean over the other positions (NaN when there are none, gradients zero),
or their sum divided by ``num_items_in_batch`` when the Trainer passes it.

For a Hugging Face model, ``install_fused_loss(model)`` makes ``model(..., labels=...)`` take this
path; the returned output then has ``logits=None``. To get logits, call the model without
``labels`` (and compute the loss yourself), or set ``model.coat_fused_loss = False`` (Hugging
Face's own path: logits and loss, at its memory cost).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .._ops import quantize as qops
from .._ops._util import fmt_id
from . import _fp8mm as mm
from .fused import compute_dtype, wgrad_dtype
from .norm import hf_rms_norm
from .recipe import ACT_DTYPE, GRAD_DTYPE

__all__ = ["DEFAULT_CHUNK_MIB", "fused_lm_head_loss", "install_fused_loss", "FusedCausalLMLossMixin"]

#: Default bound on one chunk of fp32 logits. The transient of a chunk is about 1.5x this (the
#: compute-dtype logits and their fp32 upcast); smaller chunks mean more, smaller GEMMs and more
#: passes over the fp32 hidden-state gradient in backward.
DEFAULT_CHUNK_MIB = 256
_VOCAB_ALIGN = 128  # vocabulary slices in backward: multiples of this (GEMM-friendly widths)
_ROW_ALIGN = 64  # token rows of a forward chunk: multiples of this
_E4M3 = fmt_id(ACT_DTYPE)


def _chunk_rows(total: int, row_len: int, chunk_bytes: int, align: int) -> int:
    """How many rows of ``row_len`` fp32 elements fit ``chunk_bytes`` (at least one), rounded
    down to a multiple of ``align`` when that many fit."""
    rows = chunk_bytes // (4 * max(row_len, 1))
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
    if labels.device.type == "cpu":
        if bool(bad.any()):
            raise ValueError(msg)
    else:  # no host synchronization on an accelerator: fails at the next sync point
        torch._assert_async(~bad.any(), msg)


class _NormHeadCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, meta, x, norm_w, weight, labels, num_items):
        eps, ignore_index, chunk_bytes, cdt, _ = meta
        t, v = x.shape[0], weight.shape[0]
        with _no_autocast(x.device):
            y = hf_rms_norm(x, norm_w, eps) if norm_w is not None else x
            yc, wc = y.to(cdt), weight.to(cdt)
            del y
            valid = labels != ignore_index
            safe = torch.where(valid, labels, 0)
            lse = torch.empty(t, dtype=torch.float32, device=x.device)
            target = torch.empty(t, dtype=torch.float32, device=x.device)
            rows = _chunk_rows(t, v, chunk_bytes, _ROW_ALIGN)
            for t0 in range(0, t, rows):
                t1 = min(t0 + rows, t)
                logits = yc[t0:t1] @ wc.t()  # [rows, V] in the compute dtype, as HF's lm_head
                target[t0:t1] = logits.gather(1, safe[t0:t1, None]).squeeze(1)
                m = logits.amax(1, keepdim=True).float()
                e = logits - m  # fp32 by type promotion: one pass reads the chunk, writes fp32
                del logits
                e.exp_()
                lse[t0:t1] = m.squeeze(1) + e.sum(1).log()
                del e
            total = torch.where(valid, lse - target, 0.0).sum()
            denom = valid.sum().float() if num_items is None else num_items.to(x.device, torch.float32)
            loss = total / denom
        ctx.save_for_backward(x, norm_w, weight, labels, lse, denom)
        ctx.meta = meta
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        eps, ignore_index, chunk_bytes, cdt, fp8 = ctx.meta
        x, norm_w, weight, labels, lse, denom = ctx.saved_tensors
        need_x, need_nw, need_w = ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        need_dy = need_x or need_nw
        t, v = x.shape[0], weight.shape[0]
        dx = dnw = dw = None
        with _no_autocast(x.device):
            with torch.no_grad():
                yc = (hf_rms_norm(x, norm_w, eps) if norm_w is not None else x).to(cdt)
            # s * (softmax - onehot) with s = grad / denom: |s| rides in the exp's shift, its
            # sign multiplies y (for dW) and the fp32 dY once, so each tile takes one pass.
            s = grad.float() / denom
            mag, sign = s.abs(), torch.sign(s)
            valid = labels != ignore_index
            shift = torch.where(valid, lse - mag.log(), math.inf)  # ignored rows: exp(-inf) = 0
            hot = torch.where(valid, -mag, 0.0)
            safe = torch.where(valid, labels, 0)
            y_signed = yc * sign.to(cdt) if need_w else None
            if fp8 and need_w:  # E4M3 y^T for every slice's dW GEMM, made once
                _, y_t, ys = mm.quantize(y_signed, ACT_DTYPE, True)
                y_signed = None
            w_scale = _e4m3_scale(weight) if fp8 and need_dy else None
            dw = torch.empty_like(weight) if need_w else None
            dy = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if need_dy else None
            cols = _chunk_rows(v, t, chunk_bytes, _VOCAB_ALIGN)
            for v0 in range(0, v, cols):
                v1 = min(v0 + cols, v)
                w_slice = weight[v0:v1]
                wc = w_slice.to(cdt)  # under autocast: a bf16 copy of this slice only
                logits = yc @ wc.t()  # [T, slice], recomputed in the compute dtype
                p = logits - shift[:, None]  # fp32
                del logits
                p.exp_()
                inside = (safe >= v0) & (safe < v1)
                p.scatter_add_(1, (safe - v0).clamp_(0, v1 - v0 - 1)[:, None],
                               torch.where(inside, hot, 0.0).to(p.dtype)[:, None])
                dl = p.to(cdt)
                del p
                if not fp8:
                    if need_w:
                        dw[v0:v1] = dl.t() @ y_signed
                    if need_dy:
                        dy += dl @ wc
                else:  # E5M2 dlogits with one scale per slice, as the FP8 layers quantize dY
                    dq, dq_t, ds = mm.quantize(dl, GRAD_DTYPE, need_w)
                    if need_w:
                        dw[v0:v1] = mm.fp8_mm(dq_t, ds, y_t, ys, wgrad_dtype(weight))
                    if need_dy:
                        w_t = qops.quantize_stacked([w_slice.contiguous()], w_scale, _E4M3, False, True)[1]
                        dy += mm.fp8_mm(dq, ds, w_t.view(ACT_DTYPE), w_scale, torch.float32)
                    del dq, dq_t
                del dl, wc
            del yc, y_signed
            if need_dy:
                dy *= sign
                if norm_w is None:
                    dx = dy.to(x.dtype)
                else:
                    with torch.enable_grad():
                        xr = x.detach().requires_grad_(need_x)
                        wr = norm_w.detach().requires_grad_(need_nw)
                        yr = hf_rms_norm(xr, wr, eps)
                    wanted = [tt for tt, n in ((xr, need_x), (wr, need_nw)) if n]
                    got = list(torch.autograd.grad(yr, wanted, dy.to(yr.dtype)))
                    del yr, dy
                    dx = got.pop(0) if need_x else None
                    dnw = got.pop(0) if need_nw else None
        return None, dx, dnw, dw, None, None


def _e4m3_scale(w: torch.Tensor) -> torch.Tensor:
    """Per-tensor E4M3 scale of w (amax / 448; 1 when w is all zeros) without an |w| temporary."""
    lo, hi = torch.aminmax(w)
    amax = torch.maximum(hi, -lo).float().reshape(1)
    return torch.where(amax > 0, amax / torch.finfo(ACT_DTYPE).max, torch.ones_like(amax))


def _shifted(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Hugging Face's shift: position i predicts labels[..., i + 1]; the last predicts nothing."""
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def fused_lm_head_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
    chunk_mib: float = DEFAULT_CHUNK_MIB,
    fp8_backward: bool = False,
) -> torch.Tensor:
    """Hugging Face's causal-LM loss of ``lm_head(norm(hidden))`` without materializing the logits.

    ``hidden``: [..., H], the final norm's input (or its output when ``norm_weight`` is None).
    ``lm_head_weight``: [V, H]. ``labels``: the inputs' token ids ([...], shifted here as Hugging
    Face does), or None with ``shift_labels`` (already aligned with ``hidden``). Returns the fp32
    scalar loss: the mean over non-ignored positions, or their sum / ``num_items_in_batch``.
    The GEMMs run in the autocast dtype when autocast is on, else in ``hidden``'s dtype;
    ``fp8_backward`` runs the two backward GEMMs (dX, dW) in FP8 instead (the loss is unchanged).
    """
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
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, float, torch.Tensor)):
            got = type(num_items_in_batch).__name__
            raise ValueError(f"num_items_in_batch must be a number or a tensor, got {got}")
        if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() != 1:
            raise ValueError(f"num_items_in_batch must hold one number, got shape {list(num_items_in_batch.shape)}")
        num_items_in_batch = torch.as_tensor(num_items_in_batch).reshape(())
    x2 = hidden.reshape(-1, h)
    lab = targets.reshape(-1).to(device=hidden.device, dtype=torch.int64)
    _check_labels_in_range(lab, lab != ignore_index, lm_head_weight.shape[0], ignore_index)
    meta = (float(eps), ignore_index, int(chunk_mib * 2**20), compute_dtype(hidden), fp8_backward)
    return _NormHeadCrossEntropyFn.apply(meta, x2, norm_weight, lm_head_weight, lab, num_items_in_batch)


# ---- Hugging Face models ---------------------------------------------------------------------------

_SUBCLASSES: dict = {}


def _slice_to_keep(hidden: torch.Tensor, logits_to_keep) -> torch.Tensor:
    try:  # transformers >= 5 (also takes boolean / per-sample position tensors)
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:
        slice_logits_to_keep = None
    if slice_logits_to_keep is not None:
        return slice_logits_to_keep(hidden, logits_to_keep)
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden[:, keep, :]


class _DeferrableNormMixin:
    """The final norm of a model with the fused loss: while the loss is computed fused, it passes
    its input through (the fused op applies it), so its output and saved tensors never exist."""

    def forward(self, hidden_states):
        if self.__dict__.get("_coat_deferred", False):
            return hidden_states
        return super().forward(hidden_states)


class _Deferred:
    def __init__(self, norm: nn.Module, on: bool):
        self.norm, self.on = norm, on

    def __enter__(self):
        if self.on:
            self.norm._coat_deferred = True

    def __exit__(self, *exc):
        if self.on:
            self.norm._coat_deferred = False


class FusedCausalLMLossMixin:
    """forward() of a Hugging Face ``*ForCausalLM`` whose loss runs through ``fused_lm_head_loss``
    when ``labels`` are given (``logits`` is then None; with ``return_dict=False`` the tuple is
    ``(loss, ...)`` without logits). Without labels, with ``coat_fused_loss = False``, a custom
    ``loss_function``, or a wrapped or hooked ``lm_head``, it is Hugging Face's forward."""

    coat_fused_loss: bool = True
    coat_loss_chunk_mib: float = DEFAULT_CHUNK_MIB
    coat_loss_fp8_backward: bool = False

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        loss_type = getattr(self, "loss_type", None)
        head = self.lm_head
        # A custom loss, a head something wraps (PEFT's adapters or modules_to_save, FSDP2
        # sharding the head on its own) or hooks on the head: theirs to see, on HF's path.
        if (labels is None or not self.coat_fused_loss or "_loss_function" in self.__dict__
                or loss_type not in (None, "ForCausalLM") or type(head) is not nn.Linear
                or head.bias is not None or head._forward_hooks or head._forward_pre_hooks):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                                   use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            cfg = self.config
            return_dict = cfg.return_dict if hasattr(cfg, "return_dict") else getattr(cfg, "use_return_dict", True)
        norm = self.model.norm
        # The norm runs in the model (and the fused op takes its output) when its output is
        # wanted: hidden_states[-1] is the normed state; hooks on the norm; a norm replaced since.
        want_hidden = kwargs.get("output_hidden_states")
        if want_hidden is None:
            want_hidden = getattr(self.config, "output_hidden_states", False)
        fuse_norm = (not want_hidden and isinstance(norm, _DeferrableNormMixin) and not norm._forward_hooks
                     and not norm._forward_pre_hooks)
        with _Deferred(norm, fuse_norm):
            outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                                 **kwargs)
        hidden = _slice_to_keep(outputs.last_hidden_state, logits_to_keep)
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        loss = fused_lm_head_loss(
            hidden, self.lm_head.weight, labels,
            norm_weight=norm.weight if fuse_norm else None, eps=eps,
            ignore_index=kwargs.get("ignore_index", -100),
            num_items_in_batch=kwargs.get("num_items_in_batch"),
            shift_labels=kwargs.get("shift_labels"),
            chunk_mib=self.coat_loss_chunk_mib,
            fp8_backward=self.coat_loss_fp8_backward,
        )
        out = CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                     hidden_states=getattr(outputs, "hidden_states", None),
                                     attentions=getattr(outputs, "attentions", None))
        return out if return_dict else out.to_tuple()


_HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def __getattr__(name: str) -> type:
    """Rebuilds an installed class by name, so that ``torch.save(model)`` of a model with the fused
    loss loads in a process that has not installed it (pickle finds classes as module attributes)."""
    import importlib

    if name.startswith("Deferrable"):
        base_name, mixin = name[len("Deferrable"):], _DeferrableNormMixin
    elif name.endswith("ForCausalLM"):
        base_name, mixin = name, FusedCausalLMLossMixin
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    for model_type in _HF_MODEL_TYPES:
        try:
            mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        except ImportError:
            continue
        base = getattr(mod, base_name, None)
        if isinstance(base, type) and issubclass(base, nn.Module):
            return _subclass(base, mixin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _subclass(cls: type, mixin: type, name: str) -> type:
    if issubclass(cls, mixin):
        return cls
    key = (cls, mixin)
    if key not in _SUBCLASSES:
        sub = type(name, (mixin, cls), {"__module__": __name__, "__qualname__": name})
        _SUBCLASSES[key] = sub
        globals().setdefault(name, sub)  # lets pickle find the class in a process that installed it
    return _SUBCLASSES[key]


def install_fused_loss(model: nn.Module, *, chunk_mib: float = DEFAULT_CHUNK_MIB,
                       fp8_backward: bool = False) -> nn.Module:
    """Makes ``model(..., labels=...)`` of a Hugging Face Llama/Mistral/Qwen2/Qwen3 causal LM (or a
    PEFT model around one) compute its loss with ``fused_lm_head_loss`` (final norm + LM head +
    cross-entropy, chunked), in place; returns the model. Parameters, state-dict keys and the class
    name (which ``save_pretrained`` records) stay as they were; ``torch.save(model)`` loads in a
    fresh process. A head something wraps at call time (a PEFT adapter or ``modules_to_save`` on
    ``lm_head``), a custom ``loss_function`` or forward hooks on ``lm_head`` take Hugging Face's
    path, and so does every call after ``model.coat_fused_loss = False``. Installing twice only
    updates the settings.
    ``fp8_backward``: the LM head's two backward GEMMs in FP8 (see ``fused_lm_head_loss``)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(chunk_mib, (int, float)) or isinstance(chunk_mib, bool) or not chunk_mib > 0:
        raise ValueError(f"chunk_mib must be a positive number, got {chunk_mib!r}")
    if not isinstance(fp8_backward, bool):
        raise ValueError(f"fp8_backward must be True or False, got {fp8_backward!r}")
    wrapper, get_base = model, getattr(model, "get_base_model", None)
    if callable(get_base):  # a PEFT model: the causal LM it wraps
        model = get_base()
    base = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    norm = getattr(base, "norm", None)
    if type(head) is not nn.Linear or norm is None or not isinstance(getattr(norm, "weight", None), torch.Tensor):
        raise ValueError(
            f"install_fused_loss needs a causal LM with .model.norm and a plain nn.Linear .lm_head; "
            f"{type(model).__name__} has not"
        )
    if head.bias is not None:
        raise ValueError("install_fused_loss supports LM heads without bias")
    if getattr(getattr(model, "config", None), "final_logit_softcapping", None) is not None:
        raise ValueError("install_fused_loss does not support final_logit_softcapping")
    if not hasattr(norm, "variance_epsilon") and not hasattr(norm, "eps"):
        raise ValueError(f"{type(norm).__name__} has no variance_epsilon/eps: not an RMSNorm")
    norm.__class__ = _subclass(type(norm), _DeferrableNormMixin, "Deferrable" + type(norm).__name__)
    model.__class__ = _subclass(type(model), FusedCausalLMLossMixin, type(model).__name__)
    model.coat_fused_loss = True
    model.coat_loss_chunk_mib = float(chunk_mib)
    model.coat_loss_fp8_backward = fp8_backward
    return wrapper
