"""coat bench: train whole models for a few steps, one process per configuration, and report peak
memory (beside what ``coat estimate`` predicts), tokens/s and the ratios to the two BF16 baselines
measured in the same run, as a markdown table, JSON and a PNG of memory and tokens/s against batch.

On a GPU the default is Llama-2-7B at sequence 2048; on a CPU a tiny Llama at sequence 128. Each
(setup, batch) runs in a fresh process (``coat.cli.bench_worker``, whose docstring defines every
figure); a setup's batch sweep stops at its first out-of-memory. ``--fsdp N`` runs each
configuration under torchrun on N processes with FSDP2 (``fully_shard`` per ``--fsdp-unit`` decoder
layers; auto: ``coat.memory.auto_fsdp_unit`` per configuration).
``benchmarks/bench_e2e.py`` is this command with the repository's result paths as defaults.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from coat import memory, recipes
from coat.cli.config import fsdp_unit_arg

DEFAULT_SETUPS = ("amp", "bf16", "coat", "coat-lean")
#: ``coat bench``'s plot when --png is not given; taken, the next free ``coat_bench-<n>.png``.
DEFAULT_PNG = "coat_bench.png"
BASELINES = ("amp", "bf16")
DEVICE_DEFAULTS = {"cuda": {"model": "llama2-7b", "seq": 2048, "max_batch": 256},
                   "cpu": {"model": "tiny", "seq": 128, "max_batch": 8}}


class BenchError(ValueError):
    """A bad flag value, reported against the flag."""


def _positive_ints(flag: str, values: list[str]) -> list[int]:
    out = []
    for v in values:
        for part in str(v).split(","):
            if not part:
                continue
            try:
                n = int(part)
            except ValueError:
                raise BenchError(f"argument {flag}: {part!r} is not an integer") from None
            if n <= 0:
                raise BenchError(f"argument {flag}: batches must be positive, got {n}")
            out.append(n)
    return sorted(set(out))


def _setup_batches(items: list[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for item in items or []:
        name, sep, rest = item.partition("=")
        if not sep or not rest:
            raise BenchError(f"argument --setup-batches: expected SETUP=B[,B...], got {item!r}")
        out[recipes.canonical(name)] = _positive_ints("--setup-batches", [rest])
    return out


def commit() -> str:
    if os.environ.get("COAT_COMMIT"):  # a copied tree without .git (the GPU machine)
        return os.environ["COAT_COMMIT"]
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                           cwd=Path(__file__).resolve().parent)
        return r.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Check and complete the flags; raises BenchError naming the flag."""
    import torch

    from coat.cli.bench_worker import SETUPS

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise BenchError("argument --device: cuda requested but torch sees no CUDA device")
    d = DEVICE_DEFAULTS[device]
    models = args.models or [d["model"]]
    shapes = {}
    for m in models:
        try:
            shapes[m] = memory.load_shape(m)
        except ValueError as e:
            raise BenchError(f"argument --model: {e}") from None
    setups = list(args.setups or DEFAULT_SETUPS)
    if setups == ["all"]:
        setups = list(SETUPS)
    setups = list(dict.fromkeys(recipes.canonical(s) for s in setups))  # older names in their new form
    for s in setups:
        if s not in SETUPS:
            raise BenchError(f"argument --setups: unknown setup {s!r} (choose from {', '.join(SETUPS)}, or all)")
    per_setup = _setup_batches(args.setup_batches)
    for s in per_setup:
        if s not in setups:
            raise BenchError(f"argument --setup-batches: {s!r} is not among --setups {', '.join(setups)}")
    seq = d["seq"] if args.seq is None else args.seq  # 0 is refused here, not taken for "default"
    max_batch = d["max_batch"] if args.max_batch is None else args.max_batch
    for flag, v in (("--seq", seq), ("--max-batch", max_batch), ("--warmup", args.warmup + 1), ("--steps", args.steps),
                    ("--fsdp", args.fsdp), ("--max-seconds", args.max_seconds), ("--timeout", args.timeout),
                    ("--skip-predicted-oom", args.skip_predicted_oom)):
        if v is not None and not v > 0:  # NaN too
            raise BenchError(f"argument {flag}: must be positive")
    batches = [2 ** k for k in range(0, 1 + int(math.log2(max_batch)))] if args.batches in (None, ["auto"]) \
        else _positive_ints("--batches", args.batches)
    batches = sorted(set(batches) | {b for bs in per_setup.values() for b in bs})
    for flag, given in (("--fsdp-unit", args.fsdp_unit not in (1, "auto")), ("--fp8-all-gather", args.fp8_all_gather)):
        if given and not args.fsdp:
            raise BenchError(f"argument {flag}: applies to --fsdp runs only")
    too_deep = [n for n, s in shapes.items() if args.fsdp_unit != "auto" and args.fsdp_unit > s.layers]
    if too_deep:
        raise BenchError(f"argument --fsdp-unit: {args.fsdp_unit} is more than the decoder layers of "
                         f"{', '.join(too_deep)}")
    if args.json and Path(args.json).exists():  # refuse before running, not after
        try:
            json.loads(Path(args.json).read_text())
        except json.JSONDecodeError as e:
            raise BenchError(f"argument --json: {args.json} is not valid JSON ({e})") from None
    return dict(device=device, shapes=shapes, setups=setups, per_setup=per_setup, batches=batches, seq=seq,
                world=args.fsdp or 1)


