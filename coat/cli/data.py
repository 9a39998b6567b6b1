"""Training corpus for ``coat train``: loading, tokenization, train/val split, batching.

The built-in corpus is Python source that every machine running coat has without a download:
the interpreter's standard library plus the installed source of torch, transformers and numpy
(coat's own dependencies), ~100M bytes. It is large enough that a GPU run of a few minutes sees
each token less than once, so its validation loss measures generalization, not memorization.
Its validation split holds out whole directories (packages), and no held-out file has a copy in
training. A second held-out set is prose that ships with the interpreter and those packages
(the Python documentation's topics, the packages' READMEs), never trained on: quality shown on
more than code.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from coat.cli.documents import Documents, hold_out, text_files

BYTE_VOCAB_SIZE = 257  # 256 byte values + one end-of-document token
BYTE_EOS_ID = 256
BPE_EOS_TOKEN = "<|endoftext|>"
TOKEN_ARRAY_SUFFIXES = frozenset({".npy", ".bin"})
TOKENIZERS = ("byte", "bpe")
#: Packages whose source joins the standard library in the built-in corpus: coat depends on them,
#: so they are installed wherever coat is.
BUILTIN_PACKAGES = ("torch", "transformers", "numpy")
#: Largest token id a pre-tokenized array may hold without --init (the largest published
#: vocabularies are ~262k); a larger id would only build an absurd embedding table.
MAX_TOKEN_ID = (1 << 20) - 1
# Bump when the tokenized layout changes so stale cache entries are never reused.
_CACHE_VERSION = 5


@dataclass
class Corpus:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    eos_id: int | None
    info: dict = field(default_factory=dict)  # provenance, recorded in config.json
    #: Further held-out sets by name (the built-in corpus: "prose"), never trained on.
    heldout: dict[str, np.ndarray] = field(default_factory=dict)


def token_digest(splits: dict[str, np.ndarray]) -> str:
    """A digest of the tokens themselves, split by split (name, dtype, shape, bytes): what a run
    trained and evaluated on, whatever path or cache entry they came from. Recorded in config.json;
    a resume and the two recipes of a comparison must agree on it."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(splits):
        a = np.ascontiguousarray(splits[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def corpus_digest(corpus: Corpus) -> str:
    """``token_digest`` of a corpus (read from its cache entry's metadata when it was recorded there)."""
    return corpus.info.get("digest") or token_digest({"train": corpus.train, "val": corpus.val, **corpus.heldout})


@dataclass(frozen=True)
class HFTokenizer:
    """A Hugging Face tokenizer (from an --init folder) and a fingerprint of its files."""

    tokenizer: Any
    fingerprint: str


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "coat" / "corpus"


_SKIP_PARTS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def _py_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if p.is_file() and not _SKIP_PARTS & set(p.relative_to(root).parts))


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


#: The Python documentation's topics (prose in a .py file): the prose held-out set, not code.
_PYDOC_TOPICS = Path("pydoc_data") / "topics.py"


def stdlib_files() -> list[Path]:
    """The interpreter's standard library *.py files, sorted for determinism.

    Some installs (pyenv, venv-less system Pythons) keep site-packages inside the stdlib
    folder; those are excluded so this part does not depend on what else is installed.
    """
    root = _stdlib()
    return [p for p in _py_files(root) if p.relative_to(root) != _PYDOC_TOPICS]


def builtin_prose() -> dict[str, list[str]]:
    """The prose held-out set, by source: the interpreter's documentation topics (the language
    reference and library pages pydoc shows) and the README of each of ``BUILTIN_PACKAGES``
    (its package metadata's description). Read as data: the topics module is parsed, never run."""
    out: dict[str, list[str]] = {}
    topics = _stdlib() / _PYDOC_TOPICS
    if topics.is_file():
        for node in ast.parse(topics.read_bytes()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
                value = ast.literal_eval(node.value)
                if isinstance(value, dict):
                    out["python-docs"] = [value[k] for k in sorted(value) if isinstance(value[k], str) and value[k]]
    for name in BUILTIN_PACKAGES:
        try:
            meta = importlib.metadata.metadata(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        body = meta.get_payload() if hasattr(meta, "get_payload") else None
        text = body or meta.get("Description") or ""
        if text.strip():
            out[f"{name}-readme"] = [text]
    return out


def builtin_sources() -> dict[str, list[Path]]:
    """The built-in corpus by source: "stdlib" and each of ``BUILTIN_PACKAGES`` found installed."""
    sources = {"stdlib": stdlib_files()}
    for name in BUILTIN_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            sources[name] = _py_files(Path(list(spec.submodule_search_locations)[0]))
    return sources


# ---- tokenizers -------------------------------------------------------------------------------


def _token_dtype(vocab_size: int) -> type:
    return np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.uint32


def _encode_bytes(docs: Documents, units: list) -> np.ndarray:
    # One preallocated array instead of a list of parts: tokenizing the ~100 MB built-in corpus
    # must not double the process's peak memory (a CPU run reports peak RSS).
    out = np.empty(sum(docs.size(u) for u in units) + len(units), dtype=np.uint16)
    pos = 0
    for u in units:
        raw = docs.raw(u)
        if pos + len(raw) + 1 > len(out):  # the file grew since it was measured
            out = np.resize(out, pos + len(raw) + 1)
        out[pos : pos + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        pos += len(raw)
        out[pos] = BYTE_EOS_ID
        pos += 1
    return out[:pos]  # a file may have shrunk between stat() and read()


def _train_bpe(docs: Documents, units: list, vocab_size: int):
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
    tok.train_from_iterator((docs.text(u) for u in units), trainer=trainer)
    return tok


def _encode_batched(encode: Callable[[list[str]], list[list[int]]], docs: Documents, units: list,
                    bos: int | None, eos: int | None, dtype: type) -> np.ndarray:
    parts: list[np.ndarray] = []
    batch = 256  # bounded memory, while batch encoding still parallelizes across documents
    for i in range(0, len(units), batch):
        for ids in encode([docs.text(u) for u in units[i : i + batch]]):
            parts.append(np.asarray(([bos] if bos is not None else []) + list(ids) + ([eos] if eos is not None else []),
                                    dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _encode_bpe(tok, docs: Documents, units: list, dtype: type) -> np.ndarray:
    return _encode_batched(lambda texts: [e.ids for e in tok.encode_batch(texts)], docs, units, None,
                           tok.token_to_id(BPE_EOS_TOKEN), dtype)


def _encode_hf(hf: HFTokenizer, docs: Documents, units: list, dtype: type) -> np.ndarray:
    tok = hf.tokenizer
    return _encode_batched(lambda texts: tok(texts, add_special_tokens=False)["input_ids"], docs, units,
                           tok.bos_token_id, tok.eos_token_id, dtype)


def hf_vocab_size(hf: HFTokenizer) -> int:
    return len(hf.tokenizer)


# ---- caching ----------------------------------------------------------------------------------


def _content_hashes(files: list[Path], cache_dir: Path) -> list[str]:
    """A hash of each file's bytes. Memoized in ``cache_dir`` by path and stat (size, mtime, ctime,
    inode): an edit changes ctime even where the mtime is set back afterwards, so a memo entry
    never outlives its content, and a file whose stat changed is read again."""
    memo_path = cache_dir / "content-hashes.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    out, changed = [], False
    for f in files:
        st = f.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        key = str(f.resolve())
        entry = memo.get(key)
        if not (isinstance(entry, list) and entry[:4] == stamp):
            entry, changed = [*stamp, hashlib.blake2b(f.read_bytes(), digest_size=16).hexdigest()], True
            memo[key] = entry
        out.append(entry[4])
    if changed:
        tmp = memo_path.with_name(f"{memo_path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(memo))
            os.replace(tmp, memo_path)
        except OSError:  # only a memo: the next run hashes again
            tmp.unlink(missing_ok=True)
    return out


def _cache_key(files: list[Path], parts: list, cache_dir: Path) -> str:
    """The cache entry of ``files`` tokenized with ``parts``: by their paths and contents."""
    h = hashlib.sha256(json.dumps([_CACHE_VERSION, *parts]).encode())
    for f, digest in zip(files, _content_hashes(files, cache_dir)):
        h.update(f"{f.resolve()}\0{digest}\n".encode())
    return h.hexdigest()[:16]


def _save_atomic(path: Path, arr: np.ndarray) -> None:
    # Write-then-rename so an interrupted run never leaves a truncated cache entry behind.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.save(f, arr)
        os.replace(tmp, path)
    except BaseException:  # a full disk: no partial file left in the cache
        tmp.unlink(missing_ok=True)
        raise


def _load_text_corpus(
    groups: dict[str, list[Path]], source: str, tokenizer: str, vocab_size: int, val_fraction: float,
    cache_dir: Path, log: Callable[[str], None], hf: HFTokenizer | None = None, by_directory: bool = False,
    prose: dict[str, list[str]] | None = None,
) -> Corpus:
    """Tokenize (or load from the cache) text split per group: held-out documents come from each
    group (whole directories with ``by_directory``), so every source is represented in the
    validation split; training never holds a copy of a held-out document. ``prose``: a further
    held-out set (documents by source), tokenized alike and kept apart as ``heldout["prose"]``."""
    files = [f for fs in groups.values() for f in fs]
    if not files:
        raise ValueError(f"no text files found in {source}")
    vocab = {"byte": BYTE_VOCAB_SIZE, "bpe": vocab_size}.get(tokenizer) or (hf_vocab_size(hf) if hf else 0)
    cache_dir.mkdir(parents=True, exist_ok=True)
    prose_digest = hashlib.blake2b(json.dumps(prose, sort_keys=True).encode(), digest_size=16).hexdigest() \
        if prose else None
    key = _cache_key(files, [tokenizer, vocab, val_fraction, hf.fingerprint if hf else None, list(groups),
                             by_directory, prose_digest], cache_dir)
    train_path, val_path = cache_dir / f"{key}.train.npy", cache_dir / f"{key}.val.npy"
    prose_path = cache_dir / f"{key}.prose.npy"
    tok_path = cache_dir / f"{key}.tokenizer.json"
    info: dict[str, Any] = {"source": source, "tokenizer": tokenizer, "files": len(files),
                            "cache": [str(train_path), str(val_path)] + ([str(prose_path)] if prose else [])}
    if len(groups) > 1:
        info["sources"] = {name: len(fs) for name, fs in groups.items()}
    if tokenizer == "bpe":
        info["tokenizer_json"] = str(tok_path)
    meta_path = cache_dir / f"{key}.json"
    heldout: dict[str, np.ndarray] = {}
    if train_path.exists() and val_path.exists() and meta_path.exists() and (tokenizer != "bpe" or tok_path.exists()) \
            and (not prose or prose_path.exists()):
        log(f"Using cached tokenized corpus {train_path}")
        train, val = np.load(train_path, mmap_mode="r"), np.load(val_path, mmap_mode="r")
        if prose:
            heldout["prose"] = np.load(prose_path, mmap_mode="r")
        info |= json.loads(meta_path.read_text())
    else:
        log(f"Tokenizing {len(files)} files from {source} ({tokenizer}) ...")
        prose_docs = {Path(f"<{name}>"): texts for name, texts in (prose or {}).items()}
        docs = Documents(files, prose_docs, lenient=by_directory)  # lenient: the built-in corpus only
        prose_units = [u for u in docs.units if u[0] in prose_docs]
        units = [u for u in docs.units if u[0] not in prose_docs]
        if not units:
            raise ValueError(f"no documents found in {source}")
        digests = dict(zip(files, _content_hashes(files, cache_dir)))
        docs, train_units, val_units, how = hold_out(docs, groups, units, prose_docs, digests, by_directory,
                                                     val_fraction, tokenizer)
        dtype = _token_dtype(vocab)
        encode = _encoder(tokenizer, docs, train_units, vocab_size, tok_path, hf, dtype)
        if val_units:
            train, val = encode(train_units), encode(val_units)
            if how["cut_short"]:  # no end-of-document token where the training text was cut
                train = train[:-1]
            meta = {"split": how["split"], "val_documents": len(val_units) if how["split"] != "text" else 0,
                    "train_copies_dropped": how["copies"]}
        else:
            train, val = split_tokens(encode(units), val_fraction)
            meta = {"split": "tokens", "val_documents": 0}
        train, val = train.astype(dtype, copy=False), val.astype(dtype, copy=False)
        _save_atomic(train_path, train)
        _save_atomic(val_path, val)
        if prose:
            heldout["prose"] = encode(prose_units).astype(dtype, copy=False)
            _save_atomic(prose_path, heldout["prose"])
            meta["prose_documents"] = {name: len(texts) for name, texts in prose.items()}
        meta["digest"] = token_digest({"train": train, "val": val, **heldout})
        tmp = meta_path.with_name(f"{meta_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, meta_path)  # written last: its presence marks a whole cache entry
        info |= meta
    eos = {"byte": BYTE_EOS_ID, "bpe": 0}.get(tokenizer)  # BPE: the only special token gets id 0
    if hf is not None:
        eos = hf.tokenizer.eos_token_id
    return Corpus(train, val, vocab, eos, info, heldout)


def _encoder(tokenizer: str, docs: Documents, train_units: list, vocab_size: int, tok_path: Path,
             hf: HFTokenizer | None, dtype: type) -> Callable[[list], np.ndarray]:
    """Documents -> token ids with ``tokenizer``; a BPE tokenizer is trained on ``train_units``
    first and saved at ``tok_path``."""
    if tokenizer == "byte":
        return lambda us: _encode_bytes(docs, us)
    if tokenizer == "bpe":
        # Trained on the training split only (documents, or the text's head: documents.split_text).
        tok = _train_bpe(docs, train_units, vocab_size)
        tok.save(str(tok_path))
        return lambda us: _encode_bpe(tok, docs, us, dtype)
    return lambda us: _encode_hf(hf, docs, us, dtype)


def split_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Hold out the last ``val_fraction`` of a token stream (contiguous, so no overlap)."""
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


def load_token_array(path: Path, max_id: int = MAX_TOKEN_ID) -> np.ndarray:
    """A pre-tokenized corpus: a .npy of integer ids, or a raw .bin of uint16 (nanoGPT style).
    Every id must lie in [0, max_id]."""
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise ValueError(f"{path}: not a readable .npy array ({e})") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{path}: expected a 1-D integer token array, got {arr.dtype} of shape {arr.shape}")
    else:
        if path.stat().st_size % 2:
            raise ValueError(f"{path}: a .bin token file must hold uint16 values (even byte count)")
        arr = np.memmap(path, dtype=np.uint16, mode="r")
    if len(arr) == 0:
        raise ValueError(f"{path}: the token array is empty")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise ValueError(f"{path}: holds a negative token id ({lo})")
    if hi > max_id:
        raise ValueError(f"{path}: holds token id {hi}, above the largest allowed id {max_id}"
                         + (" (the --init model's vocab_size - 1)" if max_id != MAX_TOKEN_ID else ""))
    return arr


def load_corpus(
    data: str | os.PathLike | None = None,
    tokenizer: str = "byte",
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    cache_dir: str | os.PathLike | None = None,
    log: Callable[[str], None] = print,
    hf_tokenizer: HFTokenizer | None = None,
    max_token_id: int = MAX_TOKEN_ID,
) -> Corpus:
    """Load ``data`` (None = the built-in Python-source corpus) as train/val token arrays.

    Text (files, folders, JSONL records with a "text" field) is tokenized (and cached) with
    ``tokenizer`` ("byte", "bpe"), or with ``hf_tokenizer`` when one is given; token-array files
    are used as they are. The split is deterministic: the last ``val_fraction`` of the (sorted)
    documents, or of the tokens when there are too few documents for a document-level split (of
    the text with ``bpe``, so its tokenizer is trained on training text only); the
    built-in corpus holds out whole directories and adds the "prose" held-out set.
    Raises ``ValueError`` / ``FileNotFoundError`` for unusable data.
    """
    if tokenizer not in TOKENIZERS and not (tokenizer == "hf" and hf_tokenizer is not None):
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose from {TOKENIZERS}")
    if hf_tokenizer is not None:
        tokenizer = "hf"
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if data is None:
        sources = builtin_sources()
        name = "python-source (" + ", ".join(sources) + ")"
        return _load_text_corpus(sources, name, tokenizer, vocab_size, val_fraction, cache, log, hf_tokenizer,
                                 by_directory=True, prose=builtin_prose())
    path = Path(data)
    if not path.exists():
        raise FileNotFoundError(f"data path does not exist: {path}")
    if path.is_file() and path.suffix in TOKEN_ARRAY_SUFFIXES:
        tokens = load_token_array(path, max_token_id)
        train, val = split_tokens(tokens, val_fraction)
        info = {"source": str(path), "tokenizer": "pretokenized", "split": "tokens"}
        return Corpus(train, val, int(tokens.max()) + 1, None, info)
    return _load_text_corpus({"data": text_files(path)}, str(path), tokenizer, vocab_size, val_fraction, cache, log,
                             hf_tokenizer)


# ---- batches ----------------------------------------------------------------------------------


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
