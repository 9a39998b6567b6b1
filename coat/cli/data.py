"""Training corpus for ``coat train``: loading, tokenization, train/val split, batching.

The default corpus is the Python standard library of the running interpreter: real,
reasonably large text that is present on every machine without a download.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

BYTE_VOCAB_SIZE = 257  # 256 byte values + one end-of-document token
BYTE_EOS_ID = 256
BPE_EOS_TOKEN = "<|endoftext|>"
TEXT_SUFFIXES = frozenset({".txt", ".py", ".md", ".rst"})
TOKEN_ARRAY_SUFFIXES = frozenset({".npy", ".bin"})
TOKENIZERS = ("byte", "bpe")
# Bump when the tokenized layout changes so stale cache entries are never reused.
_CACHE_VERSION = 1


@dataclass
class Corpus:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    eos_id: int | None
    info: dict = field(default_factory=dict)  # provenance, recorded in config.json


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "coat" / "corpus"


def stdlib_files() -> list[Path]:
    """The interpreter's standard library *.py files, sorted for determinism.

    Some installs (pyenv, venv-less system Pythons) keep site-packages inside the stdlib
    folder; those are excluded so the corpus does not depend on what else is installed.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if p.is_file() and not skip & set(p.relative_to(root).parts))


def _looks_like_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def text_files(path: Path) -> list[Path]:
    """A text file, or the text files under a folder (recursive, sorted, hidden paths skipped).

    Files with a known text suffix are preferred; a folder without any falls back to every
    file that does not look binary, so e.g. a folder of extension-less documents still works.
    """
    if path.is_file():
        return [path]
    files = sorted(
        p for p in path.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts)
    )
    preferred = [p for p in files if p.suffix.lower() in TEXT_SUFFIXES]
    return preferred or [p for p in files if _looks_like_text(p)]


def _split_files(files: list[Path], val_fraction: float) -> tuple[list[Path], list[Path]]:
    """Hold out the last files; an empty list for val means "split by tokens instead"."""
    n_val = round(len(files) * val_fraction)
    if n_val < 1 or n_val >= len(files):
        return files, []
    return files[:-n_val], files[-n_val:]


def _token_dtype(vocab_size: int) -> type:
    return np.uint8 if vocab_size <= 256 else np.uint16


def _encode_bytes(files: Iterable[Path]) -> np.ndarray:
    parts: list[np.ndarray] = []
    eos = np.array([BYTE_EOS_ID], dtype=np.uint16)
    for f in files:
        parts += [np.frombuffer(f.read_bytes(), dtype=np.uint8).astype(np.uint16), eos]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def _train_bpe(files: list[Path], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((_read_text(f) for f in files), trainer=trainer)
    return tok


def _read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def _encode_bpe(tok, files: list[Path]) -> np.ndarray:
    eos = tok.token_to_id(BPE_EOS_TOKEN)
    ids: list[int] = []
    batch = 256  # bounded memory, while encode_batch still parallelizes across files
    for i in range(0, len(files), batch):
        for enc in tok.encode_batch([_read_text(f) for f in files[i : i + batch]]):
            ids += enc.ids
            ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)


