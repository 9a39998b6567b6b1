"""Bytes per token saved for backward, by op, derived from the code: Hugging Face's LlamaDecoderLayer
(RMSNorm keeps an fp32 copy of its input, its rstd and the normalized bf16 tensor; the projections
keep their inputs; SDPA keeps q, k, v, out and the log-sum-exp; SiLU*up keeps gate, silu(gate), up
and the product) and coat/nn (fused.py, mlp.py, attention.py, norm.py: FP8 copies with 1x16 group
scales, recomputed norms and SwiGLU outputs); and what the fused loss holds at its peak. The tables
of the memory plan (``coat.memory``); tests count them with saved-tensor hooks."""

from __future__ import annotations

from coat.memory_recipes import LORA_RANK, NotModeled  # NotModeled: defined with the recipes, which refuse +side
from coat.memory_shapes import ModelShape
# The FP8 layers' own rules for which widths their FP8 norm and SwiGLU kernels take (1 x 16 groups):
# other widths fall back to saving the input in its own dtype, and the plan counts what they save.
from coat.nn.block import fp8_swiglu_ok
from coat.nn.norm import fp8_norm_ok

GiB = float(1 << 30)
MiB = float(1 << 20)


def _norm(width: int, rows: int, table: str) -> float:
    """HF RMSNorm over ``width`` (``rows`` rstd values per token)."""
    if table == "hf-amp":  # fp32 input is its own fp32 copy; the normalized tensor stays fp32
        return 4 * width + 4 * rows + 4 * width
    return 4 * width + 4 * rows + 2 * width


def _hf_norm(shape: ModelShape, width: int, rows: int, table: str) -> float:
    """A Hugging Face norm of ``shape``'s family: Gemma 3's keeps its input's fp32 copy, rstd and the
    fp32 normalized tensor (it multiplies by 1 + w in fp32) whatever the input's dtype."""
    return 8 * width + 4 * rows if shape.gemma else _norm(width, rows, table)


def saved_constants(shape: ModelShape, table: str, fused_loss: bool) -> tuple[float, float]:
    """Bytes saved whatever the token count, (per decoder layer, outside the layers): Gemma 3's
    Hugging Face norms each keep their fp32 1 + w (4 norms of the hidden width and the q and k norms
    of the head width per layer; the final norm, unless the fused loss applies it)."""
    if not shape.gemma or table not in ("hf-bf16", "hf-amp", "coat"):
        return 0.0, 0.0
    if table == "coat":  # only the norms that fall back to Hugging Face's arithmetic (``_coat_norm``)
        per_layer = 4.0 * ((2 * shape.hidden if not fp8_norm_ok(shape.hidden) else 0)
                           + (2 * shape.head_dim if shape.qk_norm and not fp8_norm_ok(shape.head_dim) else 0))
    else:
        per_layer = 4.0 * (4 * shape.hidden + (2 * shape.head_dim if shape.qk_norm else 0))
    return per_layer, 0.0 if fused_loss else 4.0 * shape.hidden


def _fp8_norm_input(width: int, rows: int) -> float:
    """coat's fused/FP8 RMSNorm: E4M3 input, fp32 scale per 16, fp32 rstd per row."""
    return width + width / 16 * 4 + 4 * rows


def _coat_norm(shape: ModelShape, width: int, rows: int, fused: bool, trains: bool = True) -> float:
    """A norm of coat's layers over ``rows`` rows of ``width`` per token (coat/nn/norm.py, block.py):
    its input in FP8 where ``fp8_norm_ok(width)``; else, fused into the GEMM after it (the block op),
    its input in bf16, the layers' dtype (the norm is recomputed in backward); else
    (``coat.nn.norm.rms_norm``) Hugging Face's arithmetic under autograd, which keeps no normalized
    output for a frozen weight."""
    if fp8_norm_ok(width):
        return _fp8_norm_input(width * rows, rows)
    if fused:
        return 2.0 * width * rows
    return _hf_norm(shape, width * rows, rows, "hf-bf16") if trains else 4.0 * width * rows + 4 * rows


def _coat_gated(i: int, fused: bool) -> float:
    """act(gate) * up over the [.., 2I] gate/up output: its input in FP8 (1 x 16 scales) where
    ``fp8_swiglu_ok(I)``; else, fused into down_proj's block op, the bf16 gate/up (recomputed in
    backward); else (``coat.nn.mlp.swiglu``) autograd's gate/up, act(gate) and nothing more."""
    if fp8_swiglu_ok(i):
        return 2 * i + 2 * i / 16 * 4
    return 4.0 * i if fused else 6.0 * i


