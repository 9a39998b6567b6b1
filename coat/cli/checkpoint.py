"""Output folders, metrics files and training checkpoints of ``coat train``.

Guarantees:
- A run never writes into a folder that holds files of another run: ``--out`` must be new or
  empty, the default ``runs/<timestamp>`` is created exclusively (``-2``, ``-3``... when taken),
  and a folder in use is locked (``flock``), so two runs never share one.
- A checkpoint is whole or absent: it is written to ``checkpoints/.tmp-step_N``, synced to disk,
  then renamed to ``checkpoints/step_N`` (one atomic rename); a process killed mid-write leaves
  only a ``.tmp-`` folder, which resume ignores and the next save removes. A save that fails
  (a full disk) removes its ``.tmp-`` folder and raises ``WriteError``.
- Every checkpoint ends with ``manifest.json`` (size and sha256 of each of its files, written
  last); resume verifies it, and ``meta.json``'s record of the run (recipe, optimizer, model),
  before reading anything else, and reads no file in a way that could run code from it
  (``torch.load(weights_only=True)``, and ``coat.cli.safe_load`` for DCP checkpoints).
- metrics.jsonl holds whole JSON lines only (one ``write`` per line; a line cut short by a full
  disk is truncated away); on resume, the records after the checkpoint's step (and any torn
  last line) are dropped through an atomic rewrite.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.api import CheckpointException

from coat.cli.config import IDENTITY_FLAGS, LATER_IDENTITY_FLAGS, TrainConfig
from coat.cli.distributed_train import Dist
from coat.cli.safe_load import unpickling_cause

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_LOCKS: dict[str, Any] = {}  # folder -> open lock file, held for the life of the process


class OutputError(ValueError):
    """The output folder cannot be used (reported against --out or --resume)."""


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from: damaged, incomplete, of another run, or unsafe.
    ``damaged=False``: whole, but unusable here (another world size), like its older siblings."""

    def __init__(self, message: str, damaged: bool = True) -> None:
        super().__init__(message)
        self.damaged = damaged


class WriteError(RuntimeError):
    """A file the run must write could not be written (a full disk); the message says what is kept."""


def why_failed(e: BaseException) -> str:
    """The cause of a failed write in a few words (the OSError inside torch's wrappers, if any)."""
    first = e
    while e is not None and not isinstance(e, OSError):
        if isinstance(e, CheckpointException):  # torch.distributed.checkpoint's: {rank: (exception, trace)}
            e = next(iter(e.failures.values()), (None,))[0]
        else:
            e = e.__cause__ or e.__context__
    if isinstance(e, OSError):
        return e.strerror or str(e)
    lines = [line for line in str(first).strip().splitlines() if line.strip()]
    return f"{type(first).__name__}: {lines[-1] if lines else ''}"


# ---- output folders -----------------------------------------------------------------------------


def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists():
        p = p.parent
    return p


def _probe_writable(folder: Path) -> bool:
    # access() is not enough: root passes it everywhere, and special file systems (/proc) pass it
    # but refuse new entries. A folder created and removed at once is the real test.
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".coat-probe-", dir=folder))
        return True
    except OSError:
        return False


def check_new_out(out: Path) -> None:
    """Raises ``OutputError`` unless ``out`` can become a new run's folder (leaves nothing behind)."""
    if out.exists():
        if not out.is_dir():
            raise OutputError(f"{out} exists and is not a folder")
        entries = sorted(e.name for e in out.iterdir())
        if entries:
            shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
            raise OutputError(f"{out} already holds files ({shown}); choose a new folder, "
                              f"or continue that run with --resume {out}")
        if not _probe_writable(out):
            raise OutputError(f"{out} is not writable")
        return
    base = _nearest_existing(out)
    if not base.is_dir():
        raise OutputError(f"cannot create {out}: {base} is a file, not a folder")
    if not _probe_writable(base):
        raise OutputError(f"cannot create {out}: {base} is not writable")


def check_default_root(root: Path) -> None:
    """Raises ``OutputError`` unless new run folders can be created in ``root`` (made if missing)."""
    base = root if root.exists() else _nearest_existing(root)
    if not base.is_dir():
        raise OutputError(f"cannot create run folders in {root}: {base} is a file, not a folder")
    if not _probe_writable(base):
        raise OutputError(f"cannot create run folders in {root}: {base} is not writable")


