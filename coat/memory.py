"""The memory plan of one training step: what is alive at its peak, part by part, for each recipe.

One place for these numbers: ``coat estimate`` prints them, ``coat bench`` prints them beside every
measured peak, and ``tests/python/test_memory.py`` holds them to the code (the saved-activation
tables are counted with saved-tensor hooks on a small model) and to every peak recorded in
``benchmarks/results/bench_e2e*.json``. Pure arithmetic: no torch import.

What a full step (forward with labels -> loss, backward, optimizer step, ``zero_grad(set_to_none=True)``)
holds, and when (``peak`` = what ``torch.cuda.max_memory_allocated`` reports):

- between steps (*resident*): weights, master copy, optimizer states;
- at the start of backward: resident + every saved activation of every layer + what the loss keeps
  (HF's cross-entropy keeps fp32 log-probabilities) + autocast's bf16 weight copies (AMP) + the
  largest transient of that moment (HF's loss backward, or the end of coat's fused loss forward,
  which computes the loss's gradients, or the last layer's backward with the LM head's gradient
  already written);
- at the end of backward / in the optimizer step: resident + every gradient.
Backward trades saved activations for gradients layer by layer, so memory moves linearly between
those two ends and the peak is the larger of them (plus the transients above).

The parts live in modules of their own: the model shapes (``coat.memory_shapes``), the recipes
(``coat.memory_recipes``) and the saved-activation tables with the fused loss's transient
(``coat.memory_activations``); their names are importable from here too. How the constants
taken from measurements were set: docs/memory.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from coat.memory_activations import (ACTIVATION_TABLES, GiB, MiB, NotModeled, fused_loss_transient,
                                     layer_saved, outside_saved, saved_constants)
from coat.memory_recipes import (ADAMW4_BLOCK_STATE_BYTES, ADAMW4_STATE_BYTES, COAT_STATE_BYTES, LORA_RANK, RECIPES, Recipe, recipe,
                                 snsm_state_bytes, snsm_step_transient)
from coat.memory_shapes import MODEL_TYPES, PRESETS, ModelShape, load_shape
from coat.memory_side import side_params, side_plan_parts

__all__ = ["GiB", "MiB", "MODEL_TYPES", "NotModeled", "ModelShape", "PRESETS", "load_shape", "COAT_STATE_BYTES", "Recipe",
           "LORA_RANK", "RECIPES", "recipe", "ACTIVATION_TABLES", "layer_saved", "saved_constants", "outside_saved",
           "fused_loss_transient", "fp8_gathered", "CUDA_WORKSPACE", "CUDA_CONTEXT", "FRAGMENTATION", "Plan", "plan",
           "max_batch", "GPU_RATES", "OPTIMIZER_BYTES", "flops_base", "model_flops", "step_time_floor", "rates_for", "UNIT_FLOPS",
           "auto_fsdp_unit", "fsdp_unit_value"]


#: cuBLAS workspaces taken from the caching allocator (one per thread: forward and autograd's).
CUDA_WORKSPACE = 64 * MiB
#: Memory a GPU needs beyond the allocated peak: the CUDA context and the caching allocator's
#: fragmentation (how they were set: docs/memory.md).
CUDA_CONTEXT = 0.6 * GiB
FRAGMENTATION = 0.06


@dataclass
class Plan:
    """Bytes of each part at the peak of a step, per GPU."""

    model: str
    recipe: str
    batch: int
    seq: int
    gpus: int
    device: str
    n_params: int
    phase: str  # where the peak is: "backward start" or "backward end"
    parts: dict[str, float]  # bytes, summing to ``peak``
    saved_per_layer: list[tuple[str, float]]  # (op, bytes) for one layer at this batch
    peak: float
    other_phase: float  # the peak of the other phase (bytes)
    reserve: float  # beyond the allocated peak: context + fragmentation (fit check only)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def peak_gib(self) -> float:
        return self.peak / GiB

    @property
    def required_gib(self) -> float:
        return (self.peak + self.reserve) / GiB

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["peak_gib"] = round(self.peak_gib, 3)
        d["required_gib"] = round(self.required_gib, 3)
        d["parts_gib"] = {k: round(v / GiB, 3) for k, v in self.parts.items()}
        d["saved_per_layer_gib"] = {k: round(v / GiB, 4) for k, v in self.saved_per_layer}
        del d["saved_per_layer"]
        return d


#: Weights and gradients in the compute dtype (bf16): FSDP2 gathers weights and reduces gradients in it.
_COMPUTE_BYTES = 2


def fp8_gathered(rec: Recipe) -> bool:
    """Whether FSDP2 can gather this recipe's decoder-layer weights as FP8 codes
    (coat.integrations.fsdp.shard(fp8_all_gather=True): FP8 layers with per-tensor scaling)."""
    return rec.fp8_weights and rec.fp8_granularity == "tensor" and not rec.lora and not rec.side


def plan(shape: ModelShape, rec: Recipe | str, batch: int, seq: int, gpus: int = 1, device: str = "cuda",
         fsdp_unit: int = 1, fp8_all_gather: bool = False) -> Plan:
    """The memory plan of one full step at ``batch`` sequences of ``seq`` tokens (per GPU under FSDP2,
    with ``fsdp_unit`` decoder layers per ``fully_shard`` unit: coat.integrations.fsdp.shard;
    ``fp8_all_gather``: the FP8 layers' weights gathered as FP8 codes, not in bf16)."""
    rec = recipe(rec) if isinstance(rec, str) else rec
    _check_step(batch, seq, gpus, device)
    if not isinstance(fsdp_unit, int) or not 1 <= fsdp_unit <= shape.layers:
        raise ValueError(f"fsdp_unit must be an integer from 1 to the model's {shape.layers} layers, got {fsdp_unit!r}")
    if rec.side:
        return _side_plan(shape, rec, batch, seq, gpus, device)
    s, n, t = shape, shape.n_params, batch * seq
    fsdp = gpus > 1
    table = rec.fsdp_activations if fsdp else rec.activations
    if rec.lora and fsdp:
        raise ValueError(f"--recipe {rec.name}: LoRA is modeled on one GPU (coat bench runs it without --fsdp)")
    if rec.snsm_rank and fsdp:
        raise ValueError(f"--recipe {rec.name}: coat.optim.SubsetNormSM does not support FSDP2 (a shard holds "
                         "only part of a matrix's rows or columns); use --gpus 1")
    adapters = s.lora_params(LORA_RANK) if rec.lora else 0
    weights, master, states, grads = _persistent(s, rec, gpus, adapters)
    layer_ops = layer_saved(s, table, rec.fp8_granularity)
    const_layer, const_outside = saved_constants(s, table, rec.fused_loss)
    per_layer = sum(b for _, b in layer_ops) * t + const_layer
    outside = sum(b for _, b in outside_saved(s, table, rec.fused_loss)) * t + const_outside

    # Transients at the start of backward (the fused loss: at the end of its forward), beyond what is saved.
    head = s.head_params or s.embed_params
    head_bytes = _COMPUTE_BYTES if fsdp else rec.grad_bytes  # the LM head's gradient
    loss_tr = _loss_transient(s, rec, table, t, head_bytes, device)
    # Written before the first layer's backward; LoRA: the LM head is frozen.
    head_grad = 0.0 if rec.lora else head_bytes * head
    layer_tr, weight_tr = _layer_transients(s, rec, table, t)
    copies = 2.0 * (s.layers * s.layer_linear_params + head) if rec.weight_copies and not fsdp else 0.0
    fsdp_tr, fsdp_end = _fsdp_transients(s, rec, fsdp_unit, fp8_all_gather) if fsdp else (0.0, 0.0)
    work = CUDA_WORKSPACE if device == "cuda" else 0.0

    resident = weights + 4.0 * adapters + master + states
    # Backward begins with the loss (everything saved is alive), then the last layer runs with the
    # LM head's gradient written and what was saved outside the layers already freed.
    layers_saved = per_layer * s.layers
    adapter_copies = 2.0 * adapters if table == "coat-lora" else 0.0  # bf16, kept for the adapters' backward
    # SubsetNormSM's step (its largest matrix's refresh or update slice): under release beside the
    # gradients of the bucket it steps (the LM head's, or a layer's), else after backward.
    step_tr = snsm_step_transient(s, rec.snsm_rank) if rec.snsm_rank else 0.0
    if rec.grad_release:
        last_layer, live_grads = _released(s, rec, gpus, head_grad, layer_tr, weight_tr, fsdp_unit)
        if step_tr:
            last_layer = max(last_layer, max(head_grad, rec.grad_bytes * s.layer_params) + step_tr)
    else:
        last_layer, live_grads = head_grad + layer_tr + weight_tr, grads + step_tr
    start_tr = max(outside + loss_tr, last_layer)
    start = resident + copies + layers_saved + adapter_copies + start_tr + fsdp_tr + work
    end = resident + live_grads + fsdp_end + work
    common = {"weights": weights, "master weights": master, "optimizer states": states}
    if rec.lora:
        common["LoRA adapters (fp32)"] = 4.0 * adapters
    if start >= end:
        phase = "backward start"
        parts = {**common, "gradients": 0.0, "autocast bf16 weight copies": copies,
                 f"saved activations ({s.layers} layers)": layers_saved, "LoRA adapters' bf16 copies": adapter_copies,
                 _start_part(rec, fsdp, outside + loss_tr >= last_layer): start_tr,
                 "FSDP2 gathered weights/gradients": fsdp_tr, "cuBLAS workspaces": work}
    else:
        phase = "backward end"
        parts = {**common, "gradients": live_grads, "autocast bf16 weight copies": 0.0,
                 "FSDP2 gathered weights/gradients": fsdp_end,
                 "cuBLAS workspaces": work}
    peak = max(start, end)
    reserve = (CUDA_CONTEXT + FRAGMENTATION * peak) if device == "cuda" else 0.0
    return Plan(model=s.name, recipe=rec.name, batch=batch, seq=seq, gpus=gpus, device=device, n_params=n,
                phase=phase, parts=parts, saved_per_layer=[(op, b * t) for op, b in layer_ops], peak=peak,
                other_phase=min(start, end), reserve=reserve,
                extra={"resident": resident, "saved_per_token_layer": per_layer / t,
                       "fp8_weight_transient": weight_tr})


def _side_plan(s: ModelShape, rec: Recipe, batch: int, seq: int, gpus: int, device: str) -> Plan:
    """``plan`` of a side-tuning step (coat.memory_side): resident, everything the side network saved
    and the larger transient at the start of backward, or resident and its gradients at the end."""
    if gpus > 1:
        raise ValueError(f"--recipe {rec.name}: side tuning runs on one GPU (coat.SideTuned has no FSDP2)")
    if device != "cuda":
        raise NotModeled(f"--recipe {rec.name}: side tuning is modeled on CUDA only")
    t = batch * seq
    resident, tr, saved = side_plan_parts(s, rec.master_bytes, rec.state_bytes, t, rec.loss_chunk_mib, device)
    saved_bytes = sum(b for _, b in saved) * t
    res = sum(resident.values())
    start = res + saved_bytes + tr["start"] + CUDA_WORKSPACE
    end = res + tr["end"] + CUDA_WORKSPACE
    if start >= end:
        phase, parts = "backward start", {**resident, "side network's saved activations": saved_bytes,
                                          "fused loss or a side layer's backward": tr["start"]}
    else:
        phase, parts = "backward end", {**resident, "side network gradients": tr["end"]}
    parts["cuBLAS workspaces"] = CUDA_WORKSPACE
    peak = max(start, end)
    return Plan(model=s.name, recipe=rec.name, batch=batch, seq=seq, gpus=gpus, device=device, n_params=s.n_params,
                phase=phase, parts=parts, saved_per_layer=[(op, b * t / s.layers) for op, b in saved], peak=peak,
                other_phase=min(start, end), reserve=CUDA_CONTEXT + FRAGMENTATION * peak,
                extra={"resident": res, "saved_per_token_layer": sum(b for _, b in saved) / s.layers,
                       "fp8_weight_transient": 0.0})


def _check_step(batch: int, seq: int, gpus: int, device: str) -> None:
    for name, v in (("batch", batch), ("seq", seq), ("gpus", gpus)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")


def _persistent(s: ModelShape, rec: Recipe, gpus: int, adapters: int) -> tuple[float, float, float, float]:
    """Bytes of the weights, the master copy, the optimizer states and every gradient, per GPU."""
    n = s.n_params
    weights = rec.param_bytes * n / gpus
    if rec.lora and rec.fp8_weights:  # the decoder linears as E4M3 codes (1 byte), the rest as it was
        linear = s.layers * s.layer_linear_params
        weights = 1.0 * linear + rec.param_bytes * (n - linear)
    master = rec.master_bytes * n / gpus
    if rec.lora:  # fp32 adapters, torch AdamW's fp32 states and fp32 gradients; the base frozen
        return weights, master, 8.0 * adapters, 4.0 * adapters
    states = snsm_state_bytes(s, rec.snsm_rank) if rec.snsm_rank else rec.state_bytes * n
    return weights, master, states / gpus, rec.grad_bytes * n / gpus


def _loss_transient(s: ModelShape, rec: Recipe, table: str, t: int, head_bytes: int, device: str) -> float:
    """What the loss adds at the start of backward (the fused loss: at the end of its forward)."""
    if rec.fused_loss:
        return fused_loss_transient(s, t, rec.loss_chunk_mib, 4 if table == "hf-amp" else 2, head_bytes, device,
                                    head_trains=not rec.lora)
    return 8.0 * s.vocab * t  # cross-entropy backward: gradient of the log-probabilities and of the logits (fp32)


def _layer_transients(s: ModelShape, rec: Recipe, table: str, t: int) -> tuple[float, float]:
    """The largest transient of one layer's backward, and the FP8 weight codes beside it."""
    h, i = s.hidden, s.intermediate
    if table in ("coat", "coat-lora"):
        # SwiGLU backward (mlp.py): dh, d(gate/up) and the recomputed h together, the E5M2 transposed
        # gradient, and the gradient flowing in; then the gate/up block quantizes d(gate/up) (8I too).
        layer_tr = (8 * i + 3 * h) * t
    else:
        layer_tr = (6 * i + (4 if table == "hf-amp" else 2) * h) * t  # d(product), d(silu), d(up), d(gate)
    weight_tr = 0.0
    if rec.fp8_weights:
        # coat/nn/weights.py: the FP8 codes of a weight live only while its GEMM runs (forward codes,
        # then transposed codes in backward), so one fused weight's worth at a time.
        weight_tr = 1.0 * s.largest_fused_weight
    elif table == "hf-amp":
        weight_tr = 2.0 * s.intermediate * s.hidden  # a bf16 weight gradient before its cast to fp32
    return layer_tr, weight_tr


def _fsdp_transients(s: ModelShape, rec: Recipe, unit: int = 1, fp8_all_gather: bool = False) -> tuple[float, float]:
    """FSDP2's gathered weights at the start of backward: the root module's (embedding, head, final
    norm) for the whole step, and two units of ``unit`` layers (the running one and the prefetched
    one: at most every layer, when a unit holds more than half of them), their linear weights as
    FP8 codes under FP8 all-gather; in backward one unit's unsharded gradients, plus their copy in
    the reduce dtype. Then what of it is alive at the end of backward."""
    compute = _COMPUTE_BYTES
    root = s.embed_params + s.head_params + s.hidden
    reduce_copy = rec.fsdp_reduce_bytes if rec.fsdp_reduce_bytes != compute else 0
    gathered = min(2 * unit, s.layers)
    layer = compute * s.layer_params
    if fp8_all_gather and fp8_gathered(rec):  # one byte per linear weight, the norms' in bf16
        layer -= (compute - 1) * s.layer_linear_params
    start = compute * root + gathered * layer + (compute + reduce_copy) * unit * s.layer_params
    return start, (compute + reduce_copy) * (s.embed_params + s.head_params)


def _released(s: ModelShape, rec: Recipe, gpus: int, head_grad: float, layer_tr: float,
              weight_tr: float, unit: int = 1) -> tuple[float, float]:
    """With gradient release: the last layer's backward, and the gradients alive at the end of backward.

    coat.optim.step_in_backward: a bucket (a decoder layer, the LM head, the embedding) is stepped
    and its gradients freed as soon as the last of them lands; autograd runs a parameter's
    AccumulateGrad as soon as it is ready, so the LM head's gradient is gone before the last
    layer's backward starts. Beside a layer's largest transient (its MLP's backward, the first part
    of it) live the MLP's gradients; the whole layer's once its attention is done, with smaller
    transients. Under FSDP2 the root's unsharded gradients (LM head, embedding) wait for its
    reduce-scatter at the end of backward, as without release; the sharded gradients of one FSDP
    group (``unit`` layers) are what is released at a time."""
    last_layer = head_grad + layer_tr + weight_tr
    if gpus > 1:
        last_layer += rec.grad_bytes * unit * s.layer_params / gpus
        return last_layer, rec.grad_bytes * max(unit * s.layer_params, s.embed_params + s.head_params + s.hidden) / gpus
    h, i = s.hidden, s.intermediate
    mlp = 3 * h * i + (2 * i + h if s.mlp_bias else 0)
    layer = max(rec.grad_bytes * mlp + layer_tr + weight_tr, rec.grad_bytes * s.layer_params)
    # A tied LM head is the embedding: its gradient waits for the embedding's backward, the last.
    last_layer = head_grad + layer if s.tied else max(head_grad, layer)
    return last_layer, rec.grad_bytes * max(s.layer_params, s.head_params or s.embed_params, s.embed_params)


def _start_part(rec: Recipe, fsdp: bool, loss_first: bool) -> str:
    """The name of the largest transient at the start of backward."""
    if loss_first:
        return "saved outside layers + loss backward"
    if rec.grad_release and not fsdp:
        return "a layer's gradients + its backward"
    if rec.lora:  # the LM head is frozen: no gradient of it
        return "last layer's backward"
    return "LM head gradient + last layer's backward"


#: Decoder-GEMM FLOPs per GPU and step that one FSDP2 unit should carry under ``fsdp_unit="auto"``.
#: The host spends a few ms per unit and step on FSDP2's hooks and collectives (benchmarks/RESULTS.md
#: sections 25 and 41); 15 TFLOP is 20-30 ms of coat's FP8 GEMMs on an H100/H200, enough to hide it.
UNIT_FLOPS = 1.5e13


def fsdp_unit_value(text: str) -> int | str:
    """What ``--fsdp-unit`` takes (coat train, bench, estimate): "auto" or a positive integer."""
    if text == "auto":
        return text
    try:
        k = int(text)
    except (TypeError, ValueError):
        k = 0
    if k < 1:
        raise ValueError(f"must be auto or a positive integer (decoder layers per FSDP2 unit), got {text!r}")
    return k


def auto_fsdp_unit(shape: ModelShape, rec: Recipe | str | None, batch: int, seq: int, gpus: int,
                   memory_gib: float | None, fp8_all_gather: bool = False) -> int:
    """Decoder layers per FSDP2 unit for ``--fsdp-unit auto``: the fewest (a power of two, at most
    the model's layers; the largest such when none reaches it) whose GEMMs reach ``UNIT_FLOPS`` per
    GPU and step, halved while the plan's
    peak plus reserve exceeds ``memory_gib`` (K layers' weights are gathered at a time). A recipe the
    plan does not model (``None``, a name outside its vocabulary, a plan it refuses) is sized by its
    GEMMs alone. One GPU, or ``memory_gib=None`` (no CUDA GPU: the rule is about a GPU's
    host overhead), gives 1."""
    if gpus <= 1 or memory_gib is None:
        return 1
    try:
        rec = recipe(rec) if isinstance(rec, str) else rec
    except ValueError:
        rec = None
    per_layer = model_flops(shape, batch, seq, "frozen" if rec and rec.lora else "trained")[0] / shape.layers
    k = 1
    while 2 * k <= shape.layers and k * per_layer < UNIT_FLOPS:
        k *= 2
    try:
        while rec is not None and k > 1 and \
                plan(shape, rec, batch, seq, gpus, "cuda", k, fp8_all_gather).required_gib > memory_gib:
            k //= 2
    except ValueError:  # NotModeled, or a plan refused for this recipe (LoRA under FSDP2)
        pass
    return k


#: max_batch searches no further (a larger batch that fits is reported as this one)
MAX_BATCH_SEARCHED = 1 << 16


def max_batch(shape: ModelShape, rec: Recipe | str, seq: int, memory_gib: float, gpus: int = 1,
              device: str = "cuda", limit: int = MAX_BATCH_SEARCHED, fsdp_unit: int | str = 1,
              fp8_all_gather: bool = False) -> int:
    """The largest batch (sequences per GPU) whose peak plus reserve fits in ``memory_gib``; 0 if none.
    ``fsdp_unit="auto"``: each batch at its own ``auto_fsdp_unit``."""
    cap = memory_gib * GiB

    def fits(b: int) -> bool:
        unit = auto_fsdp_unit(shape, rec, b, seq, gpus, memory_gib, fp8_all_gather) if fsdp_unit == "auto" \
            else fsdp_unit
        p = plan(shape, rec, b, seq, gpus, device, unit, fp8_all_gather)
        return p.peak + p.reserve <= cap

    if not fits(1):
        return 0
    lo = 1
    while lo < limit and fits(min(2 * lo, limit)):
        lo = min(2 * lo, limit)
    hi = min(2 * lo, limit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# ---- time per step (roofline) -----------------------------------------------------------------------

#: Dense bf16 and FP8 GEMM FLOP/s and device copy B/s per GPU, from benchmarks/RESULTS.md (its first section).
#: "peak_bf16": the datasheet's dense BF16 FLOP/s (SXM), the denominator of model-FLOPs utilization (MFU).
GPU_RATES: dict[str, dict[str, Any]] = {
    "h200": {"bf16": 780e12, "fp8": 1470e12, "bw": 4.25e12, "memory_gib": 139.8, "peak_bf16": 989.4e12,
             "source": "measured on an H200 (benchmarks/RESULTS.md)"},
    "h100": {"bf16": 780e12, "fp8": 1470e12, "bw": 3.0e12, "memory_gib": 79.2, "peak_bf16": 989.4e12,
             "source": "H100 80 GB: the H200's GEMM rates (the same compute die; benchmarks/RESULTS.md), copy ~90% "
                     "of its 3.35 TB/s"},
}

#: Bytes per parameter that the optimizer step reads and writes.
OPTIMIZER_BYTES = {"amp": 28.0, "bf16": 14.0, "coat": 4 + 2 + COAT_STATE_BYTES + 4 + 2 + COAT_STATE_BYTES,
                   "coat-lean": 2 + 2 + COAT_STATE_BYTES + 2 + COAT_STATE_BYTES,
                   # AdamW4bit reads the gradient and v's codes once more to find v's new row and
                   # column maxima (2.5 B with bf16 gradients)
                   "coat4bit": 4 + 2 + ADAMW4_STATE_BYTES + 4 + 2 + ADAMW4_STATE_BYTES + 2.5,
                   "coat4bit-lean": 2 + 2 + ADAMW4_STATE_BYTES + 2 + ADAMW4_STATE_BYTES + 2.5,
                   # +v-block: no statistics pass
                   "coat4bit+v-block": 4 + 2 + ADAMW4_BLOCK_STATE_BYTES + 4 + 2 + ADAMW4_BLOCK_STATE_BYTES,
                   "coat4bit-lean+v-block": 2 + 2 + ADAMW4_BLOCK_STATE_BYTES + 2 + ADAMW4_BLOCK_STATE_BYTES}


def flops_base(setup: str) -> str:
    """model_flops' base of a recipe or bench setup name: LoRA's frozen base computes no weight
    gradients, side tuning's runs forward only."""
    parts = setup.split("+")
    return "frozen" if "lora" in parts else "forward" if "side" in parts else "trained"


def model_flops(shape: ModelShape, batch: int, seq: int, base: str = "trained") -> tuple[float, float, float]:
    """FLOPs of one training step on ``batch`` sequences of ``seq`` tokens: (decoder linears, LM
    head, attention). ``base``: "trained" (every GEMM), "frozen" (no weight gradients: LoRA) or
    "forward" (side tuning: the base runs forward only; the thin side network is not counted)."""
    t = batch * seq
    # 2 FLOPs per parameter and token forward, 2 for the input gradient, 2 for the weight gradient,
    # which a frozen base does not compute; LoRA's adapters' GEMMs are rank-thin (not counted).
    per = {"trained": 6.0, "frozen": 4.0, "forward": 2.0}[base]
    dec = per * shape.layers * shape.layer_linear_params * t
    head = per * (shape.head_params or shape.embed_params) * t
    # Causal attention: QK^T and PV, half the square, backward 2.5x the forward.
    attn = (1.0 if base == "forward" else 3.5) * 2.0 * batch * seq * seq * shape.q_width * shape.layers
    return dec, head, attn


def step_time_floor(shape: ModelShape, rec: Recipe | str, batch: int, seq: int, rates: dict[str, float],
                    gpus: int = 1) -> dict[str, float]:
    """A lower bound on the time of one step per GPU: GEMM and attention FLOPs at ``rates``' GEMM
    rates, plus the optimizer step at copy bandwidth (element-wise kernels, host time and FSDP2
    communication not counted)."""
    rec = recipe(rec) if isinstance(rec, str) else rec
    t = batch * seq
    dec, head, attn = model_flops(shape, batch, seq, flops_base(rec.name))
    dec_rate = rates["fp8"] if rec.fp8_weights else rates["bf16"]
    gemm_s = dec / dec_rate + (head + attn) / rates["bf16"]
    if rec.lora:  # torch AdamW over the fp32 adapters: as amp's optimizer, per adapter parameter
        opt_s = OPTIMIZER_BYTES["amp"] * shape.lora_params(LORA_RANK) / rates["bw"]
    elif rec.side:  # the side network's optimizer only (the base is frozen)
        opt_s = OPTIMIZER_BYTES.get(rec.name.split("+")[0], 14.0) * side_params(shape) / rates["bw"]
    else:
        base = rec.name.split("+")[0] + ("+v-block" if rec.v_scaling == "block" else "")
        opt_s = OPTIMIZER_BYTES.get(base, 14.0) * shape.n_params / gpus / rates["bw"]
    total = gemm_s + opt_s
    return {"step_ms": total * 1e3, "gemm_ms": gemm_s * 1e3, "optimizer_ms": opt_s * 1e3,
            "tokens_per_s": t / total, "tflops": (dec + head + attn) / 1e12}


def rates_for(device_name: str) -> dict[str, Any] | None:
    """The GPU_RATES entry whose key occurs in a device name (``torch.cuda.get_device_name``)."""
    low = device_name.lower()
    for key, r in GPU_RATES.items():
        if key in low:
            return r
    return None

