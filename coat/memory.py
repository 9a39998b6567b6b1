"""The memory plan of one training step: what is alive at its peak, part by part, for each recipe.

One place for these numbers: ``coat estimate`` prints them, ``coat bench`` prints them beside every
measured peak, and ``tests/python/test_memory.py`` holds them to the code (the saved-activation
tables are counted with saved-tensor hooks on a small model) and to every peak recorded in
``benchmarks/results/bench_e2e*.json``. Pure arithmetic: no torch import, microseconds per plan.

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
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from coat import recipes as names

GiB = float(1 << 30)
MiB = float(1 << 20)

#: Model types whose decoder layers the tables below describe (the ones ``coat.convert`` takes).
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


# ---- model shapes -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family causal LM, as far as memory is concerned."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int = 0  # 0: hidden // heads
    tied: bool = False  # LM head shares the embedding matrix
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False  # Llama attention_bias=True
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    model_type: str = "llama"

    def __post_init__(self) -> None:
        for f in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"model shape {self.name!r}: {f} must be a positive integer, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model shape {self.name!r}: heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads})")
        if not self.head_dim:
            if self.hidden % self.heads:
                raise ValueError(f"model shape {self.name!r}: hidden ({self.hidden}) is not a multiple of heads "
                                 f"({self.heads}); give head_dim")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_linear_params(self) -> int:
        h, q, kv, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        return h * (q + 2 * kv) + q * h + 3 * h * i

    @property
    def layer_params(self) -> int:
        extra = 2 * self.hidden  # the two RMSNorm weights
        if self.qk_norm:
            extra += 2 * self.head_dim
        if self.qkv_bias:
            extra += self.q_width + 2 * self.kv_width
        if self.o_bias:
            extra += self.hidden
        if self.mlp_bias:
            extra += 2 * self.intermediate + self.hidden
        return self.layer_linear_params + extra

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def n_params(self) -> int:
        return self.layers * self.layer_params + self.embed_params + self.head_params + self.hidden

    def lora_params(self, rank: int) -> int:
        """Parameters of rank-``rank`` LoRA adapters (A: rank x in, B: out x rank) on every decoder
        linear (q, k, v, o, gate, up, down)."""
        h, q, kv, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        return self.layers * rank * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))

    @property
    def largest_fused_weight(self) -> int:
        """Parameters of the largest weight one FP8 GEMM consumes (gate/up, or q/k/v, fused)."""
        h = self.hidden
        return max(2 * self.intermediate * h, (self.q_width + 2 * self.kv_width) * h, self.intermediate * h)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "config") -> "ModelShape":
        """From a Hugging Face ``config.json`` dictionary (Llama, Mistral, Qwen2, Qwen3)."""
        mt = cfg.get("model_type")
        if mt not in MODEL_TYPES:
            raise ValueError(f"{name}: model_type {mt!r} is not one of {', '.join(MODEL_TYPES)}")
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if k not in cfg]
        if missing:
            raise ValueError(f"{name}: config has no {', '.join(missing)}")
        heads = cfg["num_attention_heads"]
        return cls(
            name=cfg.get("_name_or_path") or name, hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
            heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads, intermediate=cfg["intermediate_size"],
            vocab=cfg["vocab_size"], head_dim=cfg.get("head_dim") or 0,
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)) or mt == "qwen2",
            o_bias=bool(cfg.get("attention_bias", False)) and mt in ("llama", "qwen3"),
            mlp_bias=bool(cfg.get("mlp_bias", False)), qk_norm=mt == "qwen3", model_type=mt)

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` fields that rebuild this shape with transformers (random init)."""
        cfg = dict(model_type=self.model_type, hidden_size=self.hidden, num_hidden_layers=self.layers,
                   num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                   intermediate_size=self.intermediate, vocab_size=self.vocab, head_dim=self.head_dim,
                   tie_word_embeddings=self.tied, mlp_bias=self.mlp_bias)
        if self.model_type in ("llama", "qwen3"):
            cfg["attention_bias"] = self.o_bias
        return cfg


def _shape(name, h, layers, heads, kv, inter, vocab, **kw) -> ModelShape:
    return ModelShape(name=name, hidden=h, layers=layers, heads=heads, kv_heads=kv, intermediate=inter, vocab=vocab,
                      **kw)