_GPU: dict[str, Any] = {}


def gpu_info() -> dict[str, Any]:
    """Name and memory of GPU 0, asked in a child process: this process must not hold a CUDA context
    (hundreds of MiB) while the configurations measure their peaks."""
    if not _GPU:
        code = ("import torch, json; p = torch.cuda.get_device_properties(0); "
                "print(json.dumps([p.name, p.total_memory]))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        name, total = json.loads(out.stdout.strip().splitlines()[-1])
        _GPU.update(name=name, memory_gib=total / memory.GiB)
    return _GPU


# ---- running configurations ---------------------------------------------------------------------------


def launch(cfg: dict[str, Any], world: int, timeout: float, fsdp: bool) -> dict[str, Any]:
    """Run one configuration in fresh process(es); its result (rank results merged under FSDP2)."""
    with tempfile.TemporaryDirectory(prefix="coat-bench-") as tmp:
        cfg = dict(cfg, result=os.path.join(tmp, "result.json"))
        mod = ["-m", "coat.cli.bench_worker", json.dumps(cfg)]
        run = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] if fsdp else []
        cmd = [sys.executable, *run, *mod]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
        # A session of its own, so a timeout ends torchrun's ranks too, not only torchrun.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        try:
            tail = proc.communicate(timeout=timeout)[0][-3000:]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"status": "timeout", "error": f"no result within {timeout:.0f} s"}
        files = sorted(Path(tmp).glob("result.json*"))
        results = [json.loads(f.read_text()) for f in files if not f.name.endswith(".tmp")]
    if not results:
        return {"status": "error", "error": f"worker exited with code {proc.returncode} and no result", "log": tail}
    if not fsdp:
        return results[0]
    for status in ("oom", "error"):  # one rank's failure is the configuration's
        bad = [r for r in results if r.get("status") == status]
        if bad:
            return bad[0]
    if len(results) < world:
        return {"status": "error", "error": f"only {len(results)} of {world} ranks reported", "log": tail}
    r0 = next(r for r in results if r.get("rank") == 0)
    peaks = [r.get("peak_gib") for r in sorted(results, key=lambda r: r["rank"])]
    return dict(r0, rank_peak_gib=peaks, peak_gib=max((p for p in peaks if p is not None), default=None))


