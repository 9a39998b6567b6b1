"""The multi-seed quality records, benchmarks/results/quality_*.json, read as one study.

Each record holds one lease's runs: {"commit", "device", "commands": {setup: command}, "runs":
{name: run}}. A run's name starts with its setup's letter (A, B, ...), then the seed, then a
suffix for the recipe (B3: bf16 seed 3, B3c: coat, B2l: coat lean, B0r: coat lean + release, B0s: SubsetNormSM, B1k /
B1w: coat with block / row scaling); a run carries recipe, seed, master_weights (fp32 / bf16_sr),
release_grads (absent: off), fp8_granularity (absent: tensor), fp8_grad_format / fp8_fast_accum / dre
(absent: coat train's defaults; set by an ablation, labelled "coat e4m3 gradients", "coat no DRE", ...),
final_val_loss, final_val_prose_loss (runs that scored the held-out prose set), tokens_per_s,
val_curve (and prose_curve), train_curve. Records of the same setup on different commits are one
study as long as training's numerics did not change between them (a record's "notes" say so):
seed s gives every recipe the same initial weights and batches on each commit. A record may list
under "replaces" runs of its own that take the place of an earlier record's run of the same setup,
recipe and seed (`--replaces`: a rerun that adds what the earlier one lacked). Used by
tools/readme_tables.py (README's quality block) and benchmarks/plot_quality.py. Run as a script, it
writes a record from `coat train` output folders:

    python benchmarks/quality_records.py OUT.json --commit C --device D --command "C=coat train ..." \
        C0=runs/C0 C0c=runs/C0c ...
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from coat.cli.plot import read_metrics  # noqa: E402
from coat.nn.recipe import Fp8Recipe  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PATTERN = "quality_*.json"


#: coat train's recipe flags that an ablation changes, absent from a run at their default, and how a
#: label names them.
ABLATIONS = {"fp8_grad_format": lambda v: f"{v} gradients", "fp8_fast_accum": lambda v: "no fast accumulation",
             "dre": lambda v: "no DRE"}
ABLATION_DEFAULTS = {"fp8_grad_format": None, "fp8_fast_accum": True, "dre": True}


def label(run: Mapping[str, Any]) -> str:
    """A run's recipe as the study groups it: bf16, coat, coat lean (bf16 master weights with
    stochastic rounding), coat lean + release (and gradient release)."""
    name = run["recipe"] + (" lean" if run.get("master_weights") == "bf16_sr" else "")
    if run.get("fp8_granularity", "tensor") != "tensor":  # the FP8 layers' scaling (issue 28)
        name += f" {run['fp8_granularity']}"
    if run.get("v_scaling", "rank1") != "rank1":  # AdamW4bit's v in blocks of 128 (issue 29)
        name += f" v {run['v_scaling']}"
    for key, part in ABLATIONS.items():  # one FP8 part changed (issue 25 item 5)
        if key in run:
            name += f" {part(run[key])}"
    return name + (" + release" if run.get("release_grads") else "")


def setup(name: str) -> str:
    """A run's setup: the letter its name starts with."""
    return name[0]


def _key(name: str, run: Mapping[str, Any]) -> tuple[str, str, int]:
    return setup(name), label(run), run["seed"]