def layer_saved(shape: ModelShape, table: str, granularity: str = "tensor") -> list[tuple[str, float]]:
    """(op, bytes per token) saved by one decoder layer (``saved_constants``: what it saves per call);
    ``granularity``: the FP8 layers' scaling (coat tables only)."""
    h, q, kv, i, nh = shape.hidden, shape.q_width, shape.kv_width, shape.intermediate, shape.heads
    sdpa = 2 * q + 4 * kv + 2 * q + 4 * nh  # q, k, v, out (bf16), log-sum-exp (fp32 per head)
    gated = "GeGLU (gate, gelu, up, product)" if shape.gemma else "SwiGLU (gate, silu, up, product)"
    if table in ("hf-bf16", "hf-amp"):
        casts = 1 if table == "hf-bf16" else 3  # under autocast each projection casts its input anew
        ops = [("input RMSNorm", _hf_norm(shape, h, 1, table)), ("q/k/v input", 2 * h * casts)]
        if shape.qk_norm:
            qk = _hf_norm(shape, q, nh, "hf-bf16") + _hf_norm(shape, kv, shape.kv_heads, "hf-bf16")
            ops.append(("q/k RMSNorm", qk))
        ops.append(("attention (SDPA)", sdpa))
        if shape.gemma:  # sandwich norms on the attention output (bf16) and on the MLP output
            ops += [("post-attention RMSNorm", _hf_norm(shape, h, 1, table)),
                    ("pre-feed-forward RMSNorm", _hf_norm(shape, h, 1, table)),
                    ("post-feed-forward RMSNorm", _hf_norm(shape, h, 1, table))]
        else:
            ops.append(("post-attention RMSNorm", _norm(h, 1, table)))
        return ops + [("gate/up input", 2 * h * (1 if table == "hf-bf16" else 2)), (gated, 8 * i)]
    if shape.gemma and table not in ("coat",):
        raise NotModeled(f"the memory plan has no {table!r} table for Gemma 3 yet (LoRA on Gemma 3 is not modeled)")
    if table == "hf-bf16-lora":
        # The base frozen: a norm keeps its fp32 input and rstd, not its output (its weight takes no
        # gradient), and no frozen projection keeps its input; each adapted projection keeps its own
        # fp32 copy of its input (PEFT casts it to the adapters' dtype) and A's fp32 output.
        frozen_norm = 4 * h + 4
        ops = [("input RMSNorm (frozen)", frozen_norm), ("LoRA inputs, fp32 (q, k, v, o, gate, up, down)",
                                                          4.0 * (5 * h + q + i)),
               ("LoRA A outputs, fp32", 7 * 4.0 * LORA_RANK)]
        if shape.qk_norm:
            ops.append(("q/k RMSNorm (frozen)", 4 * q + 4 * nh + 4 * kv + 4 * shape.kv_heads))
        ops += [("attention (SDPA)", sdpa), ("post-attention RMSNorm (frozen)", frozen_norm),
                ("SwiGLU (gate, silu, up)", 6 * i)]
        return ops
    if table in ("coat", "coat-lora"):
        return _coat_layer_saved(shape, table, granularity, sdpa, gated)
    raise ValueError(f"unknown activation table {table!r}")


def _coat_layer_saved(shape: ModelShape, table: str, granularity: str, sdpa: float,
                      gated: str) -> list[tuple[str, float]]:
    """``layer_saved`` of coat's layers (``table`` "coat" or "coat-lora"). With LoRA the norms and
    the SwiGLU run apart from their GEMMs (the adapters need their outputs), their weights frozen."""
    h, q, i, nh, d = shape.hidden, shape.q_width, shape.intermediate, shape.heads, shape.head_dim
    lora = table == "coat-lora"
    fp8 = fp8_norm_ok(h)
    norm_in = ("FP8 norm input" if fp8 else "bf16 norm input") if not lora or fp8 else "HF norm, frozen"
    ops = [(f"input RMSNorm + q/k/v ({norm_in})", _coat_norm(shape, h, 1, fused=not lora, trains=False))]
    if shape.qk_norm:
        ops.append((f"q/k RMSNorm ({'FP8' if fp8_norm_ok(d) else 'HF'} input)",
                    _coat_norm(shape, d, nh, False, not lora) + _coat_norm(shape, d, shape.kv_heads, False, not lora)))
    o_in = ("o_proj input (FP8, transposed, 128x1 scales)", q + q / 32) if granularity == "block" else \
        ("o_proj input (FP8, transposed)", q)
    gu = "FP8 gate/up, 1x16 scales" if fp8_swiglu_ok(i) else "bf16 gate/up" if not lora else "autograd's gate/up, act"
    ops += [("attention (SDPA)", sdpa), o_in,
            (f"pre-MLP RMSNorm + gate/up ({norm_in})", _coat_norm(shape, h, 1, fused=not lora, trains=False)),
            (gated.split(" (")[0] + f" + down ({gu})", _coat_gated(i, fused=not lora))]
    if shape.gemma:  # the sandwich norms: coat.nn.norm.rms_norm (coat/nn/layer.py)
        ops += [(f"sandwich RMSNorms ({'FP8' if fp8 else 'HF'} input)", 2 * _coat_norm(shape, h, 1, False))]
    if lora:
        # The FP8-frozen base (coat/nn/frozen.py): o_proj keeps no input for a weight gradient;
        # the adapters (coat/nn/adapters.py) keep their bf16 inputs (q/k/v's and gate/up's shared,
        # o's is the attention output, already kept; down's the SwiGLU product) and A's bf16
        # outputs. Their bf16 weight copies are counted apart (per layer, not per token).
        ops = [op for op in ops if not op[0].startswith("o_proj")]
        ops += [("LoRA inputs, bf16 (q/k/v, gate/up, down)", 4 * h + 2 * i), ("LoRA A outputs, bf16", 7 * 2 * LORA_RANK)]
    return ops


