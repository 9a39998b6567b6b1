"""Model shapes for the memory plan (``coat.memory``): a Llama-family causal LM as far as memory is
concerned, the shapes of published models, and reading one from a ``config.json``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from coat import models

#: Model types whose decoder layers the saved-activation tables describe (the ones ``coat.convert`` takes).
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


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
    qk_norm: bool = False  # Qwen3, Gemma 3
    model_type: str = "llama"
    hidden_act: str = ""  # the MLP's activation as the config names it ("": its config class's default)

    @property
    def gemma(self) -> bool:
        """Gemma 3: (1 + w) norms computed in fp32, a norm after each block too (sandwich)."""
        return self.model_type == "gemma3_text"

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
        extra = (4 if self.gemma else 2) * self.hidden  # the RMSNorm weights (Gemma 3: sandwich norms)
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
        """From a Hugging Face ``config.json`` dictionary (Llama, Mistral, Qwen2, Qwen3, Gemma 3 text)."""
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
            tied=bool(cfg.get("tie_word_embeddings", mt == "gemma3_text")),
            qkv_bias=bool(cfg.get("attention_bias", False)) or mt == "qwen2",
            o_bias=bool(cfg.get("attention_bias", False)) and mt in ("llama", "qwen3"),
            mlp_bias=bool(cfg.get("mlp_bias", False)), qk_norm=mt in ("qwen3", "gemma3_text"), model_type=mt,
            hidden_act=act if isinstance(act := cfg.get(_act_key(mt)), str) else "")

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` fields that rebuild this shape with transformers (random init)."""
        cfg = dict(model_type=self.model_type, hidden_size=self.hidden, num_hidden_layers=self.layers,
                   num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                   intermediate_size=self.intermediate, vocab_size=self.vocab, head_dim=self.head_dim,
                   tie_word_embeddings=self.tied, mlp_bias=self.mlp_bias)
        if self.model_type in ("llama", "qwen3"):
            cfg["attention_bias"] = self.o_bias
        if self.hidden_act:
            cfg[_act_key(self.model_type)] = self.hidden_act
        if self.gemma:  # every layer global (the memory plan does not tell sliding layers apart)
            cfg |= dict(query_pre_attn_scalar=self.head_dim, layer_types=["full_attention"] * self.layers)
            del cfg["mlp_bias"]
        return cfg


def _act_key(model_type: str) -> str:
    """The config key naming the MLP's activation (``hidden_activation`` for Gemma 3)."""
    fam = models.by_model_type(model_type)
    return fam.act_config if fam is not None else "hidden_act"


def _shape(name, h, layers, heads, kv, inter, vocab, **kw) -> ModelShape:
    return ModelShape(name=name, hidden=h, layers=layers, heads=heads, kv_heads=kv, intermediate=inter, vocab=vocab,
                      **kw)


#: Shapes of published models (their config.json), and two small ones for CPU runs.
PRESETS: dict[str, ModelShape] = {s.name: s for s in (
    _shape("llama2-7b", 4096, 32, 32, 32, 11008, 32000),
    _shape("llama2-13b", 5120, 40, 40, 40, 13824, 32000),
    _shape("codellama-34b", 8192, 48, 64, 8, 22016, 32000),
    _shape("llama2-70b", 8192, 80, 64, 8, 28672, 32000),
    _shape("llama3-8b", 4096, 32, 32, 8, 14336, 128256),
    _shape("llama3-70b", 8192, 80, 64, 8, 28672, 128256),
    _shape("mistral-7b", 4096, 32, 32, 8, 14336, 32000, model_type="mistral"),
    _shape("qwen2-7b", 3584, 28, 28, 4, 18944, 152064, qkv_bias=True, model_type="qwen2"),
    _shape("qwen3-8b", 4096, 36, 32, 8, 12288, 151936, head_dim=128, qk_norm=True, model_type="qwen3"),
    _shape("gemma3-1b", 1152, 26, 4, 1, 6912, 262144, head_dim=256, qk_norm=True, tied=True, model_type="gemma3_text"),
    # CPU-sized: widths multiples of 16 (FP8 groups), GQA, so every code path of the big ones runs.
    _shape("tiny", 256, 2, 4, 2, 688, 1024),
    _shape("small", 512, 4, 8, 4, 1376, 4096),
)}


def _folder_name(config_path: str) -> str:
    """The name of the model whose ``config.json`` this is: the model id of a Hugging Face cache
    snapshot (``models--<org>--<name>/snapshots/<revision>/``: not the revision's hash), else the
    folder's name."""
    folder = os.path.dirname(os.path.abspath(config_path))
    parent, snapshots = os.path.split(os.path.dirname(folder))
    repo = os.path.basename(parent)
    if snapshots == "snapshots" and repo.startswith("models--") and len(repo) > len("models--"):
        return repo[len("models--"):].replace("--", "/")
    return os.path.basename(folder)


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
        return ModelShape.from_hf_config(cfg, name=_folder_name(path) or model)
    except ValueError as e:
        raise ValueError(f"--model {model!r}: {e}") from None
