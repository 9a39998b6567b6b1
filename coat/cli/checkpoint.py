"""Output folders, metrics files and training checkpoints of ``coat train``.

Guarantees:
- A run never writes into a folder that holds files of another run: ``--out`` must be new or
  empty, the default ``runs/<timestamp>`` is created exclusively (``-2``, ``-3``... when taken),
  and a folder in use is locked (``flock``), so two runs never share one.
- A checkpoint is whole or absent: it is written to ``checkpoints/.tmp-step_N``, synced to disk,
  then renamed to ``checkpoints/step_N`` (one atomic rename); a process killed mid-write leaves
  only a ``.tmp-`` folder, which resume ignores and the next save removes.
- metrics.jsonl holds whole JSON lines only (one ``write`` per line); on resume, the records
  after the checkpoint's step (and any torn last line) are dropped through an atomic rewrite.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

from coat.cli.distributed_train import Dist

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_LOCKS: dict[str, Any] = {}  # folder -> open lock file, held for the life of the process


class OutputError(ValueError):
    """The output folder cannot be used (reported against --out or --resume)."""


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
    key = str(out.resolve())
    if key in _LOCKS:
        return
    f = open(out / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise OutputError(f"{out} is in use by another coat train process") from None
    _LOCKS[key] = f


def unlock(out: Path) -> None:
    f = _LOCKS.pop(str(out.resolve()), None)
    if f is not None:
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


def release_if_unused(out: Path) -> None:
    """Removes a folder this run created but never wrote a result into (a failed start)."""
    unlock(out)
    lock_file = out / ".lock"
    if out.is_dir() and {e.name for e in out.iterdir()} <= {".lock"}:
        lock_file.unlink(missing_ok=True)
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
    """Writes strict JSON (non-finite floats become null) through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(finite(obj), indent=2, allow_nan=False, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
            self._f = open(path, "x")  # a new run: never truncates a file that is there
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
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
        self._f = open(path, "a")

    def write(self, rec: dict[str, Any]) -> None:
        self._f.write(json.dumps(finite(rec), allow_nan=False) + "\n")
        self._f.flush()  # a crashed or interrupted run still leaves its curve behind

    def close(self) -> None:
        self._f.close()


# ---- checkpoints --------------------------------------------------------------------------------


def checkpoints(out: Path) -> list[tuple[int, Path]]:
    """The whole checkpoints in ``out``, oldest first."""
    root = out / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / "meta.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(out: Path) -> Path | None:
    found = checkpoints(out)
    return found[-1][1] if found else None


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


def save(out: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         train_state: dict[str, Any], rank_state: dict[str, Any], d: Dist, keep_last: int,
         before_rename: Callable[[], None] | None = None) -> Path:
    """Writes checkpoint ``step`` (collective under torchrun) and keeps the last ``keep_last``.

    ``train_state`` (scheduler, counters) comes from rank 0; ``rank_state`` (RNG states) from
    every rank. Single process: one ``torch.save`` file of model and optimizer; several: a
    ``torch.distributed.checkpoint`` of the sharded model and optimizer state.
    """
    root = out / CHECKPOINTS
    name = f"step_{step:08d}"
    tmp = root / f".tmp-{name}"
    if d.is_main:
        root.mkdir(exist_ok=True)
        for stale in root.glob(".tmp-*"):  # from a killed process (this folder is locked by us)
            shutil.rmtree(stale, ignore_errors=True)
        for stale in root.glob(".del-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    d.barrier()
    if d.enabled:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=str(tmp))
    else:
        _save_file({"model": model.state_dict(), "optim": optimizer.state_dict()}, tmp / "model_optim.pt")
    _save_file(rank_state, tmp / f"rank{d.rank:05d}.pt")
    d.barrier()
    final = root / name
    if d.is_main:
        _save_file(train_state, tmp / "train_state.pt")
        meta = {"step": step, "world_size": d.world, "format": "dcp" if d.enabled else "torch",
                "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        with open(tmp / "meta.json", "w") as f:
            f.write(json.dumps(meta) + "\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if before_rename is not None:
            before_rename()
        if final.exists():
            _remove(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for _, old in checkpoints(out)[:-keep_last]:
            _remove(old)
    d.barrier()
    return final


def read_meta(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "meta.json").read_text())


def load(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         d: Dist) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restores model and optimizer from ``ckpt``; returns (train_state, this rank's rank_state)."""
    meta = read_meta(ckpt)
    if meta["world_size"] != d.world:
        raise OutputError(f"{ckpt} was written by {meta['world_size']} process(es); resume it with the same "
                          f"number (this run has {d.world})")
    if d.enabled:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(sd, checkpoint_id=str(ckpt))
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, optimizer, sd["optim"])
    else:
        device = next(model.parameters()).device
        sd = torch.load(ckpt / "model_optim.pt", map_location=device, weights_only=True)
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])
    train_state = torch.load(ckpt / "train_state.pt", weights_only=True)
    rank_state = torch.load(ckpt / f"rank{d.rank:05d}.pt", weights_only=True)
    return train_state, rank_state
