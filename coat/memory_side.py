"""The memory plan of a side-tuning step (``coat.SideTuned``, setups ``<recipe>+side``): the base frozen
in FP8 and run without autograd, a side network of width hidden / r trained beside it. Part of
``coat.memory`` (``plan`` hands ``+side`` recipes here); pure arithmetic, no torch import.

What a step holds, per token (bf16 base and side network, as ``coat bench``'s ``coat+side`` builds it):
- every base hidden state the side network reads (the embedding output and each layer's output),
  as E4M3 codes with an fp32 scale per 1 x ``input_group`` group (128 for every preset): each goes
  through its downsampler's first Linear as soon as its base layer has run, and that Linear keeps
  it in FP8 for its weight gradient; the last one also in bf16, for the top mix;
- per side layer, checkpointed with the rest of its downsampler and its gated mix (coat.SideTuned's
  ``recompute``, the default): its two inputs, the side stream and the downsampler's first Linear's
  output; the first downsampler, not checkpointed, keeps the SiLU's input and output, the second
  Linear's output into ``nn.RMSNorm`` (its input, an fp32 copy, the normalized fp32 tensor and
  rstd). Without ``recompute`` every downsampler keeps that, each side layer what a Hugging Face
  Llama decoder layer of the side's shape keeps in bf16 (``memory_activations.layer_saved(...,
  "hf-bf16")``) and each gated mix both its operands;
- at the top: the upsample's input and output (the mix keeps the latter), then the fused loss with
  a frozen LM head (``fused_loss_transient(..., head_trains=False)``).
The base keeps nothing (no autograd); while it runs, one layer's working set is the transient. In
backward, one side layer at a time is recomputed: its activations and its gradients are the
transient beside the fused loss's.
"""

from __future__ import annotations

from coat.memory_activations import _norm, fused_loss_transient, layer_saved
from coat.memory_shapes import ModelShape

#: QST's defaults, and coat bench's ``coat+side``: side width hidden / SIDE_R, downsample width.
SIDE_R = 16
SIDE_DOWNSAMPLE = 16


