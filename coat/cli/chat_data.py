"""Chat and instruction fine-tuning data for ``coat train --init CKPT --data PATH``.

Record formats (one record per JSONL line, per element of a JSON array, per row of a parquet file
or of a Hugging Face ``datasets`` folder written by ``save_to_disk``):

- ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...}, ...]}`` (optional
  ``"tools"``), the format of OpenAI's fine-tuning API and TRL;
- ShareGPT: ``{"conversations": [{"from": "system"|"human"|"gpt", "value": ...}, ...]}``;
- TRL's prompt-completion: ``{"prompt": str, "completion": str}``, or both lists of messages;
- ``{"text": str}`` in parquet / ``datasets`` folders (a JSONL of text records stays with
  coat.cli.data, unchanged).

Each record is one example: token ids rendered with the --init tokenizer's own chat template and the
targets the loss sees, which are the assistant tokens only (the completion for prompt-completion,
every token for text), -100 elsewhere, as TRL's SFT does with ``assistant_only_loss`` /
``completion_only_loss``. Examples are packed best-fit-decreasing into rows of --seq-len positions;
each row carries position ids that restart at 0 for each example, from which transformers builds a
block-diagonal causal mask (``masking_utils.find_packed_sequence_indices``), so no example attends to
another, and targets are never taken across an example boundary. The validation split holds out
whole examples.

A packed split is an int32 array of shape (rows, 3, seq_len): ``[:, 0]`` input ids, ``[:, 1]`` the
next-token targets (-100: no loss), ``[:, 2]`` position ids. ``coat.cli.model.lm_loss`` takes a batch of
such rows (int64) where it takes a (B, T+1) token window for text corpora.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from coat.cli.data import Corpus, HFTokenizer, _cache_key, _save_atomic, hf_vocab_size, token_digest
from coat.cli.documents import utf8_lines

IGNORE = -100
#: Bump when the packed layout or the rendering changes, so stale cache entries are never reused.
_CACHE_VERSION = 1
_RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
#: ShareGPT speaker names -> chat-template roles.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
                  "tool": "tool", "function": "tool", "observation": "tool"}
_CHAT_KEYS = ("messages", "conversations", "prompt")


# ---- finding and reading records ----------------------------------------------------------------


def _is_datasets_folder(p: Path) -> bool:
    """A folder that ``datasets``' save_to_disk wrote: a DatasetDict's, or one Dataset's."""
    return (p / "dataset_dict.json").is_file() or ((p / "state.json").is_file() and (p / "dataset_info.json").is_file())


def _record_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.rglob("*") if f.is_file() and f.suffix.lower() in _RECORD_SUFFIXES
                  and not any(s.startswith(".") for s in f.relative_to(folder).parts))


def _first_record(path: Path) -> Any:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    return None
    return None


def _is_chat_record(rec: Any) -> bool:
    return isinstance(rec, dict) and any(k in rec for k in _CHAT_KEYS)


def detect(data: str | os.PathLike) -> str | None:
    """What this module reads at ``data``: "datasets" (a save_to_disk folder), "parquet" (a parquet
    file or a folder holding some), "records" (JSONL/JSON of chat or prompt-completion records, or
    a folder whose first such file holds them); None for what coat.cli.data reads (text, JSONL of
    ``{"text": ...}``, token arrays). Looks only at names and the first record of one file."""
    p = Path(data)
    if _is_datasets_folder(p):
        return "datasets"
    if p.is_file():
        if p.suffix.lower() == ".parquet":
            return "parquet"
        if p.suffix.lower() == ".jsonl":
            return "records" if _is_chat_record(_first_record(p)) else None
        if p.suffix.lower() == ".json":
            return "records" if _json_array_is_chat(p) else None
        return None
    if not p.is_dir():
        return None
    files = _record_files(p)
    if any(f.suffix.lower() == ".parquet" for f in files):
        return "parquet"
    jsonl = [f for f in files if f.suffix.lower() == ".jsonl"]
    return "records" if jsonl and _is_chat_record(_first_record(jsonl[0])) else None


