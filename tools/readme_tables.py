"""README.md's result tables, written from the recorded results so that they cannot drift from them.

README.md holds blocks

    <!-- generated: NAME -->
    ...
    <!-- end generated -->

and BLOCKS below names, for each NAME, the JSON file under benchmarks/results it is made from (or a
wildcard: every matching file, e.g. all the quality_*.json records of the multi-seed study) and
the function that formats it. `python tools/readme_tables.py` rewrites the blocks in place;
`--check` writes nothing and exits 1 with a diff when README.md differs from what the results give
(tests/python/test_readme.py runs it, so CI fails on a stale README). Every block in README.md must
have an entry and every entry a block.

Adding a table: record the run's JSON under benchmarks/results, add one line to BLOCKS (a new
`coat train` comparison, e.g. a CPU default run saved as benchmarks/results/train_cpu/compare.json,
takes the existing `train_comparison` formatter), put an empty block with that NAME where README
shows it, and run this script.

Figures are copied, rounded, from the JSON; `coat estimate`'s columns are computed by coat.memory,
the model `coat estimate` itself runs, so they follow the code.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

from coat import recipes

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
E2E = "benchmarks/results/bench_e2e.json"
H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"

BEGIN = re.compile(r"^<!-- generated: (?P<name>[\w.-]+) -->$")
END = "<!-- end generated -->"


# ---- bench_e2e.json (benchmarks/bench_e2e.py, `coat bench`) -------------------------------------

def _records(data: dict[str, Any], device: str, model: str) -> dict[tuple[str, int], dict[str, Any]]:
    """(setup, batch) -> record of one GPU, one process, for one device and model; setups named as
    coat.recipes names them (records of older runs say coat-lean-release for coat-lean+release)."""
    out = {}
    for r in data["records"]:
        if r.get("device") == device and r["model"] == model and r.get("world", 1) == 1:
            key = (recipes.canonical(r["setup"]), r["batch"])
            if key in out:
                raise ValueError(f"two records of {model} {key} on {device}: one table cell, two figures")
            out[key] = r
    return out


def _runs(recs: dict, setup: str) -> list[dict[str, Any]]:
    return sorted((r for (s, _), r in recs.items() if s == setup), key=lambda r: r["batch"])


def _largest_ok(recs: dict, setup: str) -> dict[str, Any] | None:
    ok = [r for r in _runs(recs, setup) if r["status"] == "ok"]
    return ok[-1] if ok else None


def _first_oom(recs: dict, setup: str) -> int | None:
    oom = [r["batch"] for r in _runs(recs, setup) if r["status"] == "oom"]
    return min(oom) if oom else None


def _commits(rs) -> str:
    seen = sorted({r["commit"] for r in rs if r})
    return ", ".join(f"`{c}`" for c in seen)


def _tok(r: dict[str, Any] | None) -> str:
    return "-" if r is None or r["status"] != "ok" else f"{r['tokens_per_s']:,.0f}"


SUMMARY_SETUPS = [("BF16 AMP", "amp"), ("pure bf16", "bf16"), ("coat", "coat"), ("coat lean (bf16_sr)", "coat-lean"),
                  ("coat lean + gradient release", "coat-lean+release")]


def e2e_summary(data: dict[str, Any], source: str) -> str:
    """Llama-2-7B on one H100: batch 1, the largest batch run, the first batch out of memory."""
    recs = _records(data, H100, "llama2-7b")
    cols = [(label, setup) for label, setup in SUMMARY_SETUPS if _runs(recs, setup)]
    rows = {"peak at batch 1": [], "tokens/s at batch 1": [], "largest batch run (tokens/s)": [],
            "out of memory at batch": []}
    used = []
    for _, setup in cols:
        one = recs.get((setup, 1))
        used.append(one)
        rows["peak at batch 1"].append(
            "not run" if one is None else "out of memory" if one["status"] == "oom" else f"{one['peak_gib']:.1f} GiB")
        rows["tokens/s at batch 1"].append(_tok(one))
        top = _largest_ok(recs, setup)
        used.append(top)
        rows["largest batch run (tokens/s)"].append("none" if top is None else f"{top['batch']} ({_tok(top)})")
        oom = _first_oom(recs, setup)
        rows["out of memory at batch"].append("not tried" if oom is None else str(oom))
        used += [r for r in _runs(recs, setup) if r["status"] == "oom"]
    lines = [f"Llama-2-7B, sequence 2048, one H100 80 GB (`{source}`, commits {_commits(used)}; "
             "benchmarks/RESULTS.md section 6 defines each figure):", "",
             "| | " + " | ".join(label for label, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows.items()]
    return "\n".join(lines)


def _ok_pairs(recs: dict, base: str, other: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(base, other) records of the batches where both setups ran without error."""
    pairs = []
    for b in _runs(recs, base):
        o = recs.get((other, b["batch"]))
        if b["status"] == "ok" and o is not None and o["status"] == "ok":
            pairs.append((b, o))
    return pairs