def estimate(shape: memory.ModelShape, setup_recipe: str | None, batch: int, seq: int, world: int,
             device: str, fsdp_unit: int = 1, fp8_all_gather: bool = False) -> float | None:
    if setup_recipe is None:
        return None
    try:
        return memory.plan(shape, setup_recipe, batch, seq, world, "cuda" if device != "cpu" else "cpu",
                           fsdp_unit, fp8_all_gather).peak_gib
    except memory.NotModeled:  # measured all the same, without an estimate beside it
        return None


def fsdp_unit(args: argparse.Namespace, shape: memory.ModelShape, setup_recipe: str | None, batch: int, seq: int,
              world: int, device: str) -> int:
    """--fsdp-unit as given, or auto's choice for this configuration (coat.memory.auto_fsdp_unit,
    sized for GPU 0)."""
    if args.fsdp_unit != "auto":
        return args.fsdp_unit
    gib = None
    if device == "cuda":  # the card, or the smaller one COAT_BENCH_GPU_GIB makes the worker act as
        gib = gpu_info()["memory_gib"]
        cap = os.environ.get("COAT_BENCH_GPU_GIB")
        gib = min(gib, float(cap)) if cap else gib
    return memory.auto_fsdp_unit(shape, setup_recipe, batch, seq, world, gib, args.fp8_all_gather)


def sweep(opts: dict[str, Any], args: argparse.Namespace, log=print) -> list[dict[str, Any]]:
    """Every (model, batch, setup) in order of batch, so a time budget leaves complete small batches."""
    from coat.cli.bench_worker import SETUPS, unavailable

    start = time.time()
    run_id = time.strftime("%Y%m%dT%H%M%S")
    sha = commit()
    world, fsdp = opts["world"], bool(args.fsdp)
    records: list[dict[str, Any]] = []
    last_cost: dict[str, float] = {}
    for name, shape in opts["shapes"].items():
        stopped: dict[str, str] = {}
        for s in opts["setups"]:
            why = unavailable(SETUPS[s], opts["device"], fsdp)
            if why:
                stopped[s] = why
                log(f"skipped {s}: {why}")
        for batch in opts["batches"]:
            active = [s for s in opts["setups"] if s not in stopped and
                      (s not in opts["per_setup"] or max(opts["per_setup"][s]) >= batch)]
            if not active:
                break
            for s in active:
                if s in stopped or (s in opts["per_setup"] and batch not in opts["per_setup"][s]):
                    continue
                rec_name = SETUPS[s].recipe
                unit = fsdp_unit(args, shape, rec_name, batch, opts["seq"], world, opts["device"]) if fsdp else 1
                est = estimate(shape, rec_name, batch, opts["seq"], world, opts["device"], unit, args.fp8_all_gather)
                base = {"model": name, "setup": s, "batch": batch, "seq": opts["seq"], "world": world,
                        "shape": asdict(shape), "recipe": rec_name, "estimate_gib": est, "run_id": run_id,
                        "commit": sha} | ({"fsdp_unit": unit} if fsdp else {})
                elapsed = time.time() - start
                left = None if args.max_seconds is None else args.max_seconds - elapsed
                if left is not None and left < 1.2 * last_cost.get(s, 0.0):
                    records.append(dict(base, status="skipped", reason="time budget (--max-seconds)"))
                    stopped[s] = "time budget"
                    log(f"[{elapsed:6.0f}s] {name} {s} batch {batch}: skipped (time budget)")
                    continue
                if args.skip_predicted_oom and est is not None and opts["device"] == "cuda" and \
                        est > gpu_info()["memory_gib"] * args.skip_predicted_oom:
                    records.append(dict(base, status="oom", predicted=True, device=gpu_info()["name"],
                                        gpu_memory_gib=gpu_info()["memory_gib"],
                                        reason=f"estimate {est:.1f} GiB > {args.skip_predicted_oom:g} x GPU memory"))
                    stopped[s] = "predicted out of memory"
                    log(f"[{elapsed:6.0f}s] {name} {s} batch {batch}: not run, estimate {est:.1f} GiB (oom predicted)")
                    continue
                timeout = args.timeout if left is None else max(10.0, min(args.timeout, left))
                cfg = {"setup": s, "shape": asdict(shape), "batch": batch, "seq": opts["seq"], "warmup": args.warmup,
                       "steps": args.steps, "device": opts["device"], "fsdp": fsdp, "run_id": run_id, "commit": sha,
                       "fsdp_unit": unit, "deadline": None if left is None else start + args.max_seconds,
                       "fp8_all_gather": args.fp8_all_gather}
                t0 = time.time()
                res = launch(cfg, world, timeout, fsdp)
                last_cost[s] = time.time() - t0
                rec = {**base, **{k: v for k, v in res.items() if k not in ("shape",)}, "model": name,
                       "estimate_gib": est, "wall_s": round(last_cost[s], 1)}
                records.append(rec)
                log(f"[{time.time() - start:6.0f}s] " + progress_line(rec))
                if rec["status"] in ("oom", "timeout", "error"):
                    stopped[s] = rec["status"]
    add_ratios(records)
    return records