def lock(out: Path) -> None:
    """Locks ``out`` for this process (released when it exits); ``OutputError`` if taken."""
    if (key := str(out.resolve())) in _LOCKS:
        return
    try:  # not through a symlink: the lock file is created where it lies
        f = os.fdopen(os.open(out / ".lock", os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644), "a+")
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise OutputError(f"{out} is in use by another coat train process") from None
    except OSError as e:
        raise OutputError(f"cannot lock {out}: {out / '.lock'} is a symlink or unusable ({e.strerror})") from None
    _LOCKS[key] = f


def unlock(out: Path) -> None:
    if (f := _LOCKS.pop(str(out.resolve()), None)) is not None:
        f.close()


def reserve_out(out: Path | None, default_root: Path = Path("runs")) -> Path:
    """Creates and locks the run folder: ``out`` (new or empty), or a fresh ``runs/<timestamp>``."""
    if out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        default_root.mkdir(parents=True, exist_ok=True)
        for i in range(1, 1000):
            cand = default_root / (stamp if i == 1 else f"{stamp}-{i}")
            try:
                cand.mkdir()  # exclusive: two runs started in the same second get different folders
            except FileExistsError:
                continue
            lock(cand)
            return cand
        raise OutputError(f"no free folder name under {default_root} for {stamp}")
    check_new_out(out)
    out.mkdir(parents=True, exist_ok=True)
    lock(out)
    check_new_out_after_lock(out)
    return out


def check_new_out_after_lock(out: Path) -> None:
    # Another process may have written into the folder between the check and the lock.
    if any(e.name != ".lock" for e in out.iterdir()):
        unlock(out)
        raise OutputError(f"{out} was taken by another run while this one started")


#: What a run writes before its first step: a folder holding only these can be neither resumed
#: nor reused, so a start that fails or is aborted removes it.
_BEFORE_FIRST_STEP = {".lock", "config.json", "metrics.jsonl", "compare.json"}


def _trained(metrics: Path) -> bool:
    try:
        return any(json.loads(line).get("step", 0) > 0 for line in metrics.read_text().splitlines()
                   if line.endswith("}"))
    except (OSError, ValueError):
        return False


def release_if_unused(out: Path) -> None:
    """Removes a folder this run created that holds nothing to keep (a start that failed or was
    aborted before its first training step: the curve of a run that trained stays)."""
    unlock(out)
    if not out.is_dir():
        return
    entries = list(out.iterdir())
    if not _trained(out / "metrics.jsonl") and all(
            e.name in _BEFORE_FIRST_STEP or (e.name.startswith(".") and e.name.endswith(".tmp")) for e in entries):
        for e in entries:
            e.unlink(missing_ok=True)
        try:
            out.rmdir()
        except OSError:
            pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Writes strict JSON (non-finite floats become null) through a temporary file and a rename;
    ``WriteError`` (and no temporary file left) when it cannot."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(finite(obj), indent=2, allow_nan=False, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise WriteError(f"could not write {path}: {why_failed(e)}") from e