#: Shapes of published models (their config.json), and two small ones for CPU runs.
PRESETS: dict[str, ModelShape] = {s.name: s for s in (
    _shape("llama2-7b", 4096, 32, 32, 32, 11008, 32000),
    _shape("llama2-13b", 5120, 40, 40, 40, 13824, 32000),
    _shape("llama2-70b", 8192, 80, 64, 8, 28672, 32000),
    _shape("llama3-8b", 4096, 32, 32, 8, 14336, 128256),
    _shape("llama3-70b", 8192, 80, 64, 8, 28672, 128256),
    _shape("mistral-7b", 4096, 32, 32, 8, 14336, 32000, model_type="mistral"),
    _shape("qwen2-7b", 3584, 28, 28, 4, 18944, 152064, qkv_bias=True, model_type="qwen2"),
    _shape("qwen3-8b", 4096, 36, 32, 8, 12288, 151936, head_dim=128, qk_norm=True, model_type="qwen3"),
    # CPU-sized: widths multiples of 16 (FP8 groups), GQA, so every code path of the big ones runs.
    _shape("tiny", 256, 2, 4, 2, 688, 1024),
    _shape("small", 512, 4, 8, 4, 1376, 4096),
)}


def load_shape(model: str) -> ModelShape:
    """A preset name, a ``config.json`` path, or a checkpoint folder holding one."""
    if model in PRESETS:
        return PRESETS[model]
    path = model
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"--model {model!r}: the folder has no config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json / "
                         "checkpoint folder")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--model {model!r}: cannot read {path}: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"--model {model!r}: {path} does not hold a JSON object")
    if "text_config" in cfg and "hidden_size" not in cfg:  # multimodal wrappers keep the LM here
        cfg = cfg["text_config"]
    try:
        return ModelShape.from_hf_config(cfg, name=os.path.basename(os.path.dirname(os.path.abspath(path))) or model)
    except ValueError as e:
        raise ValueError(f"--model {model!r}: {e}") from None


# ---- recipes ----------------------------------------------------------------------------------------

#: coat.optim.AdamW: per moment 1 byte of FP8 code + per 128-element group a fp32 max and a 1-byte exponent.
COAT_STATE_BYTES = 2 * (1 + 5 / 128)


