"""``coat train --init PATH``: start from a Hugging Face checkpoint folder, and ``--save``.

Only what ``coat.convert`` handles is accepted (Llama, Mistral, Qwen2, Qwen3), checked from the
folder's config.json before anything is loaded or tokenized.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from coat import models
from coat.cli.data import HFTokenizer

#: The model types coat.convert converts (its decoder layers); --init accepts these.
SUPPORTED_MODEL_TYPES = tuple(t for f in models.FAMILIES for t in f.model_types)
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_FINGERPRINT_FILES = _TOKENIZER_FILES + ("merges.txt", "special_tokens_map.json", "added_tokens.json")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class InitCheckpoint:
    """What ``--init PATH`` holds, read from its config.json alone."""

    path: Path
    model_type: str
    architecture: str
    vocab_size: int
    max_positions: int
    dtype: str  # the checkpoint's own dtype: --save writes the trained model in it
    has_tokenizer: bool

    def summary(self) -> dict[str, Any]:
        return {"path": str(self.path.resolve()), "model_type": self.model_type, "dtype": self.dtype,
                "tokenizer": self.has_tokenizer, "weights": weights_stamp(self.path)}


def weights_stamp(path: Path) -> str:
    """A stamp of an --init folder's weight files: each file's name and size and a digest of its first
    and last 4 MiB (headers and the first and last tensors). A run whose checkpoints hold only what
    trains (LoRA adapters, a side network) resumes on the same frozen base only if this agrees;
    cheap at any model size, unchanged by copying the folder."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file()):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(4 << 20))
            fh.seek(max(0, size - (4 << 20)))
            h.update(fh.read())
    return h.hexdigest()[:16]


def inspect_init(path: str | os.PathLike) -> InitCheckpoint:
    """Checks that ``path`` is a supported Hugging Face causal-LM folder; raises ``ValueError``."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{p} is not a folder (expected a Hugging Face checkpoint folder with config.json)")
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{p} has no config.json: not a Hugging Face checkpoint folder")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_path} is not valid JSON ({e})") from None
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} in {cfg_path} is not supported; coat trains "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} models")
    if not any((p / f).is_file() for f in _WEIGHT_FILES):
        raise ValueError(f"{p} has no weights ({' / '.join(_WEIGHT_FILES)})")
    for key in ("vocab_size", "max_position_embeddings"):
        if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
            raise ValueError(f"{cfg_path}: {key} must be a positive integer, got {cfg.get(key)!r}")
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    archs = cfg.get("architectures") or []
    return InitCheckpoint(
        path=p, model_type=model_type, architecture=archs[0] if archs else "",
        vocab_size=cfg["vocab_size"], max_positions=cfg["max_position_embeddings"],
        dtype=dtype if dtype in _DTYPES else "float32",
        has_tokenizer=any((p / f).is_file() for f in _TOKENIZER_FILES))


def missing_modules(init: InitCheckpoint, targets: list[str]) -> tuple[list[str], list[str]]:
    """The names in ``targets`` that no module of the --init model has, matched as PEFT matches a
    list of target modules (the whole dotted name or its last parts), and the names of the
    model's Linear layers (the usual targets). The model is built on the meta device: no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _quiet_transformers()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(init.path, trust_remote_code=False))
    names = [n for n, _ in model.named_modules() if n]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    return missing, linear


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def load_tokenizer(init: InitCheckpoint) -> HFTokenizer | None:
    if not init.has_tokenizer:
        return None
    from transformers import AutoTokenizer

    from coat.cli.config import ConfigError

    _quiet_transformers()
    try:
        # never the folder's own code (an auto_map), whatever a prompt on stdin would be answered
        tok = AutoTokenizer.from_pretrained(init.path, trust_remote_code=False)
    except Exception as e:  # transformers raises many types for a broken tokenizer folder
        if "custom code" in str(e):
            raise ConfigError("--init", f"the tokenizer in {init.path} names code of its own (an auto_map in "
                              "tokenizer_config.json), which coat does not run: use a tokenizer folder without it") from e
        raise ConfigError("--init", f"the tokenizer in {init.path} failed to load ({type(e).__name__}: {e})") from e
    h = hashlib.sha256()
    for name in _FINGERPRINT_FILES:
        f = init.path / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    return HFTokenizer(tok, h.hexdigest()[:16])


def _dtype_kwarg(dtype: torch.dtype) -> dict[str, Any]:
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def load_model(init: InitCheckpoint, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from coat.cli.config import ConfigError
    from coat.cli.safe_load import unpickling_cause

    _quiet_transformers()
    try:  # weights a pickle would run code from are refused by transformers' weights_only load
        return AutoModelForCausalLM.from_pretrained(init.path, trust_remote_code=False, **_dtype_kwarg(dtype))
    except Exception as e:  # transformers raises many types for a broken folder
        raise ConfigError("--init", f"the model in {init.path} failed to load ({type(e).__name__}: "
                          f"{unpickling_cause(e)})") from e


def save_model(state_dict: dict[str, torch.Tensor], config: Any, out: Path, dtype: str,
               tokenizer: Any | None, architecture: str) -> Path:
    """Writes ``out`` (which must not exist) as a folder plain transformers loads: weights in
    ``dtype``, config.json, and the tokenizer beside them. Written to a temporary folder first
    and renamed, so ``out`` is whole or absent."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    target = _DTYPES[dtype]
    # A plain model of the same config, built on the meta device: it owns no memory and carries
    # the original class name, whatever coat.convert or FSDP2 did to the trained one.
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config)
    sd = {k: v.detach().to("cpu", target) for k, v in state_dict.items()}
    try:
        plain.save_pretrained(tmp, state_dict=sd)
        cfg_file = tmp / "config.json"
        cfg = json.loads(cfg_file.read_text())
        if architecture:
            cfg["architectures"] = [architecture]
        for key in [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]:
            cfg[key] = dtype  # the meta model was float32; the weights on disk are in dtype
        cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)
    except BaseException:  # a full disk: nothing half-written left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
