"""Loss-curve plots from the metrics.jsonl files that ``coat train`` writes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

PathLike = str | os.PathLike


def read_metrics(path: PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in order (blank lines skipped). Non-finite values
    are written as null, so every line is strict JSON."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def plot_runs(runs: Mapping[str, PathLike], out_png: PathLike, title: str | None = None) -> Path:
    """Train (solid) and validation (dashed, dots) loss of several runs on one PNG.

    ``runs`` maps a label (e.g. "torch", "coat") to that run's metrics.jsonl; each run gets
    one colour so its two curves read as a pair.
    """
    # The object-oriented API with an explicit Agg canvas renders without touching pyplot's
    # global backend (safe in headless jobs and inside user programs). Imported lazily
    # because matplotlib is slow to import and only needed once a run finishes.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, (label, path) in enumerate(runs.items()):
        records = read_metrics(path)
        color = f"C{i}"
        prefix = f"{label} " if label else ""
        steps, loss = _series(records, "loss")
        if steps:
            ax.plot(steps, loss, color=color, alpha=0.6, linewidth=1.2, label=f"{prefix}train")
        steps, val = _series(records, "val_loss")
        if steps:
            ax.plot(steps, val, color=color, linestyle="--", marker="o", markersize=3,
                    label=f"{prefix}val ({val[-1]:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def plot_comparison(runs: Mapping[str, PathLike], out_png: PathLike, title: str | None = None) -> Path:
    """Two panels: train (solid) and validation (dashed) loss of every run over the whole run, and
    the validation loss alone over the second half, where recipes that train alike differ."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5), dpi=120)
    FigureCanvasAgg(fig)
    full, zoom = fig.subplots(1, 2)
    for i, (label, path) in enumerate(runs.items()):
        records = read_metrics(path)
        color = f"C{i}"
        steps, loss = _series(records, "loss")
        if steps:
            full.plot(steps, loss, color=color, alpha=0.6, linewidth=1.2, label=f"{label} train")
        steps, val = _series(records, "val_loss")
        if steps:
            full.plot(steps, val, color=color, linestyle="--", marker="o", markersize=3,
                      label=f"{label} val ({val[-1]:.4f})")
            half = steps[-1] / 2
            tail = [(s, v) for s, v in zip(steps, val) if s >= half]
            zoom.plot([s for s, _ in tail], [v for _, v in tail], color=color, linestyle="--", marker="o",
                      markersize=4, label=f"{label} val")
    full.set_title("loss")
    zoom.set_title("validation loss, second half")
    for ax in (full, zoom):
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def plot_loss(metrics_path: PathLike, out_png: PathLike, title: str | None = None) -> Path:
    """Train and validation loss of a single run."""
    return plot_runs({"": metrics_path}, out_png, title)