@dataclass(frozen=True)
class Recipe:
    """How a recipe stores a step: bytes per parameter of each persistent part, which saved-activation
    table its layers follow, and which transients it adds. One entry of ``RECIPES`` per recipe of
    ``coat.recipes`` that is modeled (or a ``with_modes`` variant): names and their meaning are there."""

    name: str
    summary: str
    param_bytes: int  # the model's weights
    master_bytes: int  # a separate master copy held by the optimizer (fp32 master of bf16 weights)
    state_bytes: float  # optimizer states
    grad_bytes: int
    activations: str  # key of ``ACTIVATION_TABLES``
    fsdp_activations: str  # the table under FSDP2 (AMP computes with bf16 weights gathered in bf16)
    weight_copies: bool = False  # autocast's bf16 copy of each linear weight, saved for backward
    fp8_weights: bool = False  # FP8 GEMMs: the largest fused weight exists in FP8 while its op runs
    fsdp_reduce_bytes: int = 2  # FSDP2 reduce-scatter dtype
    grad_release: bool = False  # optimizer step inside backward: one layer's gradients at a time
    fused_loss: bool = False  # LM head + cross-entropy chunked over tokens: no full logits
    # coat/nn/loss.py's default chunk: compute-dtype (bf16) logits of one chunk at most this many MiB.
    loss_chunk_mib: float = 512.0
    # The step replayed from CUDA graphs: the same plan (a replay allocates nothing beyond what the
    # captured eager step did; benchmarks/results hold the +graph peaks within 10% of it).
    graph: bool = False
    # LoRA (coat bench's setups): rank-LORA_RANK adapters on every decoder linear, fp32 (PEFT casts
    # the adapters of a bf16 model to fp32), torch AdamW over them; the base (weights at
    # param_bytes) frozen, so it has no master copy, states or gradients.
    lora: bool = False

    def with_modes(self, *, grad_release: bool | None = None, fused_loss: bool | None = None,
                   graph: bool | None = None, lora: bool | None = None) -> "Recipe":
        """This recipe with gradient release, the fused loss, CUDA graphs and/or LoRA switched on or
        off (named ``<name>+release``, ``+fused-loss`` where the base recipe has none, ``+hf-loss``
        where it has one and it is switched off, ``+graph``, ``+lora``)."""
        r = replace(self, grad_release=self.grad_release if grad_release is None else grad_release,
                    fused_loss=self.fused_loss if fused_loss is None else fused_loss,
                    graph=self.graph if graph is None else graph, lora=self.lora if lora is None else lora)
        base = self.name.split("+")[0]
        if r.lora and not self.lora:
            # coat bench's two LoRA setups, with their own loss paths: bf16+lora (PEFT on Hugging Face's
            # layers) and coat+lora (PEFT on coat.convert's layers, the base kept only in FP8:
            # convert(frozen_weights="fp8"), the fused loss).
            if r.grad_release or (base, r.fused_loss) not in (("bf16", False), ("coat", True)):
                raise ValueError(f"--recipe {r.name}+lora: LoRA is modeled for bf16+lora and coat+lora (coat "
                                 "bench's setups) only")
            table, base_summary = {"bf16": ("hf-bf16-lora", "bf16 weights"),
                                   "coat": ("coat-lora", "coat.convert, decoder weights in FP8 only")}[base]
            r = replace(r, activations=table, fsdp_activations=table, master_bytes=0, state_bytes=0, grad_bytes=0,
                        summary=f"{base_summary} (the base, frozen), PEFT LoRA r={LORA_RANK} on every decoder "
                        "linear (fp32 adapters, torch AdamW)")
        default_fused = RECIPES[base].fused_loss if base in RECIPES else self.fused_loss
        mods = {"release": r.grad_release, "fused-loss": r.fused_loss and not default_fused,
                "hf-loss": default_fused and not r.fused_loss, "graph": r.graph, "lora": r.lora}
        return replace(r, name=names.Setup(base, tuple(m for m in names.MODES if mods.get(m))).name)


#: The rank of ``+lora`` setups (coat bench's LoRA setups: r=16 on every decoder linear).
LORA_RANK = 16

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("amp", "fp32 weights, bf16 autocast, torch.optim.AdamW(fused=True)", 4, 0, 8, 4, "hf-amp", "hf-bf16",
           weight_copies=True, fsdp_reduce_bytes=4),
    Recipe("bf16", "bf16 weights, torch.optim.AdamW(fused=True) (bf16 states)", 2, 0, 4, 2, "hf-bf16", "hf-bf16"),
    # coat.convert installs the fused LM head + loss by default.
    Recipe("coat", "bf16 weights, coat.convert, coat.optim.AdamW (FP8 states, fp32 master)", 2, 4, COAT_STATE_BYTES,
           2, "coat", "coat", fp8_weights=True, fused_loss=True),
    Recipe("coat-lean", "bf16 weights, coat.convert, coat.optim.AdamW(master_weights='bf16_sr')", 2, 0,
           COAT_STATE_BYTES, 2, "coat", "coat", fp8_weights=True, fused_loss=True),
)}


def recipe(name: str) -> Recipe:
    """The plan of setup ``name`` (``coat.recipes``): ``RECIPES[name]``, or a ``with_modes``
    variant (``+release``, ``+fused-loss``, ``+hf-loss``, ``+graph``). ``ValueError`` naming
    --recipe for a name that is unknown or not modeled."""
    s = names.parse(name)
    if s.recipe not in RECIPES:
        peer = s.recipe in names.PEERS
        kind, what = ("setup", names.PEERS[s.recipe]) if peer else ("recipe", names.RECIPES[s.recipe])
        raise ValueError(f"--recipe {name!r}: {kind} {s.recipe} ({what}) has no memory model (modeled: "
                         f"{', '.join(RECIPES)})")
    r = RECIPES[s.recipe]
    if not s.modes:
        return r
    fused = True if s.has("fused-loss") else False if s.has("hf-loss") else None
    return r.with_modes(grad_release=True if s.has("release") else None, fused_loss=fused,
                        graph=True if s.has("graph") else None, lora=True if s.has("lora") else None)