def progress_line(r: dict[str, Any]) -> str:
    head = f"{r['model']} {r['setup']} batch {r['batch']}" + (f" x {r['world']} ranks" if r.get("world", 1) > 1 else "")
    if r["status"] == "ok":
        scale, unit = _unit([r])
        est = f", estimate {r['estimate_gib'] * scale:.2f}" if r.get("estimate_gib") is not None else ""
        peak = "not measured" if r.get("peak_gib") is None else f"{r['peak_gib'] * scale:.2f} {unit}"
        return (f"{head}: peak {peak}{est}, {r['tokens_per_s']:,.0f} tokens/s, "
                f"step {r['step_ms']:.1f} ms, host {r['host_ms']:.1f} ms ({r['wall_s']:.0f} s)")
    return f"{head}: {r['status']} {r.get('reason') or r.get('error') or ''}".rstrip()


def add_mfu(records: list[dict[str, Any]]) -> None:
    """Model TFLOP/s per GPU (memory.model_flops at the measured tokens/s) and MFU (over the datasheet's
    dense BF16 peak, the usual denominator, also for FP8 recipes, whose GEMMs peak twice as high)."""
    for r in records:
        if r.get("status") == "ok" and r.get("shape"):
            flops = sum(memory.model_flops(memory.ModelShape(**r["shape"]), r["batch"], r["seq"],
                                           memory.flops_base(r["setup"])))
            r["model_tflops"] = flops / (r["batch"] * r["seq"]) * r["tokens_per_s"] / 1e12
            rates = memory.rates_for(r.get("device") or "")
            r["mfu"] = r["model_tflops"] * 1e12 / rates["peak_bf16"] if rates else None


def add_ratios(records: list[dict[str, Any]]) -> None:
    """tokens/s over each BF16 baseline's at the same model, batch and world size, from this run; MFU."""
    add_mfu(records)
    base = {(r["model"], r["batch"], r["world"], r["setup"]): r["tokens_per_s"] for r in records
            if r.get("status") == "ok" and r["setup"] in BASELINES}
    for r in records:
        for b in BASELINES if r.get("status") == "ok" else ():
            ref = base.get((r["model"], r["batch"], r["world"], b))
            r[f"vs_{b}"] = None if not ref else r["tokens_per_s"] / ref


# ---- reporting ----------------------------------------------------------------------------------------


