"""The multi-seed quality records, benchmarks/results/quality_*.json, read as one study.

Each record holds one lease's runs: {"commit", "device", "commands": {setup: command}, "runs":
{name: run}}. A run's name starts with its setup's letter (A, B, ...), then the seed, then a
suffix for the recipe (B3: bf16 seed 3, B3c: coat, B2l: coat lean, B0r: coat lean + release, B0s: SubsetNormSM, B1k /
B1w: coat with block / row scaling); a run carries recipe, seed, master_weights (fp32 / bf16_sr),
release_grads (absent: off), fp8_granularity (absent: tensor),
final_val_loss, final_val_prose_loss (runs that scored the held-out prose set), tokens_per_s,
val_curve (and prose_curve), train_curve. Records of the same setup on different commits are one
study as long as training's numerics did not change between them (a record's "notes" say so):
seed s gives every recipe the same initial weights and batches on each commit. Used by
tools/readme_tables.py (README's quality block) and benchmarks/plot_quality.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
PATTERN = "quality_*.json"


def label(run: Mapping[str, Any]) -> str:
    """A run's recipe as the study groups it: bf16, coat, coat lean (bf16 master weights with
    stochastic rounding), coat lean + release (and gradient release)."""
    name = run["recipe"] + (" lean" if run.get("master_weights") == "bf16_sr" else "")
    if run.get("fp8_granularity", "tensor") != "tensor":  # the FP8 layers' scaling (issue 28)
        name += f" {run['fp8_granularity']}"
    return name + (" + release" if run.get("release_grads") else "")


def setup(name: str) -> str:
    """A run's setup: the letter its name starts with."""
    return name[0]


def merge(records: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """{source: record} -> {run name: run, with the record's commit and source added}. A run name
    in two records, or one (setup, recipe, seed) run twice, is an error: one cell, two figures."""
    runs: dict[str, dict[str, Any]] = {}
    seen: dict[tuple[str, str, int], str] = {}
    for source, rec in records.items():
        for name, run in rec["runs"].items():
            if name in runs:
                raise ValueError(f"run {name} is in both {runs[name]['source']} and {source}")
            key = (setup(name), label(run), run["seed"])
            if key in seen:
                raise ValueError(f"{key} is run twice: {seen[key]} and {name} ({source})")
            seen[key] = name
            runs[name] = dict(run, commit=rec["commit"], source=source)
    return runs


def read(paths: Iterable[Path] | None = None) -> dict[str, dict[str, Any]]:
    """{source: record} of the given files (default: every benchmarks/results/quality_*.json)."""
    paths = sorted(RESULTS.glob(PATTERN)) if paths is None else list(paths)
    if not paths:
        raise FileNotFoundError(f"no {PATTERN} under {RESULTS}")
    return {str(p): json.loads(Path(p).read_text()) for p in paths}


def groups(runs: Mapping[str, Mapping[str, Any]], prefix: str = "") -> dict[str, dict[str, dict[int, Mapping[str, Any]]]]:
    """setup -> recipe label -> seed -> run, of the runs whose name starts with prefix."""
    out: dict[str, dict[str, dict[int, Mapping[str, Any]]]] = {}
    for name, run in runs.items():
        if name.startswith(prefix):
            out.setdefault(setup(name), {}).setdefault(label(run), {})[run["seed"]] = run
    return out