# ---- saved activations -------------------------------------------------------------------------------
# Bytes per token saved for backward, by op, derived from the code: Hugging Face's LlamaDecoderLayer
# (RMSNorm keeps an fp32 copy of its input, its rstd and the normalized bf16 tensor; the projections
# keep their inputs; SDPA keeps q, k, v, out and the log-sum-exp; SiLU*up keeps gate, silu(gate), up
# and the product) and coat/nn (fused.py, mlp.py, attention.py, norm.py: FP8 copies with 1x16 group
# scales, recomputed norms and SwiGLU outputs). Tests count them with saved-tensor hooks.


def _norm(width: int, rows: int, table: str) -> float:
    """HF RMSNorm over ``width`` (``rows`` rstd values per token)."""
    if table == "hf-amp":  # fp32 input is its own fp32 copy; the normalized tensor stays fp32
        return 4 * width + 4 * rows + 4 * width
    return 4 * width + 4 * rows + 2 * width


def _fp8_norm_input(width: int, rows: int) -> float:
    """coat's fused/FP8 RMSNorm: E4M3 input, fp32 scale per 16, fp32 rstd per row."""
    return width + width / 16 * 4 + 4 * rows


def layer_saved(shape: ModelShape, table: str) -> list[tuple[str, float]]:
    """(op, bytes per token) saved by one decoder layer."""
    h, q, kv, i, nh = shape.hidden, shape.q_width, shape.kv_width, shape.intermediate, shape.heads
    sdpa = 2 * q + 4 * kv + 2 * q + 4 * nh  # q, k, v, out (bf16), log-sum-exp (fp32 per head)
    if table in ("hf-bf16", "hf-amp"):
        casts = 1 if table == "hf-bf16" else 3  # under autocast each projection casts its input anew
        ops = [("input RMSNorm", _norm(h, 1, table)), ("q/k/v input", 2 * h * casts)]
        if shape.qk_norm:
            ops.append(("q/k RMSNorm", _norm(q, nh, "hf-bf16") + _norm(kv, shape.kv_heads, "hf-bf16")))
        ops += [("attention (SDPA)", sdpa), ("post-attention RMSNorm", _norm(h, 1, table)),
                ("gate/up input", 2 * h * (1 if table == "hf-bf16" else 2)),
                ("SwiGLU (gate, silu, up, product)", 8 * i)]
        return ops
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
        ops = [("input RMSNorm + q/k/v (FP8 norm input)", _fp8_norm_input(h, 1))]
        if shape.qk_norm:
            ops.append(("q/k RMSNorm (FP8 input)", _fp8_norm_input(q, nh) + _fp8_norm_input(kv, shape.kv_heads)))
        ops += [("attention (SDPA)", sdpa), ("o_proj input (FP8, transposed)", q),
                ("post-attention RMSNorm + gate/up (FP8 norm input)", _fp8_norm_input(h, 1)),
                ("SwiGLU + down (FP8 gate/up, 1x16 scales)", 2 * i + 2 * i / 16 * 4)]
        if table == "coat-lora":
            # The FP8-frozen base (coat/nn/frozen.py): o_proj keeps no input for a weight gradient;
            # the adapters (coat/nn/adapters.py) keep their bf16 inputs (q/k/v's and gate/up's shared,
            # o's is the attention output, already kept; down's the SwiGLU product) and A's bf16
            # outputs. Their bf16 weight copies are counted apart (per layer, not per token).
            ops = [op for op in ops if not op[0].startswith("o_proj")]
            ops += [("LoRA inputs, bf16 (q/k/v, gate/up, down)", 4 * h + 2 * i), ("LoRA A outputs, bf16", 7 * 2 * LORA_RANK)]
        return ops
    raise ValueError(f"unknown activation table {table!r}")