def e2e_peer(data: dict[str, Any], source: str) -> str:
    """torchao (float8 training, torch.compile, 8-bit AdamW) beside coat lean, per batch."""
    recs = _records(data, H100, "llama2-7b")
    lines = ["| batch | torchao: peak | tokens/s | coat lean: peak | tokens/s | coat lean tokens/s vs torchao | commits |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for peer, lean in _ok_pairs(recs, "torchao", "coat-lean"):
        lines.append(f"| {peer['batch']} | {peer['peak_gib']:.1f} GiB | {_tok(peer)} | {lean['peak_gib']:.1f} GiB | "
                     f"{_tok(lean)} | {lean['tokens_per_s'] / peer['tokens_per_s']:.2f}x | "
                     f"{_commits([peer, lean])} |")
    return "\n".join(lines)


def e2e_lora(data: dict[str, Any], source: str) -> str:
    """PEFT LoRA on bf16 weights against LoRA on coat's FP8-frozen base, at the batches both ran."""
    lines = ["| model | batch | PEFT bf16 LoRA: peak | tokens/s | coat, FP8 base: peak | tokens/s | peak | tokens/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for model, name in (("llama2-7b", "Llama-2-7B"), ("llama3-8b", "Llama-3-8B")):
        recs = _records(data, H100, model)
        for peft, ours in _ok_pairs(recs, "bf16+lora", "coat+lora"):
            lines.append(f"| {name} | {peft['batch']} | {peft['peak_gib']:.1f} GiB | {_tok(peft)} | "
                         f"{ours['peak_gib']:.1f} GiB | {_tok(ours)} | {ours['peak_gib'] / peft['peak_gib']:.2f}x | "
                         f"{ours['tokens_per_s'] / peft['tokens_per_s']:.2f}x |")
    return "\n".join(lines)


def e2e_largest(data: dict[str, Any], source: str) -> str:
    """One sentence each: coat against BF16 AMP at their largest batches on an H200; 13B on an H100."""
    parts = []
    h200 = _records(data, H200, "llama2-7b")
    coat, amp = _largest_ok(h200, "coat"), _largest_ok(h200, "amp")
    if coat and amp:
        parts.append(f"On one H200 (Llama-2-7B): coat at batch {coat['batch']} trains at {_tok(coat)} tokens/s, "
                     f"{coat['tokens_per_s'] / amp['tokens_per_s']:.2f}x BF16 AMP at its largest batch "
                     f"({amp['batch']}, {_tok(amp)} tokens/s; {_commits([coat, amp])}).")
    big = _largest_ok(_records(data, H100, "llama2-13b"), "coat-lean+release")
    if big:
        parts.append(f"On one H100: Llama-2-13B, full-parameter AdamW, trains at batch {big['batch']} "
                     f"({_tok(big)} tokens/s, {big['peak_gib']:.1f} GiB; {_commits([big])}) with coat lean, "
                     "gradient release and the fused loss.")
    return " ".join(parts)


MODEL_NAMES = {"llama2-7b": "Llama-2-7B", "llama3-8b": "Llama-3-8B", "llama2-13b": "Llama-2-13B",
               "codellama-34b": "CodeLlama-34B", "llama2-70b": "Llama-2-70B"}
#: The order of setups in the tables that list several (the summary's, then the rest).
SETUP_ORDER = [s for _, s in SUMMARY_SETUPS] + ["coat4bit", "coat4bit-lean", "coat4bit-lean+release",
                                                "coat4bit-lean+v-block+release"]


def _setup_rank(r: dict[str, Any]) -> int:
    name = recipes.canonical(r["setup"])
    return SETUP_ORDER.index(name) if name in SETUP_ORDER else len(SETUP_ORDER)


def e2e_two_gpus(data: dict[str, Any], source: str) -> str:
    """FSDP2 over two H200s (torchrun, one rank per GPU): per-GPU peak beside coat.memory's plan,
    tokens/s per GPU, over BF16 AMP at the same batch, host time over step time; and AMP's plan
    where AMP was not run because it cannot fit."""
    from coat import memory  # the model `coat estimate` runs

    from coat.cli import bench  # its MFU: model FLOPs at the measured tokens/s over the dense BF16 peak

    rs = [r for r in data["records"] if r.get("world", 1) == 2 and r.get("device") == H200 and r["status"] == "ok"
          and r.get("fsdp_unit", 1) == 1]  # one fully_shard per layer; other unit sizes: RESULTS.md section 25
    amp = {(r["model"], r["batch"]): r for r in rs if recipes.canonical(r["setup"]) == "amp"}
    order = {m: i for i, m in enumerate(MODEL_NAMES)}
    rs.sort(key=lambda r: (order.get(r["model"], 99), r["model"], _setup_rank(r), r["batch"]))
    bench.add_mfu(rs)
    lines = ["| model | setup | batch per GPU | peak per GPU (estimate) | tokens/s per GPU | vs BF16 AMP | TFLOP/s (MFU) "
             "| host / step, spread |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rs:
        a = amp.get((r["model"], r["batch"]))
        lines.append(f"| {MODEL_NAMES.get(r['model'], r['model'])} | {recipes.canonical(r['setup'])} | {r['batch']} | "
                     f"{r['peak_gib']:.1f} GiB ({r['estimate_gib']:.1f}) | {_tok(r)} | "
                     f"{'-' if a is None else format(r['tokens_per_s'] / a['tokens_per_s'], '.2f') + 'x'} | "
                     f"{bench.mfu_cell(r)} | {r['host_ms'] / r['step_ms']:.2f}, {r['spread']:.1%} |")
    notes = []
    for model in sorted({r["model"] for r in rs} - {m for m, _ in amp}, key=lambda m: order.get(m, 99)):
        need = memory.plan(memory.load_shape(model), "amp", 1, 2048, gpus=2).peak / memory.GiB
        notes.append(f"BF16 AMP was not run on {MODEL_NAMES.get(model, model)}: its plan at batch 1 is {need:.0f} GiB "
                     "per GPU, more than an H200's 140.")
    return "\n".join(lines + ([""] + notes if notes else []) + ["", f"Measured at {_commits(rs)}: `python "
                      "benchmarks/bench_e2e.py --fsdp 2 --fsdp-unit 1 ...` (one layer per FSDP2 unit; benchmarks/RESULTS.md sections "
                      "11, 13, 25 and 40; other unit sizes: section 41). MFU: model FLOPs (6 per "
                      "parameter and token, plus causal attention) over the H200's dense BF16 peak (989 TFLOP/s); "
                      "coat's GEMMs run in FP8, whose peak is twice that."])


SIDE_PEERS = [("coat+lora", "coat LoRA, FP8 base"), ("bf16+lora", "PEFT LoRA, bf16 base"), ("qlora", "QLoRA")]


def e2e_side(data: dict[str, Any], source: str) -> str:
    """Side tuning (coat.SideTuned, r=16) on one H200 beside LoRA r=16 on coat's FP8 base, PEFT's
    bf16 LoRA and QLoRA at the same batch: peak and tokens/s, eager and replayed from CUDA graphs
    (+graph, where measured), and side tuning's ratios to coat LoRA, eager to eager and graph to graph."""
    lines = ["| model | batch | side tuning: peak | tokens/s | +graph | "
             + " | ".join(f"{n}: peak | tokens/s" + (" | +graph" if s == "coat+lora" else "") for s, n in SIDE_PEERS)
             + " | side / coat LoRA: peak | tokens/s | +graph |", "|---|---:|" + "---:|" * (3 + 2 * len(SIDE_PEERS) + 1 + 3)]
    used = []
    for model in ("llama2-7b", "llama3-8b", "llama2-70b"):
        recs = _records(data, H200, model)
        for side in _runs(recs, "coat+side"):
            if side["status"] != "ok":
                continue
            b = side["batch"]
            ok = {s: r for s in ("coat+side+graph", "coat+lora+graph", *(p for p, _ in SIDE_PEERS))
                  if (r := recs.get((s, b))) and r["status"] == "ok"}
            cells = []
            for s, _ in SIDE_PEERS:
                p = ok.get(s)
                cells.append(f"{p['peak_gib']:.1f} GiB | {_tok(p)}" if p else "- | -")
                if s == "coat+lora":
                    cells.append(_tok(ok.get("coat+lora+graph")))
            lora, sg, lg = ok.get("coat+lora"), ok.get("coat+side+graph"), ok.get("coat+lora+graph")
            ratio = [f"{side['peak_gib'] / lora['peak_gib']:.2f}x" if lora else "-",
                     f"{side['tokens_per_s'] / lora['tokens_per_s']:.2f}x" if lora else "-",
                     f"{sg['tokens_per_s'] / lg['tokens_per_s']:.2f}x" if sg and lg else "-"]
            lines.append(f"| {MODEL_NAMES.get(model, model)} | {b} | {side['peak_gib']:.1f} GiB | {_tok(side)} | "
                         f"{_tok(sg)} | {' | '.join(cells)} | {' | '.join(ratio)} |")
            used += [side] + list(ok.values())
    return "\n".join(lines + ["", f"Measured on one H200 at {_commits(used)}: `python benchmarks/bench_e2e.py --setups "
                              "coat+side coat+side+graph coat+lora coat+lora+graph bf16+lora qlora ...` (benchmarks/"
                              "RESULTS.md sections 13, 42, 49 and 52)."])


def e2e_4bit(data: dict[str, Any], source: str) -> str:
    """4-bit AdamW states (coat.optim.AdamW4bit) beside coat's FP8 states, one GPU, same batch."""
    lines = ["| model | batch | setup | peak (estimate) | tokens/s |", "|---|---:|---|---:|---:|"]
    used = []
    for model in ("llama2-7b",):
        recs = _records(data, H200, model)
        for setup in ("coat", "coat4bit", "coat-lean+release", "coat4bit-lean+release", "coat4bit-lean+v-block+release"):
            r = recs.get((setup, 1))
            if r is not None and r["status"] == "ok":
                lines.append(f"| {MODEL_NAMES[model]} | 1 | {setup} | {r['peak_gib']:.1f} GiB ({r['estimate_gib']:.1f}) "
                             f"| {_tok(r)} |")
                used.append(r)
    return "\n".join(lines + ["", f"One H200, sequence 2048, {_commits(used)} (benchmarks/RESULTS.md sections 13, "
                              "25, 49, 51 and 54)."])


def train_scaling(data: dict[str, Any], source: str) -> str:
    """`coat train` on one GPU and under torchrun on two (per --fsdp-unit where the record has
    several): tokens/s per GPU, scaling efficiency."""
    one = next(r for r in data["runs"] if r["world"] == 1)
    twos = [r for r in data["runs"] if r["world"] == 2]

    def two_text(r: dict[str, Any]) -> str:
        per = r["tokens_per_s"] / r["world"]
        unit = f" --fsdp-unit {r.get('fsdp_unit', 1)}"  # explicit: the default is auto since RESULTS.md section 41
        return (f"`torchrun --nproc_per_node 2 -m coat train{unit}` {r['tokens_per_s']:,.0f} tokens/s, {per:,.0f} per "
                f"GPU: {per / one['tokens_per_s']:.0%} scaling efficiency")

    return (f"`coat train` (the GPU default model, {data['n_params'] / 1e6:.0f}M parameters, {data['tokens_per_rank_step']:,} "
            f"tokens per GPU and step, coat recipe) on {data['device_short']}: one GPU {one['tokens_per_s']:,.0f} tokens/s; "
            f"{'; '.join(two_text(r) for r in twos)} (commit `{data['commit']}`, benchmarks/RESULTS.md section 25).")


ESTIMATE_ROWS = [("llama2-7b", "Llama-2-7B", "amp", "amp", "BF16 AMP"),
                 ("llama2-7b", "Llama-2-7B", "bf16", "bf16", "pure bf16"),
                 ("llama2-7b", "Llama-2-7B", "coat", "coat", "coat"),
                 ("llama2-7b", "Llama-2-7B", "coat-lean", "coat-lean", "coat-lean"),
                 ("llama2-7b", "Llama-2-7B", "coat-lean+release", "coat-lean+release", "coat-lean+release"),
                 ("llama2-13b", "Llama-2-13B", "coat-lean+release", "coat-lean+release", "coat-lean+release")]


def estimate_table(data: dict[str, Any], source: str) -> str:
    """coat estimate (computed now, by coat.memory) beside every H100 measurement of the same setup."""
    from coat import memory  # the model `coat estimate` runs; imported here: the other blocks need no torch

    gpu_gib = memory.GPU_RATES["h100"]["memory_gib"]
    lines = ["| model | recipe | estimate, batch 1 | largest batch (estimate) | measured on one H100 |",
             "|---|---|---:|---:|---|"]
    for model, name, recipe, setup, label in ESTIMATE_ROWS:
        shape = memory.load_shape(model)
        peak = memory.plan(shape, recipe, 1, 2048).peak / memory.GiB
        largest = memory.max_batch(shape, recipe, 2048, gpu_gib)
        measured = []
        for r in _runs(_records(data, H100, model), setup):
            if r["status"] == "oom":
                measured.append(f"out of memory at batch {r['batch']}")
            elif r["status"] == "ok":
                measured.append(f"{r['peak_gib']:.2f} GiB at {r['batch']}")
        lines.append(f"| {name} | {label} | {peak:.1f} GiB | {largest or 'none'} | {'; '.join(measured) or 'not run'} |")
    return "\n".join(lines)


# ---- `coat train` comparisons (OUT/comparison.json's rows) --------------------------------------

def train_comparison(data: dict[str, Any], source: str) -> str:
    """A `coat train` comparison: the rows of comparison.md, from the comparison's JSON rows."""
    from coat.cli.compare import _fmt_bytes, _ratio  # comparison.md's own formatting, so the two agree

    base, other = "bf16", "coat"
    a, b = data[base], data[other]
    mem = {"cuda_max_allocated": "peak memory (CUDA max allocated)", "peak_rss": "peak memory (process RSS)",
           "peak_rss_process_lifetime": "peak memory (process RSS, whole process lifetime)"}
    dv = b["final_val_loss"] - a["final_val_loss"]
    rows = [("final validation loss", f"{a['final_val_loss']:.4f}", f"{b['final_val_loss']:.4f}",
             f"{dv:+.4f} ({dv / a['final_val_loss']:+.2%})"),
            (mem.get(b["peak_memory_kind"], "peak memory"), _fmt_bytes(a["peak_memory_bytes"]),
             _fmt_bytes(b["peak_memory_bytes"]), _ratio(a["peak_memory_bytes"], b["peak_memory_bytes"])),
            ("optimizer states", _fmt_bytes(a["optimizer_state_bytes"]), _fmt_bytes(b["optimizer_state_bytes"]),
             _ratio(a["optimizer_state_bytes"], b["optimizer_state_bytes"])),
            ("tokens/s", f"{a['tokens_per_s']:,.0f}", f"{b['tokens_per_s']:,.0f}",
             _ratio(a["tokens_per_s"], b["tokens_per_s"]))]
    lines = [f"{data['title']} (`{source}`):", "", f"| | {base} | {other} | {other} vs {base} |", "|---|---:|---:|---:|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} |" for r in rows]
    return "\n".join(lines)


def _quality_records():
    """benchmarks/quality_records.py (the quality_*.json reader plot_quality.py also uses)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("quality_records", ROOT / "benchmarks" / "quality_records.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def quality_study(data: dict[str, Any], source: str) -> str:
    """The multi-seed quality records ({file: record}, every benchmarks/results/quality_*.json,
    benchmarks/quality_records.py's format) as one study: each setup's final validation loss over
    seeds, and each recipe's paired difference from bf16 (same seed) with its 95% CI."""
    from coat.cli.seeds import paired_stats
    from coat.cli.stats import mean_std

    qr = _quality_records()
    runs = qr.merge(data)

    def paired(base: dict, seeds: dict, key: str) -> str:
        """The mean paired difference from bf16 on one held-out set, with its 95% CI (2+ pairs)."""
        pairs = {s: (base[s][key], r[key]) for s, r in seeds.items()
                 if s in base and base[s].get(key) is not None and r.get(key) is not None}
        if len(pairs) < 2:
            return "- | -"
        st = paired_stats(pairs)
        bm = st["base"]["mean"]
        return f"{st['mean_diff'] / bm:+.2%} ({len(pairs)}) | [{st['ci95'][0] / bm:+.2%}, {st['ci95'][1] / bm:+.2%}]"

    lines = ["| setup | recipe | seeds | mean final val loss (its own seeds) | std / mean | val: paired diff. from bf16 "
             "(pairs) | 95% CI "
             "| prose: paired diff. (pairs) | 95% CI |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for setup, recipes_ in sorted(qr.groups(runs).items()):
        base = recipes_.get("bf16", {})
        for recipe, seeds in sorted(recipes_.items(), key=lambda kv: (kv[0] != "bf16", kv[0])):
            losses = [r["final_val_loss"] for _, r in sorted(seeds.items())]
            mean, sd = mean_std(losses)
            spread = f"{sd / mean:.2%}" if sd is not None else "-"
            diffs = "- | - | - | -" if recipe == "bf16" else (
                f"{paired(base, seeds, 'final_val_loss')} | {paired(base, seeds, 'final_val_prose_loss')}")
            lines.append(f"| {setup} | {recipe} | {len(losses)} | {mean:.4f} | {spread} | {diffs} |")
    lines += ["", "A recipe's mean is over its own seeds, bf16's over all of its own: compare recipes by the paired "
              "differences, which take each seed against the bf16 run of the same seed."]
    lines.append("")
    for path, rec in data.items():
        lines.append(f"{rec['device']}, commit `{rec['commit']}`; " + "; ".join(
            f"{k}: `{v}`" for k, v in rec["commands"].items()) + f" ({path}).")
        lines.append("")
    return "\n".join(lines)


def quality_main(data: dict[str, Any], source: str, setup: str = "B", recipe: str = "coat") -> str:
    """The main job's comparison over paired seeds, from the quality records: ``recipe`` against
    bf16 at ``setup``, the mean final losses of both held-out sets with the paired difference and
    its 95% CI, peak memory and the tokens/s ratio of the same seed's two runs (one lease)."""
    from coat.cli.seeds import paired_stats

    qr = _quality_records()
    runs = qr.groups(qr.merge(data))[setup]
    base, other = runs["bf16"], runs[recipe]
    seeds = sorted(set(base) & set(other))

    def diff_row(what: str, key: str) -> str:
        pairs = {s: (base[s][key], other[s][key]) for s in seeds
                 if base[s].get(key) is not None and other[s].get(key) is not None}
        st = paired_stats(pairs)
        bm = st["base"]["mean"]
        ci = "" if st["ci95"] is None else f", 95% CI [{st['ci95'][0] / bm:+.2%}, {st['ci95'][1] / bm:+.2%}]"
        return (f"| {what}, mean of {st['n']} seed{'s' * (st['n'] > 1)} | {bm:.4f} | {st['other']['mean']:.4f} | "
                f"{st['mean_diff'] / bm:+.2%}{ci} |")

    def mean_of(rows: dict, key: str) -> tuple[float, int]:
        vals = [rows[s][key] for s in seeds if rows[s].get(key)]
        return sum(vals) / len(vals), len(vals)

    # the records this table reads: those with runs of the two recipes at the setup
    shown = [r for r in data.values() if setup in r["commands"] and any(
        qr.setup(name) == setup and qr.label(run) in ("bf16", recipe) for name, run in r["runs"].items())]
    (pb, n), (po, _) = mean_of(base, "peak_memory_bytes"), mean_of(other, "peak_memory_bytes")
    # tokens/s of runs that had a GPU each (a record's device line says when runs shared one)
    def alone(run: dict) -> bool:
        return not any(w in data[run["source"]]["device"] for w in ("two runs at a time", "shared"))

    timed = [s for s in seeds if alone(base[s]) and alone(other[s])] or seeds
    ratios = [other[s]["tokens_per_s"] / base[s]["tokens_per_s"] for s in timed]
    which = "" if len(timed) == len(seeds) else f" ({len(timed)} seeds whose runs had a GPU each)"
    lines = [f"| | bf16 | {recipe} | {recipe} vs bf16 |", "|---|---:|---:|---:|",
             diff_row("final validation loss", "final_val_loss"),
             diff_row("held-out prose loss", "final_val_prose_loss"),
             f"| peak memory (CUDA max allocated, {n} seeds) | {pb / 2**30:.2f} GiB | {po / 2**30:.2f} GiB | "
             f"{po / pb:.2f}x |",
             f"| tokens/s, ratio of each seed's two runs{which} | | | {sum(ratios) / len(ratios):.2f}x "
             f"({min(ratios):.2f}-{max(ratios):.2f}) |", "",
             f"Setup {setup}: `{next(r['commands'][setup] for r in shown)}`; "
             + ", ".join(f"commit `{r['commit']}` ({r['device']})" for r in shown) + "."]
    return "\n".join(lines)


# ---- README block name -> (JSON under the repository root, formatter) ---------------------------

Formatter = Callable[[dict[str, Any], str], str]
BLOCKS: dict[str, tuple[str, Formatter]] = {
    "e2e-llama2-7b-h100": (E2E, e2e_summary),
    "e2e-torchao-peer": (E2E, e2e_peer),
    "e2e-lora": (E2E, e2e_lora),
    "e2e-largest": (E2E, e2e_largest),
    "train-h200-300": ("benchmarks/results/train_h200/compare_300.json", train_comparison),
    "estimate-80gb": (E2E, estimate_table),
    "e2e-two-gpus": (E2E, e2e_two_gpus),
    "e2e-side": (E2E, e2e_side),
    "e2e-4bit": (E2E, e2e_4bit),
    "train-scaling": ("benchmarks/results/train_scaling_fsdp_unit_aa14618_h200.json", train_scaling),
    "quality-study": ("benchmarks/results/quality_*.json", quality_study),
    "quality-main": ("benchmarks/results/quality_*.json", quality_main),
}


def render(name: str) -> str:
    """A block's text. A source with a wildcard is every matching file, read as {path: JSON}."""
    source, fmt = BLOCKS[name]
    if any(c in source for c in "*?["):
        paths = sorted(ROOT.glob(source))
        if not paths:
            raise ValueError(f"block {name!r}: no file matches {source}")
        data = {p.relative_to(ROOT).as_posix(): json.loads(p.read_text()) for p in paths}
    else:
        with open(ROOT / source) as f:
            data = json.load(f)
    return fmt(data, source).rstrip("\n")


def regenerate(text: str) -> str:
    """README text with every generated block rewritten; ValueError on unknown, unclosed or missing blocks."""
    out, seen, lines, i = [], [], text.split("\n"), 0
    while i < len(lines):
        m = BEGIN.match(lines[i])
        if not m:
            if lines[i] == END:
                raise ValueError(f"README.md line {i + 1}: {END} without a block opened before it")
            out.append(lines[i])
            i += 1
            continue
        name = m.group("name")
        if name not in BLOCKS:
            raise ValueError(f"README.md line {i + 1}: block {name!r} has no entry in tools/readme_tables.py BLOCKS")
        if name in seen:
            raise ValueError(f"README.md line {i + 1}: block {name!r} appears twice")
        seen.append(name)
        j = i + 1
        while j < len(lines) and lines[j] != END:
            if BEGIN.match(lines[j]):
                raise ValueError(f"README.md line {i + 1}: block {name!r} is not closed by {END}")
            j += 1
        if j == len(lines):
            raise ValueError(f"README.md line {i + 1}: block {name!r} is not closed by {END}")
        out += [lines[i], render(name), END]
        i = j + 1
    missing = [n for n in BLOCKS if n not in seen]
    if missing:
        raise ValueError(f"README.md has no block for {', '.join(missing)} (tools/readme_tables.py BLOCKS)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 with a diff if README.md is stale")
    ap.add_argument("--readme", type=Path, default=README)
    args = ap.parse_args(argv)
    text = args.readme.read_text()
    try:
        new = regenerate(text)
    except ValueError as e:
        print(f"tools/readme_tables.py: {e}", file=sys.stderr)
        return 2
    if new == text:
        print(f"{args.readme}: generated blocks match benchmarks/results")
        return 0
    if args.check:
        diff = difflib.unified_diff(text.splitlines(), new.splitlines(), "README.md", "README.md (from results)",
                                    lineterm="")
        print("\n".join(diff))
        print(f"\n{args.readme} differs from benchmarks/results: run python tools/readme_tables.py", file=sys.stderr)
        return 1
    args.readme.write_text(new)
    print(f"{args.readme}: generated blocks rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