def _cache_key(files: list[Path], tokenizer: str, vocab_size: int, val_fraction: float) -> str:
    h = hashlib.sha256(json.dumps([_CACHE_VERSION, tokenizer, vocab_size, val_fraction]).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _save_atomic(path: Path, arr: np.ndarray) -> None:
    # Write-then-rename so an interrupted run never leaves a truncated cache entry behind.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, arr)
    os.replace(tmp, path)


def _load_text_corpus(
    files: list[Path], source: str, tokenizer: str, vocab_size: int, val_fraction: float, cache_dir: Path,
    log: Callable[[str], None],
) -> Corpus:
    if not files:
        raise ValueError(f"no text files found in {source}")
    key = _cache_key(files, tokenizer, vocab_size, val_fraction)
    cache_dir.mkdir(parents=True, exist_ok=True)
    train_path, val_path = cache_dir / f"{key}.train.npy", cache_dir / f"{key}.val.npy"
    tok_path = cache_dir / f"{key}.tokenizer.json"
    train_files, val_files = _split_files(files, val_fraction)
    info = {
        "source": source,
        "tokenizer": tokenizer,
        "files": len(files),
        "val_files": len(val_files),
        "split": "files" if val_files else "tokens",
        "cache": [str(train_path), str(val_path)],
    }
    if tokenizer == "bpe":
        info["tokenizer_json"] = str(tok_path)
    if train_path.exists() and val_path.exists():
        log(f"Using cached tokenized corpus {train_path}")
        train, val = np.load(train_path, mmap_mode="r"), np.load(val_path, mmap_mode="r")
    else:
        log(f"Tokenizing {len(files)} files from {source} ({tokenizer}) ...")
        if tokenizer == "byte":
            encode: Callable[[list[Path]], np.ndarray] = _encode_bytes
        else:
            # With a file-level split the tokenizer never sees validation text.
            tok = _train_bpe(train_files, vocab_size)
            tok.save(str(tok_path))
            encode = lambda fs: _encode_bpe(tok, fs)  # noqa: E731
        if val_files:
            train, val = encode(train_files), encode(val_files)
        else:
            train, val = split_tokens(encode(files), val_fraction)
        dtype = _token_dtype(_vocab_size(tokenizer, vocab_size))
        train, val = train.astype(dtype), val.astype(dtype)
        _save_atomic(train_path, train)
        _save_atomic(val_path, val)
    eos = BYTE_EOS_ID if tokenizer == "byte" else 0  # BPE: the only special token gets id 0
    return Corpus(train, val, _vocab_size(tokenizer, vocab_size), eos, info)


def _vocab_size(tokenizer: str, bpe_vocab_size: int) -> int:
    return BYTE_VOCAB_SIZE if tokenizer == "byte" else bpe_vocab_size


def split_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Hold out the last ``val_fraction`` of a token stream (contiguous, so no overlap)."""
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


def load_token_array(path: Path) -> np.ndarray:
    """A pre-tokenized corpus: a .npy of integer ids, or a raw .bin of uint16 (nanoGPT style)."""
    if path.suffix == ".npy":
        arr = np.load(path, mmap_mode="r")
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{path}: expected a 1-D integer token array, got {arr.dtype} of shape {arr.shape}")
        return arr
    if path.stat().st_size % 2:
        raise ValueError(f"{path}: a .bin token file must hold uint16 values (even byte count)")
    return np.memmap(path, dtype=np.uint16, mode="r")


def load_corpus(
    data: str | os.PathLike | None = None,
    tokenizer: str = "byte",
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    cache_dir: str | os.PathLike | None = None,
    log: Callable[[str], None] = print,
) -> Corpus:
    """Load ``data`` (None = the stdlib corpus) as train/val token arrays.

    Text is tokenized (and cached); token-array files are used as they are. The split is
    deterministic: the last ``val_fraction`` of the (sorted) files, or of the tokens when
    there are too few files for a file-level split.
    """
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose from {TOKENIZERS}")
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if data is None:
        return _load_text_corpus(stdlib_files(), "python-stdlib", tokenizer, vocab_size, val_fraction, cache, log)
    path = Path(data)
    if not path.exists():
        raise FileNotFoundError(f"data path does not exist: {path}")
    if path.is_file() and path.suffix in TOKEN_ARRAY_SUFFIXES:
        tokens = load_token_array(path)
        train, val = split_tokens(tokens, val_fraction)
        info = {"source": str(path), "tokenizer": "pretokenized", "split": "tokens"}
        return Corpus(train, val, int(tokens.max()) + 1, None, info)
    return _load_text_corpus(text_files(path), str(path), tokenizer, vocab_size, val_fraction, cache, log)


def _windows(tokens: np.ndarray, starts: Iterable[int], seq_len: int) -> torch.Tensor:
    rows = np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])
    return torch.from_numpy(rows)


def sample_batch(tokens: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator) -> torch.Tensor:
    """Random windows of ``seq_len + 1`` tokens, shape (batch_size, seq_len + 1).

    Inputs are ``[:, :-1]`` and next-token targets ``[:, 1:]``. Sampling only from ``rng``
    makes the batch sequence a pure function of the seed.
    """
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
    return _windows(tokens, starts, seq_len)


def eval_batches(tokens: np.ndarray, n_batches: int, batch_size: int, seq_len: int) -> list[torch.Tensor]:
    """Fixed, evenly spaced validation windows, so every evaluation scores the same text."""
    n = n_batches * batch_size
    starts = np.linspace(0, len(tokens) - seq_len - 1, num=n).astype(np.int64)
    return [_windows(tokens, starts[i : i + batch_size], seq_len) for i in range(0, n, batch_size)]