def _f(v: Any, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def mfu_cell(r: dict[str, Any]) -> str:
    if "model_tflops" not in r:  # a record written before MFU was
        add_mfu([r])
    t = r.get("model_tflops")
    return "" if t is None else f"{t:.0f}" + ("" if r.get("mfu") is None else f" ({r['mfu'] * 100:.0f}%)")


def _unit(records: list[dict[str, Any]]) -> tuple[float, str]:
    """GiB, or MiB when every peak is below 1 GiB (CPU-sized models)."""
    peaks = [r.get(k) for r in records for k in ("peak_gib", "estimate_gib") if r.get(k) is not None]
    return (1024.0, "MiB") if peaks and max(peaks) < 1 else (1.0, "GiB")


def markdown(records: list[dict[str, Any]]) -> str:
    k, unit = _unit(records)
    cols = ["model", "setup", "batch", f"peak {unit}", f"estimate {unit}", f"resident {unit}", "tokens/s", "vs amp",
            "vs bf16", "step ms", "spread", "host ms", "host / step", "TFLOP/s (MFU)"]
    align = ["---" if c in ("model", "setup") else "---:" for c in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(align) + "|"]
    order = {s: i for i, s in enumerate(dict.fromkeys(r["setup"] for r in records))}
    for r in sorted(records, key=lambda r: (r["model"], r.get("world", 1), order[r["setup"]], r["batch"])):
        unit = (f", {r['fsdp_unit']} layers per unit" if r.get("fsdp_unit", 1) != 1 else "") + \
            (", FP8 all-gather" if r.get("fp8_all_gather") else "")
        model = r["model"] + (f" (FSDP2 x{r['world']}{unit}, per GPU)" if r.get("world", 1) > 1 else "")
        est, peak, res = (r.get(x) for x in ("estimate_gib", "peak_gib", "resident_gib"))
        if r["status"] != "ok":
            what = "oom (predicted)" if r.get("predicted") else r["status"]
            cells = [model, r["setup"], str(r["batch"]), what, _f(est and est * k, ".1f")] + [""] * 9
        else:
            est_s = "" if est is None else f"{est * k:.1f}" + ("" if not peak else f" ({(est / peak - 1) * 100:+.0f}%)")
            cells = [model, r["setup"], str(r["batch"]), "n/a" if peak is None else f"{peak * k:.2f}", est_s,
                     _f(res and res * k, ".2f"), f"{r['tokens_per_s']:,.0f}",
                     _f(r.get("vs_amp"), ".2f"), _f(r.get("vs_bf16"), ".2f"), f"{r['step_ms']:.1f}",
                     f"{r['spread'] * 100:.1f}%", f"{r['host_ms']:.1f}", f"{r['host_ms'] / r['step_ms']:.2f}",
                     mfu_cell(r)]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {r['model']} {r['setup']} batch {r['batch']}: {r['status']}: {r.get('reason') or r.get('error')}"
             for r in records if r["status"] not in ("ok", "oom") or r.get("predicted")]
    devices = sorted({r.get("device") for r in records if r.get("device")})
    commits = sorted({r.get("commit") for r in records if r.get("commit")})
    lines.append("")
    lines.append(f"device: {', '.join(devices) or '?'}; commit {', '.join(commits) or '?'}; sequence "
                 f"{', '.join(sorted({str(r['seq']) for r in records}))}")
    return "\n".join(lines + notes)


def record_key(r: dict[str, Any]) -> str:
    return (f"{r.get('device', '?')}|{r['model']}|{recipes.canonical(r['setup'])}|batch{r['batch']}|seq{r['seq']}|"
            f"world{r.get('world', 1)}" + (f"|unit{r['fsdp_unit']}" if r.get("fsdp_unit", 1) != 1 else "")
            + ("|fp8gather" if r.get("fp8_all_gather") else ""))