def _json_array_is_chat(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(1 << 16).lstrip()
        if not head.startswith("["):
            return False
        recs = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(recs, list) and bool(recs) and _is_chat_record(recs[0])


def _need_pyarrow(what: str) -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ValueError(f"reading {what} needs pyarrow, which is not installed: pip install pyarrow") from None


def _arrow_rows(table: Any, where: str) -> Iterator[tuple[str, Any]]:
    for i, rec in enumerate(table.to_pylist()):
        yield f"{where} row {i}", rec


def _read_file(f: Path) -> Iterator[tuple[str, Any]]:
    """(where, record) of each record of a JSONL, JSON-array or parquet file."""
    suffix = f.suffix.lower()
    if suffix == ".parquet":
        _need_pyarrow(f"{f} (parquet)")
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(f)
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
            raise ValueError(f"{f}: not a readable parquet file ({type(e).__name__}: {e})") from None
        yield from _arrow_rows(table, str(f))
    elif suffix == ".json":
        try:
            recs = json.loads(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{f}: not valid JSON ({e})") from None
        if not isinstance(recs, list):
            raise ValueError(f"{f}: a .json data file must hold an array of records")
        for i, rec in enumerate(recs):
            yield f"{f} record {i}", rec
    else:
        for lineno, line in utf8_lines(f):
            if not line.strip():
                continue
            try:
                yield f"{f}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{f}:{lineno}: not valid JSON ({e.msg})") from None


def _datasets_split(folder: Path) -> tuple[list[Path], Iterator[tuple[str, Any]]]:
    """The arrow files of one save_to_disk Dataset folder and its rows (the files are Arrow IPC
    streams listed in state.json; read with pyarrow, so `datasets` itself is not needed)."""
    try:
        state = json.loads((folder / "state.json").read_text())
        names = [d["filename"] for d in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{folder}/state.json is not a datasets save_to_disk state ({e})") from None
    files = [folder / n for n in names]
    for f in files:
        if not f.is_file():
            raise ValueError(f"{folder}: state.json lists {f.name}, which is missing")
    if state.get("_indices_data_files"):
        raise ValueError(f"{folder} stores an indices mapping; save it again after .flatten_indices()")

    def rows() -> Iterator[tuple[str, Any]]:
        _need_pyarrow(f"{folder} (a datasets folder)")
        import pyarrow.ipc as ipc

        for f in files:
            try:
                table = ipc.open_stream(f).read_all()
            except Exception as e:  # ArrowInvalid for a damaged or non-stream file
                raise ValueError(f"{f}: not a readable Arrow stream ({type(e).__name__}: {e})") from None
            yield from _arrow_rows(table, str(f))

    return files, rows()


_VAL_SPLITS = ("validation", "valid", "val", "test")


def read_records(data: str | os.PathLike, kind: str) -> tuple[list[Path], Callable[[], tuple[list, list | None]], str]:
    """(files, read, description) of ``data``; ``read()`` gives (train records, validation records
    or None), so that a cache hit needs only the files. A save_to_disk DatasetDict gives its "train"
    split and, where it has one, its validation/test split as the held-out set; everything else is
    one list to split."""
    p = Path(data)
    if kind in ("datasets", "parquet"):
        _need_pyarrow(str(p))
    if kind == "datasets" and (p / "dataset_dict.json").is_file():
        try:
            splits = json.loads((p / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{p}/dataset_dict.json is not a datasets save_to_disk file ({e})") from None
        if "train" not in splits:
            raise ValueError(f"{p} is a DatasetDict without a \"train\" split (it has {', '.join(splits)})")
        files, train = _datasets_split(p / "train")
        val_name = next((s for s in _VAL_SPLITS if s in splits), None)
        if val_name is None:
            return files, lambda: (list(train), None), "datasets folder (train split)"
        vfiles, val = _datasets_split(p / val_name)
        return files + vfiles, lambda: (list(train), list(val)), f"datasets folder (train and {val_name} splits)"
    if kind == "datasets":
        files, rows = _datasets_split(p)
        return files, lambda: (list(rows), None), "datasets folder"
    files = [p] if p.is_file() else [f for f in _record_files(p)
                                     if kind == "records" or f.suffix.lower() == ".parquet"]
    return files, lambda: ([r for f in files for r in _read_file(f)], None), \
        "parquet" if kind == "parquet" else "JSON records"


# ---- records -> examples (token ids + loss mask) --------------------------------------------------


def _content_text(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return ""


def _clean_message(m: Any, where: str, j: int, role_key: str = "role", content_key: str = "content") -> dict:
    if not isinstance(m, dict) or not isinstance(m.get(role_key), str):
        raise ValueError(f"{where}: message {j} needs a string \"{role_key}\"")
    # Arrow fills fields a row lacks with None; a template's `is defined` tests must not see them.
    out = {k: v for k, v in m.items() if v is not None}
    if role_key != "role":
        speaker = m[role_key].lower()
        if speaker not in SHAREGPT_ROLES:
            raise ValueError(f"{where}: message {j} has \"{role_key}\": {m[role_key]!r}; ShareGPT speakers are "
                             f"{', '.join(SHAREGPT_ROLES)}")
        out = {"role": SHAREGPT_ROLES[speaker], "content": m.get(content_key)}
    if not isinstance(out.get("content"), (str, list)) and not out.get("tool_calls"):
        raise ValueError(f"{where}: message {j} ({out['role']}) needs a string \"{content_key}\"")
    return out


def _messages(value: Any, where: str, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: \"{key}\" must be a non-empty list of messages")
    sharegpt = key == "conversations" and isinstance(value[0], dict) and "from" in value[0]
    return [_clean_message(m, where, j, *(("from", "value") if sharegpt else ())) for j, m in enumerate(value)]


def _tools(rec: dict, where: str) -> Any:
    """A record's tool definitions for the template: a list, or a JSON string of one (as datasets
    often store them, Arrow having no type for free-form JSON)."""
    tools = rec.get("tools") or None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: \"tools\" is a string but not JSON ({e.msg})") from None
    return tools


def normalize(rec: Any, where: str) -> tuple[str, Any]:
    """A record as ("chat", (messages, indices of the messages to learn, tools)), ("prompt",
    (prompt, completion)) or ("text", text). Raises ValueError naming the record."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a record must be a JSON object")
    if "messages" in rec or "conversations" in rec:
        key = "messages" if "messages" in rec else "conversations"
        msgs = _messages(rec[key], where, key)
        if isinstance(rec.get("system"), str) and rec["system"] and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": rec["system"]})  # ShareGPT's top-level system prompt
        learn = [j for j, m in enumerate(msgs) if m["role"] == "assistant"]
        return "chat", (msgs, learn, _tools(rec, where))
    if "prompt" in rec and "completion" in rec:
        p, c = rec["prompt"], rec["completion"]
        if isinstance(p, str) and isinstance(c, str):
            return "prompt", (p, c)
        if isinstance(p, list) and isinstance(c, list):
            msgs = _messages(p, where, "prompt") + _messages(c, where, "completion")
            learn = [j for j in range(len(p), len(msgs)) if msgs[j]["role"] == "assistant"]
            return "chat", (msgs, learn, _tools(rec, where))
        raise ValueError(f"{where}: \"prompt\" and \"completion\" must both be strings or both lists of messages")
    if isinstance(rec.get("text"), str):
        return "text", rec["text"]
    keys = ", ".join(map(repr, rec)) or "none"
    raise ValueError(f"{where}: unknown record (keys {keys}); chat data needs \"messages\", \"conversations\" "
                     "(ShareGPT), \"prompt\" + \"completion\", or \"text\"")


class ChatRenderer:
    """Token ids and loss masks of examples, rendered with ``tokenizer``'s chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.bos, self.eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        self._markers: tuple[str, str] | None = None

    def _render(self, messages: list[dict], tools: Any, generation_prompt: bool, where: str) -> str:
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(f"{where}: chat records need the --init tokenizer's chat_template, and it has none "
                             "(add one to tokenizer_config.json or chat_template.jinja)")
        try:
            return self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                                add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja2's TemplateError, or the template's raise_exception()
            raise ValueError(f"{where}: the chat template refused the conversation ({type(e).__name__}: {e})") from None

    def _probe(self) -> tuple[str, str]:
        """What the template writes before an assistant reply (its generation prompt, e.g.
        "<|im_start|>assistant\\n") and right after it (e.g. "<|im_end|>": part of what the model
        must learn to produce, so that it stops); "" where a probe conversation does not show it."""
        if self._markers is None:
            q, a = "615283947", "739184526"  # digits: what templates do to text (trim, case) leaves them
            header = marker = ""
            try:
                asked = self._render([{"role": "user", "content": q}], None, False, "probe")
                prompt = self._render([{"role": "user", "content": q}], None, True, "probe")
                full = self._render([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                    None, False, "probe")
            except ValueError:
                asked = prompt = full = ""
            if prompt.startswith(asked) and full.startswith(prompt):
                header = prompt[len(asked):]
            if a in full:
                marker = full.split(a, 1)[1].rstrip()
            self._markers = (header, marker)
        return self._markers

    def _span(self, msgs: list[dict], j: int, tools: Any, full: str, pos: int, where: str) -> tuple[int, int]:
        """The character span in ``full`` (the whole rendering) of assistant message ``j``, which
        starts at or after ``pos``: everything the template writes for the turn after its
        generation prompt, up to its end-of-turn marker (the newline after that is not learned).

        Where the rendering of the messages before it with the generation prompt, and of those up
        to it, are prefixes of ``full``, they give the span exactly. A template may render a turn
        differently once later turns follow (Qwen3 gives the last turn a reasoning block and drops
        it from past ones); the span then starts after the generation prompt (the prefix, else the
        next generation prompt in ``full``, else the reply itself) and ends at the first
        end-of-turn marker after the reply (tool calls included)."""
        start = None
        if j > 0:  # templates refuse to render an empty conversation
            try:
                before = self._render(msgs[:j], tools, True, where)
                upto = self._render(msgs[: j + 1], tools, False, where)
            except ValueError:  # e.g. a template that refuses a conversation ending on an assistant turn
                before = upto = ""
            if before and len(before) >= pos and full.startswith(before):
                start = len(before)
                if full.startswith(upto) and len(upto.rstrip()) > start:
                    return start, len(upto.rstrip())
        header, marker = self._probe()
        text = _content_text(msgs[j].get("content")).strip()
        if start is None and header and full.find(header, pos) >= 0:
            start = full.find(header, pos) + len(header)
        at = full.find(text, pos if start is None else start) if text else -1
        if start is None and at >= 0:
            start = at
        turn_end = full.find(marker, start) if marker and start is not None else -1
        if at >= 0 and (turn_end < 0 or at <= turn_end):  # the reply as written, then the end of its turn
            after = at + len(text)
            end = full.find(marker, after) if marker else -1
        else:  # the template rewrote the reply (or it is empty: tool calls): the turn ends at its marker
            after, end = start, turn_end
        if start is None or (end < 0 and after == start):
            raise ValueError(f"{where}: could not find assistant message {j} in the chat template's rendering of "
                             "the conversation, so its tokens cannot be told from the prompt's")
        return start, (end + len(marker) if end >= 0 else after)

    def _spans(self, msgs: list[dict], learn: list[int], tools: Any, full: str, where: str) -> dict[int, tuple[int, int]]:
        """Spans of the learned messages, found in order; the other messages' contents move the
        search on past them where the rendering holds them verbatim."""
        spans, pos, want = {}, 0, set(learn)
        for j, m in enumerate(msgs):
            if j in want:
                spans[j] = self._span(msgs, j, tools, full, pos, where)
                pos = spans[j][1]
                continue
            text = _content_text(m.get("content")).strip()
            at = full.find(text, pos) if text else -1
            if at >= 0:
                pos = at + len(text)
        return spans

    def chat(self, msgs: list[dict], learn: list[int], tools: Any, where: str) -> tuple[list[int], np.ndarray]:
        """The conversation's token ids, and True on the tokens of the messages ``learn`` indexes."""
        full = self._render(msgs, tools, False, where)
        spans = self._spans(msgs, learn, tools, full, where)
        try:
            enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:
            raise ValueError("chat data needs a fast tokenizer (one with tokenizer.json): the --init tokenizer "
                             "cannot map tokens to characters") from None
        ids = list(enc["input_ids"])
        off = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), dtype=bool)
        for a, b in spans.values():  # a token belongs to a span it overlaps (a merge across the boundary included)
            mask |= (off[:, 0] < b) & (off[:, 1] > a)
        return ids, mask

    def _encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt_completion(self, prompt: str, completion: str) -> tuple[list[int], np.ndarray]:
        """Plain text prompt-completion, as TRL's SFT: prompt then completion then EOS, the loss on
        the completion and EOS."""
        head = ([self.bos] if self.bos is not None else []) + self._encode(prompt)
        tail = self._encode(completion) + ([self.eos] if self.eos is not None else [])
        return head + tail, np.array([False] * len(head) + [True] * len(tail))

    def text(self, text: str) -> tuple[list[int], np.ndarray]:
        ids = ([self.bos] if self.bos is not None else []) + self._encode(text) + ([self.eos] if self.eos is not None else [])
        return ids, np.ones(len(ids), dtype=bool)

    def example(self, rec: Any, where: str) -> tuple[str, list[int], np.ndarray]:
        kind, value = normalize(rec, where)
        if kind == "chat":
            return kind, *self.chat(*value, where)
        if kind == "prompt":
            return kind, *self.prompt_completion(*value)
        return kind, *self.text(value)


# ---- packing ------------------------------------------------------------------------------------


def pack(examples: list[tuple[list[int], np.ndarray]], seq_len: int, pad_id: int) -> np.ndarray:
    """Best-fit-decreasing packing of (ids, learn-mask) examples into rows of ``seq_len`` positions.

    An example of L tokens takes L - 1 positions: its last token is only ever a target. One longer
    than ``seq_len`` + 1 tokens is cut to its first ``seq_len`` + 1 (as TRL truncates). The rest of
    a row is padding with targets -100 and positions of its own, so it forms one more segment that
    no example attends to."""
    lengths = [min(len(ids) - 1, seq_len) for ids, _ in examples]
    caps: list[tuple[int, int]] = []  # (room left, row), sorted: best fit = the first with enough room
    rows: list[list[int]] = []
    for i in sorted(range(len(examples)), key=lambda i: -lengths[i]):
        n = lengths[i]
        k = bisect.bisect_left(caps, (n, -1))
        if k == len(caps):
            row, room = len(rows), seq_len
            rows.append([])
        else:
            room, row = caps.pop(k)
        rows[row].append(i)
        if room - n > 0:
            bisect.insort(caps, (room - n, row))
    out = np.empty((len(rows), 3, seq_len), dtype=np.int32)
    out[:, 0], out[:, 1] = pad_id, IGNORE
    for r, members in enumerate(rows):
        pos = 0
        for i in members:
            ids, learn = examples[i]
            n = lengths[i]
            ids_a = np.asarray(ids[: n + 1], dtype=np.int64)
            out[r, 0, pos : pos + n] = ids_a[:n]
            out[r, 1, pos : pos + n] = np.where(learn[1 : n + 1], ids_a[1:], IGNORE)
            out[r, 2, pos : pos + n] = np.arange(n)
            pos += n
        out[r, 2, pos:] = np.arange(seq_len - pos)
    return out


def is_packed(tokens: Any) -> bool:
    """True for a split of packed rows (this module's), False for a flat token array."""
    return getattr(tokens, "ndim", 1) == 3


def n_tokens(tokens: Any) -> int:
    """Token positions in a split: a flat array's length, or rows x seq_len of packed rows."""
    return int(tokens.shape[0] * tokens.shape[-1]) if is_packed(tokens) else len(tokens)


def sample_rows(rows: np.ndarray, batch_size: int, step: int, seed: Iterable[int]) -> torch.Tensor:
    """The packed rows of training step ``step`` (1-based), int64 (batch_size, 3, seq_len).

    Epochs without replacement: each epoch is a permutation of the rows seeded by (``seed``,
    epoch), and step s takes the next ``batch_size`` of the stream. A pure function of the step,
    so a resumed run continues the same order."""
    n = len(rows)
    k = (step - 1) * batch_size + np.arange(batch_size)
    idx = np.empty(batch_size, dtype=np.int64)
    for epoch in np.unique(k // n):
        perm = np.random.default_rng([*seed, int(epoch)]).permutation(n)
        sel = k // n == epoch
        idx[sel] = perm[k[sel] % n]
    return torch.from_numpy(np.asarray(rows[idx], dtype=np.int64))


def eval_rows(rows: np.ndarray, n_batches: int, batch_size: int, seq_len: int = 0) -> list[torch.Tensor]:
    """``n_batches`` fixed validation batches of ``batch_size`` evenly spaced rows, as
    ``data.eval_batches`` gives windows: always that many (ranks split them evenly, and each
    evaluation scores the same batches), a row repeated where there are fewer rows than places
    (``seq_len`` is unused: the rows have theirs)."""
    n = n_batches * batch_size
    idx = np.linspace(0, len(rows) - 1, num=n).round().astype(np.int64)
    return [torch.from_numpy(np.asarray(rows[idx[i : i + batch_size]], dtype=np.int64)) for i in range(0, n, batch_size)]


# ---- the corpus -----------------------------------------------------------------------------------


def _examples(renderer: ChatRenderer, records: list, seq_len: int) -> tuple[list, dict]:
    examples, kinds, truncated, dropped = [], set(), 0, 0
    for where, rec in records:
        kind, ids, learn = renderer.example(rec, where)
        kinds.add(kind)
        if len(ids) < 2:
            dropped += 1
            continue
        if len(ids) > seq_len + 1:
            truncated += 1
        if not learn[1 : seq_len + 1].any():  # nothing to learn within --seq-len
            dropped += 1
            continue
        examples.append((ids, learn))
    return examples, {"kinds": sorted(kinds), "truncated": truncated, "dropped": dropped}


def load_chat_corpus(data: str | os.PathLike, kind: str, hf: HFTokenizer, seq_len: int, val_fraction: float,
                     cache_dir: Path, log: Callable[[str], None] = print) -> Corpus:
    """Reads, renders and packs the chat data at ``data`` (``kind`` from ``detect``); cached in
    ``cache_dir`` by the files' contents, the tokenizer and its chat template, --seq-len and
    --val-fraction. Raises ``ValueError`` naming the record for unusable data."""
    tok = hf.tokenizer
    files, read, desc = read_records(data, kind)
    if not files:
        raise ValueError(f"no JSONL, JSON or parquet files found in {data}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    template = hashlib.sha256(str(getattr(tok, "chat_template", None)).encode()).hexdigest()[:16]
    key = _cache_key(files, ["chat", _CACHE_VERSION, "dedup", hf.fingerprint, template, seq_len, val_fraction], cache_dir)
    paths = {s: cache_dir / f"{key}.{s}.npy" for s in ("train", "val")}
    meta_path = cache_dir / f"{key}.json"
    info: dict[str, Any] = {"source": str(data), "tokenizer": "hf", "format": desc, "packed": True,
                            "seq_len": seq_len, "files": len(files), "cache": [str(p) for p in paths.values()]}
    if all(p.exists() for p in paths.values()) and meta_path.exists():
        log(f"Using cached packed chat data {paths['train']}")
        info |= json.loads(meta_path.read_text())
        return Corpus(np.load(paths["train"], mmap_mode="r"), np.load(paths["val"], mmap_mode="r"),
                      hf_vocab_size(hf), tok.eos_token_id, info)
    train_recs, val_recs = read()
    if not train_recs:
        raise ValueError(f"no records found in {data}")
    log(f"Rendering {len(train_recs) + len(val_recs or []):,} examples from {data} with the --init tokenizer's "
        "chat template ...")
    renderer = ChatRenderer(tok)
    given_val = val_recs is not None
    if val_recs is None:  # hold out whole examples: the last ones, as for text documents
        if len(train_recs) < 2:
            raise ValueError(f"{data} holds 1 example; a validation split needs at least 2")
        n_val = min(max(1, round(len(train_recs) * val_fraction)), len(train_recs) - 1)
        train_recs, val_recs = train_recs[:-n_val], train_recs[-n_val:]
    train_ex, train_stats = _examples(renderer, train_recs, seq_len)
    val_ex, val_stats = _examples(renderer, val_recs, seq_len)
    for split, ex, recs in (("train", train_ex, train_recs), ("validation", val_ex, val_recs)):
        if not ex:
            raise ValueError(f"the {split} split of {data} has no example with a token to learn within --seq-len "
                             f"{seq_len} ({len(recs)} records: no assistant reply, or one that starts past "
                             "--seq-len tokens)")
    if len(set(train_stats["kinds"]) | set(val_stats["kinds"])) > 1:
        raise ValueError(f"{data} mixes record formats ({', '.join(sorted(set(train_stats['kinds']) | set(val_stats['kinds'])))}); "
                         "give one format per run")
    held = {json.dumps(r, sort_keys=True, default=str) for _, r in val_recs}  # a held-out example's copies: not trained on
    kept = [(w, r) for w, r in train_recs if json.dumps(r, sort_keys=True, default=str) not in held]
    if not kept:
        raise ValueError(f"every training example in {data} is a copy of a held-out one: nothing is left to train on")
    if (copies := len(train_recs) - len(kept)):
        train_ex, train_stats = _examples(renderer, kept, seq_len)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    train, val = pack(train_ex, seq_len, pad), pack(val_ex, seq_len, pad)
    learned = int((train[:, 1] != IGNORE).sum())
    meta = {"split": "given" if given_val else "examples", "kind": train_stats["kinds"][0],
            "train_examples": len(train_ex), "val_examples": len(val_ex), "train_rows": len(train),
            "val_rows": len(val), "train_loss_tokens": learned,
            "truncated": train_stats["truncated"] + val_stats["truncated"],
            "dropped": train_stats["dropped"] + val_stats["dropped"], "train_copies_dropped": copies, "digest": token_digest({"train": train, "val": val})}
    _save_atomic(paths["train"], train)
    _save_atomic(paths["val"], val)
    tmp = meta_path.with_name(f"{meta_path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, meta_path)  # written last: its presence marks a whole cache entry
    log(f"Chat data: {len(train_ex):,} train / {len(val_ex):,} val examples ({meta['kind']}) packed into "
        f"{len(train):,} + {len(val):,} rows of {seq_len} tokens; the loss sees {learned:,} of "
        f"{train.shape[0] * seq_len:,} train positions" + (f"; {meta['truncated']} examples cut to --seq-len"
                                                          if meta["truncated"] else "")
        + (f"; {meta['dropped']} dropped (nothing to learn within --seq-len)" if meta["dropped"] else ""))
    return Corpus(train, val, hf_vocab_size(hf), tok.eos_token_id, info | meta)