def side_heads(width: int) -> int:
    """Attention heads of the side layers (coat.SideTuned's rule): one per 64 channels, at least one,
    lowered until they divide the width into an even head dimension (RoPE rotates pairs)."""
    heads = max(1, width // 64)
    while width % heads or (width // heads) % 2:
        heads -= 1
    return heads


def side_shape(shape: ModelShape, r: int = SIDE_R) -> ModelShape:
    """The side network's decoder layers as a model shape: width hidden / r, intermediate size the
    base's / r (at least the width), one KV head per head (coat.SideTuned's defaults)."""
    if shape.hidden % r or (shape.hidden // r) % 2:
        raise ValueError(f"r={r} must divide the hidden size {shape.hidden} of {shape.name} into an even side width")
    w = shape.hidden // r
    heads = side_heads(w)
    return ModelShape(f"{shape.name}-side", hidden=w, layers=shape.layers, heads=heads, kv_heads=heads,
                      intermediate=max(w, shape.intermediate // (shape.hidden // w)), vocab=shape.vocab)


def side_params(shape: ModelShape, r: int = SIDE_R, downsample: int = SIDE_DOWNSAMPLE) -> int:
    """Trainable parameters of the side network: L + 1 downsamplers (Linear(h, d), Linear(d, w), RMSNorm),
    L side layers, the upsample Linear(w, h), the layers' mixing gates (one per side channel) and the
    top gates (one per hidden channel)."""
    side = side_shape(shape, r)
    h, w, d, n = shape.hidden, side.hidden, downsample, shape.layers
    down = h * d + d + d * w + w + w
    return (n + 1) * down + n * side.layer_params + w * h + h + n * w + h


def input_group(features: int) -> int | None:
    """The FP8 group (1 x g along the features) in which coat.SideTuned keeps a downsampler's input
    (a base hidden state): the largest of coat's group sizes dividing the hidden size (128 for every
    preset); None if none does (the input is then kept as it is, in bf16)."""
    return next((g for g in (128, 64, 32, 16) if features % g == 0), None)


def _kept_input_bytes(hidden: int) -> float:
    """Bytes per token of one kept downsampler input: E4M3 codes and an fp32 scale per group, or bf16."""
    g = input_group(hidden)
    return 2.0 * hidden if g is None else hidden + 4.0 * hidden / g


def side_saved_per_token(shape: ModelShape, r: int = SIDE_R, downsample: int = SIDE_DOWNSAMPLE,
                         recompute: bool = True) -> list[tuple[str, float]]:
    """(part, bytes per token) the side network keeps for its backward, all layers. ``recompute``
    (coat.SideTuned's default): each side layer, the rest of its downsampler and its gated mix are
    checkpointed and keep only their inputs, the side stream and the downsampler's first Linear's
    output (bf16); else they keep what a Hugging Face Llama decoder layer keeps, every downsampler
    its tail's tensors and each mix its two operands."""
    side = side_shape(shape, r)
    h, w, d, n = shape.hidden, side.hidden, downsample, shape.layers
    # A downsampler after its first Linear: the SiLU's input, the second Linear's input and output,
    # nn.RMSNorm's saved tensors.
    tail = 2 * d + 2 * d + 2 * w + _norm(w, 1, "hf-amp")
    parts = [("base hidden states as FP8 (the downsamplers' inputs)", (n + 1) * _kept_input_bytes(h))]
    if recompute:
        parts += [("the first downsampler", tail),
                  (f"side layers' inputs (width {w} and {d}; layer, downsampler and mix checkpointed)",
                   n * (2.0 * w + 2.0 * d))]
    else:
        parts += [("downsamplers", (n + 1) * tail), ("gated mixes", n * 2 * 2.0 * w),
                  (f"side decoder layers (width {w})", n * sum(b for _, b in layer_saved(side, "hf-bf16")))]
    return parts + [("upsample input and output", 2.0 * w + 2.0 * h),
                    ("the base's last hidden state (the top mix)", 2.0 * h)]


def base_forward_transient(shape: ModelShape, tokens: int) -> float:
    """The largest working set of one base layer's no-grad forward: its MLP's gate/up output, the
    gated product and its FP8 copy beside the residual stream (bf16)."""
    return (2.0 * 2 * shape.intermediate + 3.0 * shape.intermediate + 4.0 * shape.hidden) * tokens


def side_plan_parts(shape: ModelShape, master_bytes: int, state_bytes: float, tokens: int, chunk_mib: float,
                    device: str) -> tuple[dict[str, float], dict[str, float], list[tuple[str, float]]]:
    """(resident parts, transients at the start of backward and at its end, saved parts per token):
    bytes, for ``coat.memory.plan``."""
    linear = shape.layers * shape.layer_linear_params
    p_side = side_params(shape)
    resident = {"base weights (decoder linears as FP8 codes, the rest bf16)":
                1.0 * linear + 2.0 * (shape.n_params - linear),
                "side network weights (bf16)": 2.0 * p_side, "side network master weights": master_bytes * p_side,
                "side network optimizer states": state_bytes * p_side}
    loss = fused_loss_transient(shape, tokens, chunk_mib, 2, 2, device, head_trains=False)
    side = side_shape(shape)
    # A side layer's backward: its activations and its downsampler's, recomputed, and its MLP's gradients.
    again = sum(b for _, b in layer_saved(side, "hf-bf16")) + 4 * SIDE_DOWNSAMPLE + 2 * side.hidden + _norm(side.hidden, 1, "hf-amp")
    layer_bwd = (again + 6 * side.intermediate + 2 * side.hidden) * tokens
    start = {"fused loss (frozen LM head)": loss, "a side layer's backward (recomputed)": layer_bwd}
    end = {"side network gradients (bf16)": 2.0 * p_side}
    return resident, {"start": max(start.values()), "end": sum(end.values())}, side_saved_per_token(shape)