def merge_json(path: Path, records: list[dict[str, Any]]) -> None:
    """Add ``records`` to the file's records, replacing those with the same key (device, model, setup,
    batch, sequence, world size). Skipped configurations are not written."""
    data: dict[str, Any] = {"records": []}
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise BenchError(f"argument --json: {path} is not valid JSON ({e}); not overwriting it") from None
    # Records of older runs are kept under their setup's current name (coat-release: coat+release).
    merged = {record_key(r): dict(r, setup=recipes.canonical(r["setup"])) for r in data.get("records", [])}
    for r in records:
        if r["status"] != "skipped" and "device" in r:
            merged[record_key(r)] = {k: v for k, v in r.items() if k not in ("traceback", "log")}
    data["records"] = [merged[k] for k in sorted(merged)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def fresh_png(path: Path) -> Path:
    """``path``, or the first of ``<stem>-2``, ``<stem>-3``, ... that no file is in the way of
    (``plot`` may also write ``<stem>_<model>.png``): a second run never replaces the first's plot."""
    n = 1
    while True:
        cand = path if n == 1 else path.with_name(f"{path.stem}-{n}{path.suffix}")
        if not cand.exists() and not glob.glob(os.path.join(glob.escape(str(cand.parent)),
                                                            glob.escape(cand.stem) + "_*" + cand.suffix)):
            return cand
        n += 1


def plot(records: list[dict[str, Any]], png: Path) -> list[Path]:
    """One PNG per (device, model, world): peak memory (measured, and the estimate dashed) and
    tokens/s against batch, one colour per setup; out-of-memory batches marked with x."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        if r["status"] in ("ok", "oom"):
            groups.setdefault((r.get("device", "?"), r["model"], r.get("world", 1)), []).append(r)
    out = []
    for (dev, model, world), rs in groups.items():
        fig = Figure(figsize=(11, 4.5), dpi=110)
        FigureCanvasAgg(fig)
        ax_m, ax_t = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        setups = list(dict.fromkeys(r["setup"] for r in rs))
        k, unit = _unit(rs)
        top = max([(r.get("peak_gib") or 0) * k for r in rs] + [(r.get("gpu_memory_gib") or 0) * k for r in rs])
        for i, s in enumerate(setups):
            ok = sorted((r for r in rs if r["setup"] == s and r["status"] == "ok"), key=lambda r: r["batch"])
            c = f"C{i}" if len(setups) <= 10 else colormaps["tab20"](i % 20)  # distinct beyond 10 setups
            style = "s-" if recipes.canonical(s).endswith("+graph") else "o-"  # CUDA-graph steps: square markers
            if ok:
                b = [r["batch"] for r in ok]
                if ok[0].get("peak_gib") is not None:
                    ax_m.plot(b, [r["peak_gib"] * k for r in ok], style, color=c, label=s)
                if ok[0].get("estimate_gib") is not None:
                    ax_m.plot(b, [r["estimate_gib"] * k for r in ok], "--", color=c, alpha=0.6)
                ax_t.plot(b, [r["tokens_per_s"] for r in ok], style, color=c, label=s)
            for r in rs:
                if r["setup"] == s and r["status"] == "oom":
                    ax_m.plot([r["batch"]], [top], "x", color=c, markersize=9)
        mem = next((r.get("gpu_memory_gib") for r in rs if r.get("gpu_memory_gib")), None)
        if mem:
            ax_m.axhline(mem * k, color="grey", linewidth=0.8, linestyle=":")
        ticks = sorted({r["batch"] for r in rs})
        for ax, label in ((ax_m, f"peak memory ({unit})"), (ax_t, "tokens/s" + (" per GPU" if world > 1 else ""))):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(b) for b in ticks])
            ax.set_xlabel("batch (sequences" + (" per GPU)" if world > 1 else ")"))
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            if any(not line.get_label().startswith("_") for line in ax.lines):
                ax.legend(fontsize=8)
        ax_m.set_title("measured (solid), estimate (dashed), out of memory (x)", fontsize=9)
        fig.suptitle(f"{model}, {dev}" + (f", FSDP2 x{world}" if world > 1 else ""))
        fig.tight_layout()
        path = png if len(groups) == 1 else png.with_name(
            f"{png.stem}_{model}".replace("/", "_") + (f"_fsdp{world}" if world > 1 else "") + png.suffix)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        out.append(path)
    return out


# ---- command line -------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser, json_default: str | None, png_default: str | None,
                  fresh_png_default: str | None = None) -> None:
    """The flags of ``coat bench`` and ``benchmarks/bench_e2e.py``. ``fresh_png_default``: the
    plot's name when --png is not given, numbered on if taken (``fresh_png``)."""
    g = p.add_argument_group("what to run")
    g.add_argument("--model", "--models", dest="models", nargs="+", metavar="M",
                   help="presets (" + ", ".join(memory.PRESETS) + "), config.json files or checkpoint folders "
                   "(default: llama2-7b on a GPU, tiny on a CPU)")
    g.add_argument("--recipe", "--setups", dest="setups", nargs="+", metavar="S",
                   help="setups, named as coat train and coat estimate name them (coat/recipes.py): amp, bf16, "
                   "coat, coat-lean; coat+release, coat-lean+release, coat-lean+hf-loss, and coat+graph, "
                   "coat-lean+graph (the step replayed from CUDA graphs); peers torchao (needs torchao and a GPU); "
                   "LoRA: bf16+lora (PEFT), coat+lora, coat+lora+graph, qlora (PEFT + bitsandbytes 4-bit); side tuning "
                   "(QST on the FP8 frozen base, r=16): coat+side, coat+side+graph; 4-bit optimizer states (coat.optim.AdamW4bit): coat4bit, "
                   "coat4bit-lean, coat4bit-lean+release, coat4bit-lean+v-block+release (v in blocks of 128); Subset-Norm + Subspace-Momentum (coat.optim.SubsetNormSM, "
                   "one GPU): snsm, snsm-lean, snsm-lean+release; the FP8 layers at finer scaling (sm_90): coat+row, "
                   "coat+block, coat-lean+block+release; or all "
                   "(default: " + " ".join(DEFAULT_SETUPS) + "); " + recipes.alias_help())
    g.add_argument("--batch", "--batches", dest="batches", nargs="+", metavar="B",
                   help="batches (sequences per GPU), e.g. 1 2 4 or 1,2,4; 'auto': 1, 2, 4, ... to --max-batch "
                   "(default: auto); each setup stops at its first out-of-memory")
    g.add_argument("--setup-batches", action="append", metavar="SETUP=B,B",
                   help="run SETUP only at these batches (e.g. torchao=1,4: its compile is slow); repeatable")
    g.add_argument("--max-batch", type=int, metavar="N", help="largest batch of 'auto' (default: 256 GPU, 8 CPU)")
    g.add_argument("--seq", type=int, metavar="N", help="tokens per sequence (default: 2048 GPU, 128 CPU)")
    g.add_argument("--fsdp", type=int, metavar="N", help="run each configuration under torchrun on N processes "
                   "(FSDP2, fully_shard per --fsdp-unit decoder layers; NCCL on GPUs, gloo on CPUs)")
    g.add_argument("--fsdp-unit", type=fsdp_unit_arg, default="auto", metavar="K", help="with --fsdp: K consecutive "
                   "decoder layers per fully_shard unit (fewer, larger collectives; K layers' weights gathered at a "
                   "time); auto: per configuration, the fewest layers whose GEMMs hide FSDP2's host work per unit, as "
                   "many as fit the GPU (coat estimate --fsdp-unit)")
    g.add_argument("--fp8-all-gather", action="store_true", help="with --fsdp: gather the FP8 layers' weights as "
                   "FP8 codes (half the bytes; coat.integrations.fsdp.shard(fp8_all_gather=True))")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    g = p.add_argument_group("how long")
    g.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed steps first")
    g.add_argument("--steps", type=int, default=5, metavar="N", help="timed steps")
    g.add_argument("--max-seconds", type=float, metavar="S",
                   help="wall-clock budget of the whole sweep: configurations that would not fit are skipped")
    g.add_argument("--timeout", type=float, default=900.0, metavar="S", help="limit of one configuration")
    g.add_argument("--skip-predicted-oom", type=float, nargs="?", const=1.1, metavar="X",
                   help="do not run configurations whose estimate exceeds X times the GPU's memory (X: 1.1); "
                   "they are recorded as out of memory, predicted")
    g = p.add_argument_group("output")
    g.add_argument("--json", default=json_default, metavar="PATH",
                   help="merge results into this JSON file, keyed by device, model, setup, batch, sequence, ranks"
                   + ("" if json_default else " (default: none)"))
    stem, suffix = os.path.splitext(fresh_png_default or "")
    g.add_argument("--png", default=png_default, metavar="PATH", help="memory and tokens/s against batch" + (
        f" (default: {fresh_png_default}, or {stem}-2{suffix}, -3, ... when taken: a run never replaces an earlier "
        "run's plot; a PATH given is replaced)" if fresh_png_default else ""))
    if fresh_png_default:
        p.set_defaults(fresh_png=fresh_png_default)
    g.add_argument("--quiet", action="store_true", help="only the final table")


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[Path]]:
    opts = resolve(args)
    log = (lambda _m: None) if args.quiet else (lambda m: print(m, flush=True))
    if in_torchrun():
        records = [run_here(opts, args)]
        if os.environ.get("RANK") != "0":  # rank 0 reports the group
            return records, []
    else:
        records = sweep(opts, args, log)
    print(markdown(records))
    if args.json:
        merge_json(Path(args.json), records)
        log(f"results merged into {args.json}")
    png = Path(args.png) if args.png else fresh_png(Path(args.fresh_png)) if getattr(args, "fresh_png", None) \
        else None
    pngs = plot(records, png) if png else []
    for p in pngs:
        log(f"plot: {p}")
    return records, pngs


