"""Loss-curve plots from the metrics.jsonl files that ``coat train`` writes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

PathLike = str | os.PathLike


def read_metrics(path: PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in order (blank lines skipped). Non-finite values
    are written as null, so every line is strict JSON; a torn last line (a process killed
    mid-write) is skipped."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
    return [json.loads(line) for line in lines]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def _figure(width: float):
    # The object-oriented API with an explicit Agg canvas renders without touching pyplot's
    # global backend (safe in headless jobs and inside user programs). Imported lazily
    # because matplotlib is slow to import and only needed once a run finishes.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, 5), dpi=120)
    FigureCanvasAgg(fig)
    return fig


def _draw_run(ax, records: list[dict[str, Any]], color: str, prefix: str, digits: int) -> tuple[list, list]:
    """One run's train loss (solid) and validation loss (dashed, dots) on ``ax``; returns the
    validation series."""
    steps, loss = _series(records, "loss")
    if steps:
        ax.plot(steps, loss, color=color, alpha=0.6, linewidth=1.2, label=f"{prefix}train")
    steps, val = _series(records, "val_loss")
    if steps:
        ax.plot(steps, val, color=color, linestyle="--", marker="o", markersize=3,
                label=f"{prefix}val ({val[-1]:.{digits}f})")
    p_steps, prose = _series(records, "val_prose_loss")
    if p_steps:
        ax.plot(p_steps, prose, color=color, linestyle=":", marker="s", markersize=3,
                label=f"{prefix}held-out prose ({prose[-1]:.{digits}f})")
    return steps, val


def _save(fig, axes, out_png: PathLike) -> Path:
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:  # whole or absent: a full disk leaves no truncated image
        fig.savefig(tmp, format=out.suffix.lstrip(".") or "png")
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def plot_runs(runs: Mapping[str, PathLike], out_png: PathLike, title: str | None = None) -> Path:
    """Train (solid) and validation (dashed, dots) loss of several runs on one PNG.

    ``runs`` maps a label (e.g. "torch", "coat") to that run's metrics.jsonl; each run gets
    one colour so its two curves read as a pair.
    """
    fig = _figure(8)
    ax = fig.add_subplot()
    for i, (label, path) in enumerate(runs.items()):
        _draw_run(ax, read_metrics(path), f"C{i}", f"{label} " if label else "", 3)
    if title:
        ax.set_title(title)
    return _save(fig, [ax], out_png)


def plot_comparison(runs: Mapping[str, PathLike], out_png: PathLike, title: str | None = None) -> Path:
    """Two panels: train (solid) and validation (dashed) loss of every run over the whole run, and
    the validation loss alone over the second half, where recipes that train alike differ."""
    fig = _figure(12)
    full, zoom = fig.subplots(1, 2)
    for i, (label, path) in enumerate(runs.items()):
        color = f"C{i}"
        steps, val = _draw_run(full, read_metrics(path), color, f"{label} ", 4)
        if steps:
            half = steps[-1] / 2
            tail = [(s, v) for s, v in zip(steps, val) if s >= half]
            zoom.plot([s for s, _ in tail], [v for _, v in tail], color=color, linestyle="--", marker="o",
                      markersize=4, label=f"{label} val")
    full.set_title("loss")
    zoom.set_title("validation loss, second half")
    if title:
        fig.suptitle(title)
    return _save(fig, [full, zoom], out_png)


def plot_loss(metrics_path: PathLike, out_png: PathLike, title: str | None = None) -> Path:
    """Train and validation loss of a single run."""
    return plot_runs({"": metrics_path}, out_png, title)