def outside_saved(shape: ModelShape, table: str, fused_loss: bool) -> list[tuple[str, float]]:
    """(op, bytes per token) saved outside the decoder layers: token ids, final norm, LM head, loss."""
    h, v = shape.hidden, shape.vocab
    resid = "hf-amp" if table == "hf-amp" else "hf-bf16"  # the final norm stays Hugging Face's
    if table == "coat-lora":  # and a frozen embedding keeps no token ids
        return []
    if fused_loss:  # coat/nn/loss.py saves nothing: its gradients, made in its forward, are in loss_transient
        return [("token ids", 8.0)]
    if table == "hf-bf16-lora":  # a frozen final norm and LM head keep neither their output nor their input
        return [("token ids", 8.0), ("final RMSNorm (frozen)", 4.0 * h + 4), ("cross-entropy log-probabilities (fp32)",
                                                                              4.0 * v)]
    return [("token ids and labels", 16.0), ("final RMSNorm", _norm(h, 1, resid)), ("LM head input", 2 * h),
            ("cross-entropy log-probabilities (fp32)", 4 * v)]


ACTIVATION_TABLES = ("hf-bf16", "hf-amp", "coat", "hf-bf16-lora", "coat-lora")


def fused_loss_transient(shape: ModelShape, tokens: int, chunk_mib: float, x_bytes: int, grad_bytes: int,
                         device: str = "cuda", head_trains: bool = True) -> float:
    """Bytes coat/nn/loss.py holds at the peak of its forward, which also computes its gradients
    (its backward only scales them), beyond what the layers saved: the final norm's input
    (``x_bytes`` per element) and the bf16 hidden-state gradient dY throughout, and the largest of

    - a chunk of token rows, beside the bf16 normed hidden states: its bf16 logits (overwritten
      in place with their gradient by the core's cross-entropy kernel: no working copy), and with
      several chunks the fp32 [vocab, hidden]
      accumulator of dW (plus, off CUDA's fp32-output GEMM, fp32 operand slices of up to one
      chunk's bytes); with one chunk, dW's GEMM output (bf16, then cast to ``grad_bytes``);
    - the accumulator cast to dW's dtype (both alive; none for fp32 gradients: the accumulator
      is dW);
    - the final norm's backward on dY beside dW: autograd on Hugging Face's recomputed RMSNorm,
      with dx, holds 28 bytes x hidden per token for a bf16 input (30 for fp32), measured on the
      CPU with live-storage tracking.
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


# ---- the plan ---------------------------------------------------------------------------------------

#: cuBLAS workspaces taken from the caching allocator (one per thread: forward and autograd's).
CUDA_WORKSPACE = 64 * MiB
#: Memory a GPU needs beyond the allocated peak: the CUDA context and the caching allocator's
#: fragmentation. Set from the H100 80 GB sweep of issue 11 (a 70.4 GiB peak fitted in 79.2 GiB, a
#: 74.7 GiB one did not).
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


def plan(shape: ModelShape, rec: Recipe | str, batch: int, seq: int, gpus: int = 1, device: str = "cuda") -> Plan:
    """The memory plan of one full step at ``batch`` sequences of ``seq`` tokens (per GPU under FSDP2)."""
    rec = recipe(rec) if isinstance(rec, str) else rec
    for name, v in (("batch", batch), ("seq", seq), ("gpus", gpus)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    s, n, t = shape, shape.n_params, batch * seq
    fsdp = gpus > 1
    table = rec.fsdp_activations if fsdp else rec.activations
    compute = 2  # GEMMs read bf16 weights in every recipe (FSDP2 gathers them in bf16)

    if rec.lora and fsdp:
        raise ValueError(f"--recipe {rec.name}: LoRA is modeled on one GPU (coat bench runs it without --fsdp)")
    adapters = s.lora_params(LORA_RANK) if rec.lora else 0
    weights = rec.param_bytes * n / gpus
    if rec.lora and rec.fp8_weights:  # the decoder linears as E4M3 codes (1 byte), the rest as it was
        linear = s.layers * s.layer_linear_params
        weights = 1.0 * linear + rec.param_bytes * (n - linear)
    master = rec.master_bytes * n / gpus
    states = rec.state_bytes * n / gpus
    grads = rec.grad_bytes * n / gpus
    layer_ops = layer_saved(s, table)
    per_layer = sum(b for _, b in layer_ops) * t
    outside = sum(b for _, b in outside_saved(s, table, rec.fused_loss)) * t

    # Transients at the start of backward (the fused loss: at the end of its forward), beyond what is saved.
    v = s.vocab
    head = s.head_params or s.embed_params
    if rec.fused_loss:
        loss_tr = fused_loss_transient(s, t, rec.loss_chunk_mib, 4 if table == "hf-amp" else 2,
                                       compute if fsdp else rec.grad_bytes, device, head_trains=not rec.lora)
    else:
        loss_tr = 8.0 * v * t  # cross-entropy backward: gradient of the log-probabilities and of the logits (fp32)
    head_grad = (compute if fsdp else rec.grad_bytes) * head  # written before the first layer's backward
    if rec.lora:  # fp32 adapters, torch AdamW's fp32 states and fp32 gradients; the LM head frozen
        states, grads, head_grad = 8.0 * adapters, 4.0 * adapters, 0.0
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
    if table == "coat" and device == "cpu":
        # _fp8mm's CPU path multiplies fp32 copies of its FP8 operands ((a.float() * sa) @ (b.float() * sb).T).
        # The gate/up input-gradient GEMM holds d(gate/up), its E5M2 codes (and transpose), an fp32 copy of
        # them and two fp32 copies of the transposed weight; its weight-gradient GEMM two fp32 copies of
        # the transposed E5M2 codes and of the recomputed input.
        dgrad = 16.0 * i * t + 20.0 * i * h
        wgrad = (14.0 * i + 9 * h) * t
        layer_tr, weight_tr = max(layer_tr + weight_tr, dgrad, wgrad), 0.0
    copies = 2.0 * (s.layers * s.layer_linear_params + head) if rec.weight_copies and not fsdp else 0.0
    fsdp_tr = fsdp_end = 0.0
    if fsdp:
        # Gathered bf16 weights: the root module's (embedding, head, final norm) for the whole step,
        # and two layers (the running one and the prefetched one); in backward one layer's unsharded
        # gradient, plus its copy in the reduce dtype.
        root = s.embed_params + s.head_params + s.hidden
        reduce_copy = rec.fsdp_reduce_bytes if rec.fsdp_reduce_bytes != compute else 0
        fsdp_tr = compute * root + 2 * compute * s.layer_params + (compute + reduce_copy) * s.layer_params
        fsdp_end = (compute + reduce_copy) * (s.embed_params + s.head_params)
    work = CUDA_WORKSPACE if device == "cuda" else 0.0

    resident = weights + 4.0 * adapters + master + states
    # Backward begins with the loss (everything saved is alive), then the last layer runs with the
    # LM head's gradient written and what was saved outside the layers already freed.
    layers_saved = per_layer * s.layers
    adapter_copies = 2.0 * adapters if table == "coat-lora" else 0.0  # bf16, kept for the adapters' backward
    last_layer = head_grad + layer_tr + weight_tr
    if rec.grad_release:
        # coat.optim.step_in_backward: a bucket (a decoder layer, the LM head, the embedding) is
        # stepped and its gradients freed as soon as the last of them lands; autograd runs a
        # parameter's AccumulateGrad as soon as it is ready, so the LM head's gradient is gone before
        # the last layer's backward starts. Beside a layer's largest transient (its MLP's backward,
        # the first part of it) live the MLP's gradients; the whole layer's once its attention is
        # done, with smaller transients. Under FSDP2 the root's unsharded gradients (LM head,
        # embedding) wait for its reduce-scatter at the end of backward, as without release; the
        # sharded gradients of one FSDP group are what is released at a time.
        if fsdp:
            last_layer += rec.grad_bytes * s.layer_params / gpus
            live_grads = rec.grad_bytes * max(s.layer_params, s.embed_params + s.head_params + s.hidden) / gpus
        else:
            mlp = 3 * h * i + (2 * i + h if s.mlp_bias else 0)
            layer = max(rec.grad_bytes * mlp + layer_tr + weight_tr, rec.grad_bytes * s.layer_params)
            # A tied LM head is the embedding: its gradient waits for the embedding's backward, the last.
            last_layer = head_grad + layer if s.tied else max(head_grad, layer)
            live_grads = rec.grad_bytes * max(s.layer_params, head, s.embed_params)
    else:
        live_grads = grads
    start_tr = max(outside + loss_tr, last_layer)
    if table == "coat-lora" and device == "cpu":
        # The CPU GEMM path's fp32 copies of FP8-frozen weights: measured (live-storage tracking, two
        # shapes, 64 to 1024 tokens) as 4 bytes per linear parameter of one layer beside the start of
        # backward, whatever the token count.
        start_tr += 4.0 * s.layer_linear_params
    start = resident + copies + layers_saved + adapter_copies + start_tr + fsdp_tr + work
    end = resident + live_grads + fsdp_end + work
    common = {"weights": weights, "master weights": master, "optimizer states": states}
    if rec.lora:
        common["LoRA adapters (fp32)"] = 4.0 * adapters
    if outside + loss_tr >= last_layer:
        start_part = "saved outside layers + loss backward"
    elif rec.grad_release and not fsdp:
        start_part = "a layer's gradients + its backward"
    elif rec.lora:  # the LM head is frozen: no gradient of it
        start_part = "last layer's backward"
    else:
        start_part = "LM head gradient + last layer's backward"
    if start >= end:
        phase = "backward start"
        parts = {**common, "gradients": 0.0, "autocast bf16 weight copies": copies,
                 f"saved activations ({s.layers} layers)": layers_saved, "LoRA adapters' bf16 copies": adapter_copies,
                 start_part: start_tr, "FSDP2 gathered weights/gradients": fsdp_tr, "cuBLAS workspaces": work}
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


def max_batch(shape: ModelShape, rec: Recipe | str, seq: int, memory_gib: float, gpus: int = 1,
              device: str = "cuda", limit: int = 1 << 16) -> int:
    """The largest batch (sequences per GPU) whose peak plus reserve fits in ``memory_gib``; 0 if none."""
    cap = memory_gib * GiB

    def fits(b: int) -> bool:
        p = plan(shape, rec, b, seq, gpus, device)
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

#: Measured rates (benchmarks/RESULTS.md, its first section): dense bf16 and FP8 GEMM FLOP/s, device copy B/s.
GPU_RATES: dict[str, dict[str, Any]] = {
    "h200": {"bf16": 780e12, "fp8": 1470e12, "bw": 4.25e12, "memory_gib": 139.8,
             "source": "measured on an H200 (benchmarks/RESULTS.md)"},
    "h100": {"bf16": 780e12, "fp8": 1470e12, "bw": 3.0e12, "memory_gib": 79.2,
             "source": "H100 80 GB: the H200's GEMM rates (the same compute die; benchmarks/RESULTS.md), copy ~90% "
                     "of its 3.35 TB/s"},
}

#: Bytes per parameter that the optimizer step reads and writes.
OPTIMIZER_BYTES = {"amp": 28.0, "bf16": 14.0, "coat": 4 + 2 + COAT_STATE_BYTES + 4 + 2 + COAT_STATE_BYTES,
                   "coat-lean": 2 + 2 + COAT_STATE_BYTES + 2 + COAT_STATE_BYTES}


def step_time_floor(shape: ModelShape, rec: Recipe | str, batch: int, seq: int, rates: dict[str, float],
                    gpus: int = 1) -> dict[str, float]:
    """A lower bound on the time of one step per GPU: GEMM and attention FLOPs at the measured GEMM
    rates, plus the optimizer step at copy bandwidth (element-wise kernels, host time and FSDP2
    communication not counted)."""
    rec = recipe(rec) if isinstance(rec, str) else rec
    t = batch * seq
    # 2 FLOPs per parameter and token forward, 2 for the input gradient, 2 for the weight gradient,
    # which a frozen base (LoRA) does not compute; its adapters' GEMMs are rank-thin (not counted).
    per = 4.0 if rec.lora else 6.0
    dec = per * shape.layers * shape.layer_linear_params * t
    head = per * (shape.head_params or shape.embed_params) * t
    # Causal attention: QK^T and PV, half the square, backward 2.5x the forward.
    attn = 3.5 * 2.0 * batch * seq * seq * shape.q_width * shape.layers
    dec_rate = rates["fp8"] if rec.fp8_weights else rates["bf16"]
    gemm_s = dec / dec_rate + (head + attn) / rates["bf16"]
    if rec.lora:  # torch AdamW over the fp32 adapters: as amp's optimizer, per adapter parameter
        opt_s = OPTIMIZER_BYTES["amp"] * shape.lora_params(LORA_RANK) / rates["bw"]
    else:
        opt_s = OPTIMIZER_BYTES.get(rec.name.split("+")[0], 14.0) * shape.n_params / gpus / rates["bw"]
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

