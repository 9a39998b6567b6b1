"""Documents of a text corpus for ``coat train``: which files are text, reading them (UTF-8, JSONL
records), and the train / held-out split by document or directory, with held-out copies dropped
from training."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator, Sequence

TEXT_SUFFIXES = frozenset({".txt", ".py", ".md", ".rst"})
JSONL_SUFFIXES = frozenset({".jsonl"})


UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def looks_like_text(path: Path) -> bool:
    """No NUL byte in the first 8 KiB; a UTF-16 file (which has them) is an error naming it, not
    a binary file passed over."""
    with open(path, "rb") as f:
        head = f.read(8192)
    if head.startswith(UTF16_BOMS):
        raise ValueError(f"{path} is UTF-16 text; coat reads text as UTF-8: convert it (e.g. iconv -f UTF-16 -t "
                         "UTF-8)")
    return b"\0" not in head


def text_files(path: Path) -> list[Path]:
    """A text or JSONL file, or those under a folder (recursive, sorted, hidden paths skipped).

    Files with a known suffix are preferred; a folder without any falls back to every file
    that does not look binary, so e.g. a folder of extension-less documents still works.
    A single file that looks binary (NUL bytes) is an error, not text.
    """
    if path.is_file():
        if path.suffix.lower() == ".json":  # records are JSONL here; a .json read as text would train on its syntax
            raise ValueError(f"{path} is a .json file, which coat train's text data does not read as records: give "
                             "them as JSONL (.jsonl, one {\"text\": ...} per line), or rename it (.txt) to train on "
                             "its characters as plain text")
        if path.suffix.lower() not in JSONL_SUFFIXES and not looks_like_text(path):
            raise ValueError(f"{path} looks like a binary file (it holds NUL bytes); give a text file, a folder "
                             "of text files, a JSONL file with a \"text\" field, or a token array (.npy/.bin)")
        return [path]
    files = sorted(
        p for p in path.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts)
    )
    known = TEXT_SUFFIXES | JSONL_SUFFIXES
    preferred = [p for p in files if p.suffix.lower() in known]
    return [p for p in (preferred or files) if p.suffix.lower() in JSONL_SUFFIXES or looks_like_text(p)]


# ---- documents: a whole text file, or one record of a JSONL file ------------------------------


def utf8_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a record file, decoded as UTF-8 (a leading byte-order mark dropped;
    lines end at \\n, \\r\\n or \\r, as text mode reads them); a line that is not UTF-8 is an error
    naming it (a replacement character would be trained on as if it were the text)."""
    lineno = 0
    with open(path, "rb") as f:
        for chunk in f:
            for raw in chunk.splitlines() or [b""]:
                lineno += 1
                try:
                    yield lineno, raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not UTF-8 (byte {e.start} of the line is {raw[e.start]:#04x});"
                                     " records are read as UTF-8: convert the file, e.g. iconv -f LATIN1 -t UTF-8") \
                        from None


def jsonl_texts(path: Path) -> list[str]:
    texts = []
    for lineno, line in utf8_lines(path):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise ValueError(f"{path}:{lineno}: each JSONL record needs a string \"text\" field")
        try:
            rec["text"].encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's \\ud800 escapes decode to lone surrogates, which are not text
            raise ValueError(f"{path}:{lineno}: the \"text\" field holds a lone surrogate ({e.reason}), which is not "
                             "text") from None
        if rec["text"]:
            texts.append(rec["text"])
    return texts


class Documents:
    """The corpus as an ordered list of documents, read lazily (JSONL files parsed once).
    ``texts``: documents given as strings, by a name that stands in for their file. A file's text
    is decoded as UTF-8 (what the BPE and Hugging Face tokenizers read; the byte tokenizer reads
    ``raw``): not UTF-8 is an error naming the file, or with ``lenient`` (the built-in corpus, whose
    stdlib holds a few test modules in other encodings on purpose) replacement characters."""

    def __init__(self, files: Sequence[Path], texts: dict[Path, list[str]] | None = None,
                 lenient: bool = False) -> None:
        self.files = list(files)
        self.lenient = lenient
        self._jsonl = {f: jsonl_texts(f) for f in self.files if f.suffix.lower() in JSONL_SUFFIXES}
        self._jsonl |= texts or {}
        self.units: list[tuple[Path, int | None]] = []
        for f in self.files + list(texts or {}):
            n = len(self._jsonl[f]) if f in self._jsonl else None
            self.units += [(f, i) for i in range(n)] if n is not None else [(f, None)]

    def text(self, unit: tuple[Path, int | None]) -> str:
        path, i = unit
        if i is not None:
            return self._jsonl[path][i]
        raw = path.read_bytes()
        try:
            return raw.decode("utf-8-sig", errors="replace" if self.lenient else "strict")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text (byte {e.start} is {raw[e.start]:#04x}), which the bpe and "
                             "Hugging Face tokenizers read: convert it (e.g. iconv -f LATIN1 -t UTF-8), or train "
                             "on its raw bytes with --tokenizer byte") from None

    def size(self, unit: tuple[Path, int | None]) -> int:
        path, i = unit
        return len(self._jsonl[path][i].encode("utf-8")) if i is not None else path.stat().st_size

    def raw(self, unit: tuple[Path, int | None]) -> bytes:
        path, i = unit
        return self._jsonl[path][i].encode("utf-8") if i is not None else path.read_bytes()


def split_units(units: list, val_fraction: float) -> tuple[list, list]:
    """Hold out the last documents; an empty val list means "split by tokens instead"."""
    n_val = round(len(units) * val_fraction)
    if n_val < 1 or n_val >= len(units):
        return units, []
    return units[:-n_val], units[-n_val:]


def split_directories(units: list, val_fraction: float) -> tuple[list, list]:
    """Hold out whole directories (packages) until ``val_fraction`` of the documents are held out.

    Directories are taken in the order of a hash of their path below the group's root, so the
    held-out part samples the whole group (not its alphabetical tail) and is the same on every
    machine; sibling files (a model's modeling, modular and configuration files) never straddle
    the split. A directory that would overshoot the share by half is passed over. Falls back to
    the document split when no directory fits."""
    target = round(len(units) * val_fraction)
    if target < 1 or target >= len(units):
        return units, []
    dirs: dict[Path, list] = {}
    for u in units:
        dirs.setdefault(u[0].parent, []).append(u)
    root = Path(os.path.commonpath([str(d) for d in dirs]))

    def rank(d: Path) -> str:
        return hashlib.blake2b(d.relative_to(root).as_posix().encode(), digest_size=8).hexdigest()

    held: set[Path] = set()
    n = 0
    for d in sorted(dirs, key=rank):
        if n >= target:
            break
        if n + len(dirs[d]) <= target * 1.5:
            held.add(d)
            n += len(dirs[d])
    if not held or len(held) == len(dirs):
        return split_units(units, val_fraction)
    return [u for u in units if u[0].parent not in held], [u for u in units if u[0].parent in held]


def unit_digest(docs: Documents, unit: tuple[Path, int | None], file_digests: dict[Path, str]) -> str:
    path, i = unit
    if i is None and path in file_digests:
        return file_digests[path]
    return hashlib.blake2b(docs.raw(unit), digest_size=16).hexdigest()


def drop_copies(docs: Documents, train: list, val: list, file_digests: dict[Path, str]) -> tuple[list, int]:
    """Training documents whose exact bytes are also held out are dropped (the built-in corpus has
    vendored copies across packages): a held-out text is never trained on."""
    held = {unit_digest(docs, u, file_digests) for u in val}
    kept = [u for u in train if unit_digest(docs, u, file_digests) not in held]
    return kept, len(train) - len(kept)



def split_groups(groups: dict[str, list[Path]], units: list, by_directory: bool,
                  val_fraction: float) -> tuple[list, list]:
    """(train, held-out) documents: held-out ones from each group (whole directories with
    ``by_directory``), so every source is represented in the validation split."""
    by_file: dict[Path, list] = {}
    for u in units:
        by_file.setdefault(u[0], []).append(u)
    split = split_directories if by_directory else split_units
    train_units, val_units = [], []
    for fs in groups.values():
        tr, va = split([u for f in fs for u in by_file.get(f, [])], val_fraction)
        train_units += tr
        val_units += va
    return train_units, val_units


def split_text(docs: Documents, units: list, val_fraction: float) -> tuple[list[str], list[str], bool]:
    """Too few documents to hold any out whole: (training texts, held-out texts, whether the last
    training text is a document cut short), the last ``val_fraction`` of the characters held out
    (cut inside a document), so that a tokenizer trained on the training texts never sees held-out
    text. A training document equal to one the held-out text comes from is dropped."""
    texts = [docs.text(u) for u in units]
    total = sum(map(len, texts))
    cut = total - max(1, int(total * val_fraction))
    head, tail, held_from, pos = [], [], set(), 0
    for t in texts:
        head.append(t[: max(0, cut - pos)])
        tail.append(t[max(0, cut - pos):])
        if tail[-1]:
            held_from.add(t)
        pos += len(t)
    cut_short = any(h and h != t for h, t in zip(head, texts))
    head = [h for h, t in zip(head, texts) if h and (h != t or t not in held_from)]
    return head, [t for t in tail if t], cut_short


def hold_out(docs: Documents, groups: dict[str, list[Path]], units: list, prose: dict[Path, list[str]],
             digests: dict[Path, str], by_directory: bool, val_fraction: float,
             tokenizer: str) -> tuple[Documents, list, list, dict]:
    """(documents, training units, held-out units, how: the split's name, the training copies of
    held-out documents dropped, whether the training text ends in a document cut short) of a
    corpus's ``units`` (``prose``: the further held-out documents, never trained on). Too few
    documents for a document split give no held-out units, except with ``tokenizer`` "bpe", which
    holds out the text's tail (``split_text``). Text that the tokenizer would decode is decoded
    here, so that an error comes before a tokenizer is trained."""
    if tokenizer != "byte" and not docs.lenient:
        for u in units:
            docs.text(u)
    train_units, val_units = split_groups(groups, units, by_directory, val_fraction)
    prose_units = [u for u in docs.units if u[0] in prose]
    train_units, copies = drop_copies(docs, train_units, val_units + prose_units, digests)
    how = {"split": "directories" if by_directory else "documents", "copies": copies, "cut_short": False}
    if not val_units and tokenizer == "bpe":
        head, tail, cut_short = split_text(docs, units, val_fraction)
        docs = Documents([], prose | {Path("<training text>"): head, Path("<held-out text>"): tail})
        train_units = [u for u in docs.units if u[0].name == "<training text>"]
        val_units = [u for u in docs.units if u[0].name == "<held-out text>"]
        how = {"split": "text", "copies": 0, "cut_short": cut_short}
    return docs, train_units, val_units, how