def finite(obj: Any) -> Any:
    """``obj`` with every NaN/Inf float replaced by None, so it serializes as valid JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


# ---- metrics.jsonl ------------------------------------------------------------------------------


class MetricsLog:
    """Appends one JSON record per line; ``upto`` keeps the existing records with step <= upto."""

    def __init__(self, path: Path, upto: int | None = None) -> None:
        self.path = path
        if upto is None:
            self._f = open(path, "xb")  # a new run: never truncates a file that is there
            return
        kept = []
        if path.exists():
            for line in path.read_text().splitlines(keepends=True):
                if not line.endswith("\n"):
                    break  # a torn last line (a killed process): dropped
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break
                if rec.get("step", 0) <= upto:
                    kept.append(line)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text("".join(kept))
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise WriteError(f"could not rewrite {path}: {why_failed(e)}") from e
        self._f = open(path, "ab")

    def write(self, rec: dict[str, Any]) -> None:
        """Appends one whole line, or nothing (``WriteError``): a crashed or interrupted run still
        leaves its curve behind, and a full disk never leaves half a line."""
        line = (json.dumps(finite(rec), allow_nan=False) + "\n").encode()
        fd = self._f.fileno()
        end = os.lseek(fd, 0, os.SEEK_END)
        try:
            if _write_fd(fd, line) != len(line):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            with contextlib.suppress(OSError):  # else readers drop a torn last line
                os.ftruncate(fd, end)
            raise WriteError(f"could not write {self.path}: {why_failed(e)}") from e

    def close(self) -> None:
        self._f.close()


def _write_fd(fd: int, data: bytes) -> int:
    return os.write(fd, data)


# ---- checkpoints ----------------------------------------------------------------------------------


def checkpoints(out: Path) -> list[tuple[int, Path]]:
    """The checkpoints in ``out`` (``step_N`` folders, whole unless damaged since), oldest first."""
    root = out / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(out: Path) -> Path | None:
    found = checkpoints(out)
    return found[-1][1] if found else None


def fingerprint(obj: Any) -> str:
    """A short hash of a JSON-able object, equal for the object and its JSON round trip."""
    canonical = json.loads(json.dumps(finite(obj), default=str))
    return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()[:16]


def run_identity(run_info: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint belongs to (config.json): run id, model, config.IDENTITY_FLAGS; a resume refuses another's."""
    train = run_info.get("train", {})
    later = {k: getattr(TrainConfig, k) for k in LATER_IDENTITY_FLAGS}  # recorded only away from the default
    extra = {k: train[k] for k, default in later.items() if train.get(k, default) != default}
    return {"run_id": run_info.get("run_id"), **{k: train.get(k) for k in IDENTITY_FLAGS}, **extra,
            "model": fingerprint(run_info.get("model"))}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _entry(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def write_manifest(folder: Path, known: dict[str, dict[str, Any]] | None = None) -> None:
    """Writes ``folder/manifest.json``: size and sha256 of every other file in it (``known``:
    entries already computed, by relative path, e.g. by the ranks that wrote those files)."""
    known = known or {}
    files = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and p.name != MANIFEST:
            hit = known.get(rel)
            files[rel] = hit if hit and hit["bytes"] == p.stat().st_size else _entry(p)
    write_json_atomic(folder / MANIFEST, {"files": files})


def _save_file(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _remove(path: Path) -> None:
    # Renamed out of the step_N namespace first: a deletion cut short never looks like a checkpoint.
    trash = path.with_name(f".del-{path.name}-{os.getpid()}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _on_all_ranks(d: Dist, device: torch.device, fn: Callable[[], None]) -> None:
    """Runs ``fn``; if it raised on any rank, every rank raises (none waits in a collective)."""
    err: BaseException | None = None
    try:
        fn()
    except (Exception, CheckpointException) as e:  # the latter is a BaseException
        err = e
    if d.any(err is not None, device):
        raise err if err is not None else WriteError("another rank could not write its part")


def save(out: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         train_state: dict[str, Any], rank_state: dict[str, Any], d: Dist, keep_last: int,
         identity: dict[str, Any] | None = None, before_rename: Callable[[], None] | None = None) -> Path:
    """Writes checkpoint ``step`` (collective under torchrun) and keeps the last ``keep_last``.

    ``train_state`` (scheduler, counters) comes from rank 0; ``rank_state`` (RNG states) from
    every rank; ``identity`` (``run_identity``) goes into meta.json. Single process: one
    ``torch.save`` file of model and optimizer; several: a ``torch.distributed.checkpoint`` of the
    sharded model and optimizer state. Raises ``WriteError`` on every rank when any part cannot
    be written (the temporary folder is removed; the checkpoints before it are kept)."""
    root = out / CHECKPOINTS
    name = f"step_{step:08d}"
    tmp, final = root / f".tmp-{name}", root / name
    device = next(model.parameters()).device

    def start() -> None:
        if d.is_main:
            root.mkdir(exist_ok=True)
            for stale in [*root.glob(".tmp-*"), *root.glob(".del-*")]:  # a killed process's (we hold the lock)
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()

    def write_parts() -> None:
        if d.enabled:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
                     checkpoint_id=str(tmp))
        else:
            state = getattr(model, "side_state_dict", model.state_dict)()  # side tuning: not the frozen base
            _save_file({"model": state, "optim": optimizer.state_dict()}, tmp / "model_optim.pt")
        _save_file(rank_state, tmp / f"rank{d.rank:05d}.pt")
        # Each rank hashes what it wrote (DCP: __<rank>_*.distcp), in parallel, while it is in the page cache.
        own = [f"rank{d.rank:05d}.pt", *(p.name for p in tmp.glob(f"__{d.rank}_*"))] if d.enabled else \
            ["model_optim.pt", "rank00000.pt"]
        hashed.update({name: _entry(tmp / name) for name in own})

    def finish() -> None:
        if not d.is_main:
            return
        _save_file(train_state, tmp / "train_state.pt")
        meta = {"step": step, "world_size": d.world, "format": "dcp" if d.enabled else "torch",
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "run": identity}
        with open(tmp / "meta.json", "w") as f:
            f.write(json.dumps(meta) + "\n")
            f.flush()
            os.fsync(f.fileno())
        write_manifest(tmp, hashed)  # last: a folder with a manifest that matches is whole
        _fsync_dir(tmp)
        if before_rename is not None:
            before_rename()
        if final.exists():
            _remove(final)
        os.replace(tmp, final)
        _fsync_dir(root)

    hashed: dict[str, dict[str, Any]] = {}
    try:
        for part in (start, write_parts):
            _on_all_ranks(d, device, part)
        hashed = d.merge(hashed)  # every rank's entries on every rank (collective: outside the parts)
        _on_all_ranks(d, device, finish)
    except (Exception, CheckpointException) as e:
        if d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = [s for s, _ in checkpoints(out)]
        raise WriteError(f"could not write checkpoint {final}: {why_failed(e)}; "
                         + (f"the checkpoints of steps {', '.join(map(str, kept))} are kept" if kept
                            else "no earlier checkpoint exists")) from e
    if d.is_main:
        for _, old in checkpoints(out)[:-keep_last]:
            _remove(old)
    d.barrier()
    return final


def set_aside_after(out: Path, resume_from: Path) -> list[Path]:
    """Renames the checkpoints newer than ``resume_from`` to ``set-aside-step_N`` (kept, never deleted, no longer
    resumed or counted by --keep-last); returns their new paths. The rewound run's summary stops saying it finished."""
    moved, step = [], int(_STEP_DIR.match(resume_from.name).group(1))
    for s, path in checkpoints(out):
        if s > step:
            names = (path.with_name(f"set-aside-{path.name}" + (f"-{i}" if i else "")) for i in range(10**6))
            moved.append(next(t for t in names if not t.exists()))
            os.replace(path, moved[-1])
    if moved and (out / "summary.json").is_file():
        write_json_atomic(out / "summary.json", json.loads((out / "summary.json").read_text()) | {"finished": False})
    return moved


# ---- reading a checkpoint back --------------------------------------------------------------------


def read_meta(ckpt: Path) -> dict[str, Any]:
    """meta.json of ``ckpt``; ``CheckpointError`` unless it is a well-formed record of this step."""
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except FileNotFoundError:
        raise CheckpointError("its meta.json is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"its meta.json is not valid JSON ({e})") from None
    m = _STEP_DIR.match(ckpt.name)
    ok = isinstance(meta, dict) and isinstance(meta.get("step"), int) and isinstance(meta.get("world_size"), int) \
        and meta["world_size"] >= 1 and meta.get("format") == ("dcp" if meta["world_size"] > 1 else "torch")
    if not ok:
        raise CheckpointError("its meta.json is not a coat checkpoint record (step, world_size, format)")
    if m is None or int(m.group(1)) != meta["step"]:
        raise CheckpointError(f"its meta.json is of step {meta['step']}, not of the folder's step")
    return meta


def _check_files(ckpt: Path) -> dict[str, Any]:
    try:
        listed = json.loads((ckpt / MANIFEST).read_text())["files"]
        assert isinstance(listed, dict) and all(isinstance(v, dict) for v in listed.values())
    except FileNotFoundError:
        raise CheckpointError(f"it has no {MANIFEST} (cut short, or written by a coat without checksums)") from None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AssertionError):
        raise CheckpointError(f"its {MANIFEST} is damaged") from None
    for rel, want in listed.items():
        path = ckpt / rel
        if not path.resolve().is_relative_to(ckpt.resolve()):  # read nothing outside it (../, symlinks)
            raise CheckpointError(f"its {MANIFEST} names {rel!r}, outside the checkpoint folder")
        if not path.is_file():
            raise CheckpointError(f"its file {rel} is missing")
        if path.stat().st_size != want.get("bytes"):
            raise CheckpointError(f"its file {rel} has {path.stat().st_size} bytes, not the {want.get('bytes')} "
                                  "written (truncated or damaged)")
        if _sha256(path) != want.get("sha256"):
            raise CheckpointError(f"its file {rel} does not match its checksum (damaged or altered)")
    return listed


def verify(ckpt: Path, world: int, identity: dict[str, Any] | None) -> dict[str, Any]:
    """Checks that ``ckpt`` is whole (every file matches its manifest), that it belongs to this
    run (``identity``) and world size, and that its DCP metadata holds nothing executable.
    Returns its meta.json; raises ``CheckpointError`` saying what is wrong."""
    if not ckpt.is_dir():
        raise CheckpointError("it is not a folder")
    listed = _check_files(ckpt)
    meta = read_meta(ckpt)
    n = meta["world_size"]
    if n != world:
        raise CheckpointError(f"it was written by {n} process(es); resume it with the same number "
                              f"(this run has {world})", damaged=False)
    needed = ["meta.json", "train_state.pt", *(f"rank{r:05d}.pt" for r in range(n)),
              ".metadata" if meta["format"] == "dcp" else "model_optim.pt"]
    missing = [f for f in needed if f not in listed]
    if missing:
        raise CheckpointError(f"its manifest lacks {', '.join(missing)}")
    if identity is not None and meta.get("run") != identity:
        theirs = meta.get("run") or {}
        diff = [f"{k} {theirs.get(k)!r} (this run: {v!r})" for k, v in identity.items() if theirs.get(k) != v]
        raise CheckpointError("it belongs to another run: " + ", ".join(diff or ["no record of its run"]))
    if meta["format"] == "dcp":
        from coat.cli.safe_load import UnsafeCheckpointError, load_metadata

        for rel in listed:
            if rel.endswith(".metadata"):
                try:
                    load_metadata((ckpt / rel).read_bytes())
                except UnsafeCheckpointError as e:
                    raise CheckpointError(f"its {rel} cannot be read safely: {e}") from None
    return meta


def verify_or_offer(out: Path, step: int, world: int, identity: dict[str, Any] | None) -> str | None:
    """None if checkpoint ``step`` of the run in ``out`` can be resumed; else why not, and the
    newest earlier checkpoint that can (checked the same way)."""
    found = dict(checkpoints(out))
    try:
        verify(found[step], world, identity)
        return None
    except CheckpointError as e:
        why = f"checkpoint {found[step]} cannot be resumed: {e}."
        if not e.damaged:
            return why  # whole, but unusable here, like the checkpoints before it
    return why + offer_earlier(out, step, world, identity)


def offer_earlier(out: Path, step: int, world: int, identity: dict[str, Any] | None) -> str:
    """What to do when checkpoint ``step`` cannot be used: resume the newest earlier whole one."""
    found = dict(checkpoints(out))
    for earlier in sorted((s for s in found if s < step), reverse=True):
        try:
            verify(found[earlier], world, identity)
        except CheckpointError:
            continue
        return (f" The newest whole checkpoint before it is step {earlier}: resume from it with --resume {out} "
                f"--from-step {earlier} (the later checkpoints are then set aside)")
    return " No earlier checkpoint of this run is whole; start a new run"


def load(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         d: Dist) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restores model and optimizer from ``ckpt`` (checked with ``verify`` first); returns
    (train_state, this rank's rank_state). Nothing read can run code: ``torch.load`` with
    ``weights_only=True``, and the allow-list reader of ``coat.cli.safe_load`` for DCP."""
    try:
        if d.enabled:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                                 set_model_state_dict, set_optimizer_state_dict)

            from coat.cli.safe_load import SafeFileSystemReader, SafeLoadPlanner

            sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
            dcp.load(sd, storage_reader=SafeFileSystemReader(str(ckpt)), planner=SafeLoadPlanner())
            set_model_state_dict(model, sd["model"])
            set_optimizer_state_dict(model, optimizer, sd["optim"])
        else:
            sd = torch.load(ckpt / "model_optim.pt", map_location=next(model.parameters()).device, weights_only=True)
            getattr(model, "load_side_state_dict", model.load_state_dict)(sd["model"])
            optimizer.load_state_dict(sd["optim"])
        train_state = torch.load(ckpt / "train_state.pt", weights_only=True)
        rank_state = torch.load(ckpt / f"rank{d.rank:05d}.pt", weights_only=True)
    except (Exception, CheckpointException) as e:  # torch's refusal of a pickle names the global among advice
        raise CheckpointError(f"it could not be loaded safely ({type(e).__name__}: {unpickling_cause(e)})") from e
    return train_state, rank_state