def merge(records: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """{source: record} -> {run name: run, with the record's commit and source added}. A run name
    in two records, or one (setup, recipe, seed) run twice, is an error: one cell, two figures;
    except a rerun that its record lists under "replaces" (a run repeated to add what the earlier
    one lacked, e.g. the prose evaluation): it takes the earlier run's place, which must exist."""
    replacing: dict[tuple[str, str, int], tuple[str, str]] = {}
    for source, rec in records.items():
        for name in rec.get("replaces", []):
            if name not in rec["runs"]:
                raise ValueError(f"{source} replaces with {name}, which is not one of its runs")
            key = _key(name, rec["runs"][name])
            if key in replacing:
                raise ValueError(f"{key} is replaced twice: by {replacing[key][1]} and {name} ({source})")
            replacing[key] = (source, name)
    runs: dict[str, dict[str, Any]] = {}
    seen: dict[tuple[str, str, int], str] = {}
    replaced: dict[tuple[str, str, int], str] = {}
    for source, rec in records.items():
        for name, run in rec["runs"].items():
            key = _key(name, run)
            if key in replacing and replacing[key] != (source, name):
                if key in replaced:  # two earlier runs of one cell: an error the rerun must not hide
                    raise ValueError(f"{key} is run twice before its rerun {replacing[key][1]}: {replaced[key]} and "
                                     f"{name} ({source})")
                replaced[key] = f"{name} ({source})"
                continue
            if name in runs:
                raise ValueError(f"run {name} is in both {runs[name]['source']} and {source}")
            if key in seen:
                raise ValueError(f"{key} is run twice: {seen[key]} and {name} ({source})")
            seen[key] = name
            runs[name] = dict(run, commit=rec["commit"], source=source)
    missing = sorted(set(replacing) - set(replaced))
    if missing:
        source, name = replacing[missing[0]]
        raise ValueError(f"{name} ({source}) replaces no earlier run of {missing[0]}")
    return runs


def read(paths: Iterable[Path] | None = None) -> dict[str, dict[str, Any]]:
    """{source: record} of the given files (default: every benchmarks/results/quality_*.json)."""
    paths = sorted(RESULTS.glob(PATTERN)) if paths is None else list(paths)
    if not paths:
        raise FileNotFoundError(f"no {PATTERN} under {RESULTS}")
    return {str(p): json.loads(Path(p).read_text()) for p in paths}


def groups(runs: Mapping[str, Mapping[str, Any]],
           prefix: str = "") -> dict[str, dict[str, dict[int, Mapping[str, Any]]]]:
    """setup -> recipe label -> seed -> run, of the runs whose name starts with prefix."""
    out: dict[str, dict[str, dict[int, Mapping[str, Any]]]] = {}
    for name, run in runs.items():
        if name.startswith(prefix):
            out.setdefault(setup(name), {}).setdefault(label(run), {})[run["seed"]] = run
    return out


def run_from_dir(out: Path) -> dict[str, Any]:
    """One run of a record from a finished ``coat train`` output folder (config.json, summary.json,
    metrics.jsonl). A run resumed from a checkpoint keeps its whole curves; its tokens/s is the
    last process's (summary.json's), its train_time_s the whole run's."""
    cfg = json.loads((out / "config.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    if not summary.get("finished"):
        raise ValueError(f"{out}: the run did not finish "
                         f"(step {summary.get('steps')} of {summary.get('planned_steps')})")
    train, records = cfg["train"], read_metrics(out / "metrics.jsonl")

    def curve(key: str) -> list[list[float]]:
        return [[r["step"], r[key]] for r in records if r.get(key) is not None]

    run = {"recipe": summary["recipe"], "setup": cfg["setup"], "seed": train["seed"],
           "master_weights": train["master_weights"], "lr": train["lr"],
           # the setup's flags (the record's command gives the rest); amp is bf16's name on a GPU
           "flags": f"--recipe {'bf16' if cfg['setup'] == 'amp' else cfg['setup']} --seed {train['seed']}",
           "val_curve": curve("val_loss"), "prose_curve": curve("val_prose_loss"), "train_curve": curve("loss")}
    if train.get("release_grads"):
        run["release_grads"] = True
    if train.get("fp8_granularity", "tensor") != "tensor":
        run["fp8_granularity"] = train["fp8_granularity"]
    if train.get("v_scaling", "rank1") != "rank1":
        run["v_scaling"] = train["v_scaling"]
    for key, default in ABLATION_DEFAULTS.items():
        value = train.get(key, default)
        if key == "fp8_grad_format" and value == Fp8Recipe(granularity=train.get("fp8_granularity", "tensor")).grad_format:
            value = None  # the granularity's own default, given: changes nothing
        if value != default:
            run[key] = value
    for key in ("final_val_loss", "final_val_prose_loss", "tokens_per_s", "train_time_s", "n_params", "tokens",
                "steps", "peak_memory_bytes", "optimizer_state_bytes", "device"):
        run[key] = summary.get(key)
    return run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write a quality record from coat train output folders.")
    ap.add_argument("out", type=Path, help="the record to write (benchmarks/results/quality_<what>_<commit>.json)")
    ap.add_argument("runs", nargs="+", metavar="NAME=DIR", help="run name (setup letter, seed, recipe suffix) "
                    "and its output folder")
    ap.add_argument("--commit", required=True, help="the commit the runs trained at")
    ap.add_argument("--device", required=True, help="device, software and how runs shared it")
    ap.add_argument("--command", action="append", default=[], metavar="SETUP=COMMAND", required=True)
    ap.add_argument("--notes", default=None)
    ap.add_argument("--replaces", nargs="+", default=[], metavar="NAME",
                    help="runs of this record that replace the earlier run of their setup, recipe and seed "
                         "(a rerun that adds what the earlier one lacked, e.g. the prose evaluation)")
    args = ap.parse_args(argv)
    if args.out.exists():
        raise SystemExit(f"{args.out} exists: records are written once")
    runs = {}
    for item in args.runs:
        name, sep, path = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"run {item!r}: expected NAME=DIR")
        runs[name] = dict(run_from_dir(Path(path)), commit_ran=args.commit)
    commands = dict(c.partition("=")[::2] for c in args.command)
    rec = {"commit": args.commit, "device": args.device, "commands": commands, "runs": runs}
    if args.notes:
        rec["notes"] = args.notes
    if args.replaces:
        rec["replaces"] = args.replaces
    # one name, one (setup, recipe, seed) in the study of the records beside it; a record named
    # outside the study (a side study, e.g. another learning rate of a recipe) is checked alone
    in_study = args.out.match(PATTERN)
    beside = {str(p): json.loads(p.read_text()) for p in sorted(args.out.parent.glob(PATTERN))} if in_study else {}
    merge({**beside, str(args.out): rec})
    args.out.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"{args.out}: {len(runs)} runs")


if __name__ == "__main__":
    main()