def in_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_here(opts: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Started by torchrun directly (``torchrun --nproc-per-node N bench_e2e.py --fsdp N ...``): this
    process is one rank of the one configuration named by the flags."""
    from coat.cli.bench_worker import SETUPS, run_config

    if not args.fsdp or len(opts["shapes"]) != 1 or len(opts["setups"]) != 1 or len(opts["batches"]) != 1:
        raise BenchError("argument --fsdp: under torchrun give --fsdp N and exactly one --model, --setups and "
                         "--batches value (or let the command start torchrun itself: run it with python)")
    world = int(os.environ["WORLD_SIZE"])
    if world != args.fsdp:
        raise BenchError(f"argument --fsdp: {args.fsdp} does not match torchrun's world size {world}")
    (name, shape), = opts["shapes"].items()
    setup, batch = opts["setups"][0], opts["batches"][0]
    unit = fsdp_unit(args, shape, SETUPS[setup].recipe, batch, opts["seq"], world, opts["device"])
    cfg = {"setup": setup, "shape": asdict(shape), "batch": batch, "seq": opts["seq"], "warmup": args.warmup,
           "steps": args.steps, "device": opts["device"], "fsdp": True, "commit": commit(), "fsdp_unit": unit,
           "fp8_all_gather": args.fp8_all_gather,
           "run_id": time.strftime("%Y%m%dT%H%M%S")}
    import torch.distributed as dist

    res = run_config(cfg)
    rec = {**res, "model": name, "world": world, "estimate_gib": estimate(shape, SETUPS[setup].recipe, batch,
                                                                            opts["seq"], world, opts["device"],
                                                                            unit, args.fp8_all_gather)}
    if rec.get("status") not in ("ok", "skipped"):
        # Peers may wait in a collective this rank never joins: report, then leave at once; the non-zero
        # exit makes torchrun stop the group.
        print(progress_line(dict(rec, wall_s=0.0)), flush=True)
        os._exit(3)
    peaks = [p for p in rec.get("rank_peak_gib", []) if p is not None]
    if peaks:
        rec["peak_gib"] = max(peaks)
    if dist.is_initialized():
        dist.barrier()  # no rank tears its group down while a peer is still busy
        dist.destroy_process_group()
    add_ratios([rec])
    return rec


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand to the ``coat`` parser."""
    p = subparsers.add_parser("bench", help="measure whole-model training: peak memory vs estimate, tokens/s",
                              description=__doc__)
    add_arguments(p, json_default=None, png_default=None, fresh_png_default=DEFAULT_PNG)
    p.set_defaults(handler=lambda args: main_handler(args, p))


def main_handler(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        run(args)
    except BenchError as e:
        parser.error(str(e))
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0