def outside_saved(shape: ModelShape, table: str, fused_loss: bool) -> list[tuple[str, float]]:
    """(op, bytes per token) saved outside the decoder layers: token ids, final norm, LM head, loss."""
    h, v = shape.hidden, shape.vocab
    resid = "hf-amp" if table == "hf-amp" else "hf-bf16"  # the final norm stays Hugging Face's
    if table == "coat-lora":  # and a frozen embedding keeps no token ids
        return []
    if fused_loss:  # the fused loss saves nothing: its gradients, made in its forward, are in loss_transient
        return [("token ids", 8.0)]
    if table == "hf-bf16-lora":  # a frozen final norm and LM head keep neither their output nor their input
        return [("token ids", 8.0), ("final RMSNorm (frozen)", 4.0 * h + 4), ("cross-entropy log-probabilities (fp32)",
                                                                              4.0 * v)]
    return [("token ids and labels", 16.0), ("final RMSNorm", _hf_norm(shape, h, 1, resid)), ("LM head input", 2 * h),
            ("cross-entropy log-probabilities (fp32)", 4 * v)]


ACTIVATION_TABLES = ("hf-bf16", "hf-amp", "coat", "hf-bf16-lora", "coat-lora")


def fused_loss_transient(shape: ModelShape, tokens: int, chunk_mib: float, x_bytes: int, grad_bytes: int,
                         device: str = "cuda", head_trains: bool = True) -> float:
    """Bytes the fused loss (coat/nn/lm_head_loss.py) holds at the peak of its forward, which also
    computes its gradients (its backward only scales them), beyond what the layers saved: the final
    norm's input (``x_bytes`` per element) and the bf16 hidden-state gradient dY throughout, and the
    largest of

    - a chunk of token rows, beside the bf16 normed hidden states: its bf16 logits (overwritten
      in place with their gradient by the core's cross-entropy kernel: no working copy), and with
      several chunks the fp32 [vocab, hidden] accumulator of dW (plus, off CUDA's fp32-output GEMM,
      fp32 operand slices of up to one chunk's bytes); with one chunk, dW's GEMM output (bf16, then
      cast to ``grad_bytes``);
    - the accumulator cast to dW's dtype (both alive; none for fp32 gradients: the accumulator
      is dW);
    - the final norm's backward on dY beside dW: autograd on Hugging Face's recomputed RMSNorm,
      with dx, holds 28 bytes x hidden per token for a bf16 input (30 for fp32; docs/memory.md).
    dW and dx outlive the forward; the backward then scales them in place (nothing new). Under
    autocast the bf16 copy of an fp32 LM head weight is alive too: ``plan`` counts it with the
    autocast weight copies."""
    h, v, t = shape.hidden, shape.vocab, tokens
    head = shape.head_params or shape.embed_params
    rows = max(1, min(t, int(chunk_mib * MiB) // (2 * v)))
    rows = rows // 64 * 64 if 64 <= rows < t else rows
    chunk = 2.0 * rows * v
    keep = (x_bytes + 2.0) * h * t
    if not head_trains:  # a frozen LM head (LoRA): no dW, its accumulator or its cast
        norm = (28.0 if x_bytes == 2 else 30.0) * h * t
        return keep + max(2.0 * h * t + chunk + (chunk if t > rows and device != "cuda" else 0.0), norm)
    if t > rows:
        slices = 0.0 if device == "cuda" else chunk
        loop = 2.0 * h * t + 4.0 * head + chunk + slices
        cast = 4.0 * head + (grad_bytes * head if grad_bytes != 4 else 0.0)
    else:
        loop = 2.0 * h * t + chunk + 2.0 * head + (grad_bytes * head if grad_bytes != 2 else 0.0)
        cast = 0.0
    norm = grad_bytes * head + (28.0 if x_bytes == 2 else 30.0) * h * t
    return keep + max(loop, cast, norm)
