"""Shared benchmark helpers: CUDA-event timing, copy-bandwidth ceiling, environment facts."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import torch


def time_ms(fn, *, warmup: int = 3, reps: int = 20, inputs=None, graph: bool = True) -> float:
    """Median device milliseconds of one fn(*inputs[i]) call.

    With graph=True the calls (one per input set, rotating so L2 does not serve repeated reads)
    are captured into a CUDA graph and each replay is timed with CUDA events: this measures the
    kernels, not the Python launch overhead (host_us_per_call measures that). Falls back to timing
    eager calls when capture fails."""
    inputs = inputs or [()]
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for args in inputs:
                    fn(*args)
            g.replay()
            torch.cuda.synchronize()
            return _median_events(g.replay, reps) / len(inputs)
        except Exception:  # noqa: BLE001 - some baselines (e.g. host syncs) cannot be captured
            torch.cuda.synchronize()
    return _median_events(lambda: [fn(*args) for args in inputs], reps) / len(inputs)


def back_to_back_ms(fn, reps: int, warmup: int = 0) -> float:
    """Mean device milliseconds of fn over reps calls issued back to back (the host queues ahead, as in
    training: whole steps, where time_ms's synchronized single calls would add the host's work)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def _median_events(run, reps: int) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def host_us_per_call(fn, args=(), calls: int = 200) -> float:
    """Host-side microseconds per call (launch overhead), with the device kept busy elsewhere."""
    import time

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    # Eager (a captured copy_ becomes a copy-engine memcpy node, slower than the SM copy kernel).
    ms = time_ms(lambda: dst.copy_(src), reps=20, graph=False)
    del src, dst
    return 2 * nbytes / ms / 1e6


def rotation(make, nbytes_each: int, min_total: int = 512 << 20, max_sets: int = 8):
    """As many input sets from make() as it takes to exceed the L2 several times over."""
    n = max(1, min(max_sets, -(-min_total // max(nbytes_each, 1))))
    return [make() for _ in range(n)]


def environment() -> dict:
    import os

    if os.environ.get("COAT_COMMIT"):  # the GPU machine gets a copy of the tree without .git
        commit = os.environ["COAT_COMMIT"]
    else:
        commit = _git_commit()
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": commit,
    }


def _git_commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    return commit


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
    return "\n".join(out)
