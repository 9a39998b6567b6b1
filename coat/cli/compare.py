"""``coat train --compare``: the recipe and the BF16 baseline, same seed and data order, one table
and one plot. Side tuning (``--side-tuning R --compare``) is compared with LoRA on the same FP8
frozen base instead (``arms``): coat bench's coat+lora, rank 16, alpha 32, every projection.

Single process: each recipe trains in a fresh child process, one after the other, so each
one's peak memory (peak RSS on a CPU, CUDA peak allocated on a GPU) is its own and not the
high-water mark of the run before it. Under torchrun the two runs share the ranks' processes;
the CUDA peak and the kernel's peak-RSS mark are reset when each run starts.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

from coat.cli import checkpoint as ckpt
from coat.cli import distributed_train as dt
from coat.cli.config import (BASELINE_RECIPE, COAT_OPTIMIZERS, RECIPE_PARTS, RESUME_OVERRIDES, ConfigError,
                             TrainConfig, lr_lambda, setup_name)
from coat.cli.plot import plot_comparison
from coat.cli.plan import RunPlan

_MiB = 2**20


class ChildUsageError(Exception):
    """A recipe's child process refused its settings (exit status 2); it printed the error itself."""


def _sub_flags(flags: TrainConfig, parts: tuple[str, str], out: Path) -> TrainConfig:
    """One side of the comparison, as flags: its activations and optimizer named, no recipe (a
    combination outside the named recipes has no name to give), everything else as the user gave it."""
    act, opt = parts
    return replace(flags, recipe=None, activations=act, optim=opt, compare=False, out=str(out), resume=None,
                   master_weights=flags.master_weights if opt in COAT_OPTIMIZERS else "fp32",
                   snsm_proj=flags.snsm_proj if opt == "snsm" else "svd",
                   fp8_granularity=flags.fp8_granularity if act == "fp8" else "tensor",
                   fp8_grad_format=flags.fp8_grad_format if act == "fp8" else None,
                   fp8_fast_accum=flags.fp8_fast_accum if act == "fp8" else True,
                   dre=flags.dre if opt == "coat" else True,
                   v_scaling=flags.v_scaling if opt == "coat4bit" else "rank1",
                   release_grads=flags.release_grads and opt in COAT_OPTIMIZERS,
                   frozen_fp8=flags.frozen_fp8 and act == "fp8", fp8_stats=flags.fp8_stats and act == "fp8")


#: The LoRA that side tuning is compared with (coat bench's coat+lora): rank, alpha, targets.
SIDE_COMPARE_LORA = dict(lora=16, lora_alpha=32, lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")


def arms(cfg: TrainConfig) -> tuple[str, str]:
    """The names of the comparison's two runs (and folders), the baseline first: the bf16 baseline
    and the recipe; with side tuning, LoRA on the same FP8 frozen base (coat+lora) and side tuning."""
    if cfg.side_tuning:
        return setup_name(replace(cfg, side_tuning=0, lora=16)), setup_name(cfg)
    return BASELINE_RECIPE, cfg.recipe


def _arm_flags(flags: TrainConfig, cfg: TrainConfig, name: str, out: Path) -> TrainConfig:
    """The flags of the comparison's run ``name``."""
    if not cfg.side_tuning:
        parts = RECIPE_PARTS[BASELINE_RECIPE] if name == BASELINE_RECIPE else (cfg.activations, cfg.optim)
        return _sub_flags(flags, parts, out)
    sub = _sub_flags(flags, (cfg.activations, cfg.optim), out)
    return sub if name == arms(cfg)[1] else replace(sub, side_tuning=0, frozen_fp8=True, **SIDE_COMPARE_LORA)


def _set_death_signal() -> None:
    # The child trains in its own process group, so a terminal's Ctrl-C reaches only the parent,
    # which forwards it once; and it gets SIGTERM if the parent dies (Linux), never orphaned.
    os.setpgid(0, 0)
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run_child(cfg: TrainConfig, explicit: set[str] | None = None) -> tuple[int, str | None]:
    """Runs one recipe in a child process; returns its exit status and the name of the signal
    the parent forwarded to it (if any: the comparison then stops after this child)."""
    # A Ctrl-C while the child still imports torch ends it quietly (the parent reports it).
    code = ("import sys\ntry:\n    from coat.cli.train import child_main\nexcept KeyboardInterrupt:\n"
            "    sys.exit(130)\nsys.exit(child_main(sys.argv[1]))")
    arg = json.dumps({"cfg": asdict(cfg), "explicit": sorted(explicit) if explicit is not None else None})
    proc = subprocess.Popen([sys.executable, "-c", code, arg], preexec_fn=_set_death_signal)
    forwarded: dict[int, Any] = {}
    got: list[str] = []

    def forward(signum: int, frame: Any) -> None:
        got.append(signal.Signals(signum).name)
        proc.send_signal(signum)

    for s in (signal.SIGINT, signal.SIGTERM):
        forwarded[s] = signal.signal(s, forward)
    try:
        return proc.wait(), (got[0] if got else None)
    finally:
        for s, h in forwarded.items():
            signal.signal(s, h)


def _sub_runs(plan: RunPlan) -> dict[str, Path]:
    return {r: plan.out / r for r in arms(plan.cfg)}


def _finished(folder: Path) -> dict[str, Any] | None:
    summary = folder / "summary.json"
    if summary.is_file():
        result = json.loads(summary.read_text())
        if result.get("finished"):
            return result
    return None


def _check_same_data(runs: dict[str, Path]) -> None:
    """Both recipes trained and evaluated on the same tokens (each child loads --data itself, so
    data changed between them, or before a resume that restarted one, would otherwise be paired)."""
    digests = {r: json.loads((f / "config.json").read_text()).get("corpus", {}).get("digest") for r, f in runs.items()}
    if None not in digests.values() and len(set(digests.values())) > 1:
        got = ", ".join(f"{r} {dg[:12]}" for r, dg in digests.items())
        raise ConfigError("--data", f"the recipes of this comparison trained on different data (token digests: {got}): "
                          "the data changed between their runs; no comparison is written. Start the comparison "
                          "again in a new --out with the data left as it is")


def _check_steps(out: Path, runs: dict[str, Path], cfg: TrainConfig) -> None:
    """Both recipes train the same number of steps on the same lr schedule. A resume with a new
    --steps continues a stopped run's schedule from its stop, while a recipe not yet started runs
    the new --steps' schedule from step 1: taken only where the two agree up to the stop (a constant
    schedule, a stop inside the warmup) or every recipe has finished (both continue from there)."""
    steps = cfg.steps
    for recipe, folder in runs.items():
        done = _finished(folder)
        if done is not None and done["planned_steps"] != steps:
            raise ConfigError("--steps", f"the {recipe} run in {folder} finished {done['planned_steps']} steps; both "
                              "recipes of a comparison train the same number (drop --steps)")
    started = json.loads((out / "compare.json").read_text())["train"]["steps"] if (out / "compare.json").is_file() \
        else steps
    if steps == started or all(_finished(f) for f in runs.values()):
        return
    stop = max((s for f in runs.values() if f.exists() for s, _ in ckpt.checkpoints(f)), default=0)
    old, new = lr_lambda(replace(cfg, steps=started)), lr_lambda(cfg)
    if any(not math.isclose(old(s), new(s), rel_tol=1e-12) for s in range(stop + 1)):
        raise ConfigError("--steps", f"this comparison has not finished its {started} steps: the recipe stopped "
                          "midway would continue its lr schedule from there and the other would start a plain "
                          f"{steps}-step one, so they would not be paired. Finish it first (coat train --resume "
                          f"{out}), then resume it again with --steps {steps}")


def run_compare(plan: RunPlan, d: dt.Dist, log: Callable[[str], None], one_seed: bool = True) -> dict[str, Any]:
    from coat.cli import runner

    from coat.cli.config import resolve_config

    cfg = plan.cfg
    runs = _sub_runs(plan)
    base, other = arms(cfg)
    _check_steps(plan.out, runs, cfg)
    if d.is_main:
        ckpt.write_json_atomic(plan.out / "compare.json", {"train": asdict(cfg), "flags": asdict(plan.flags or cfg),
                                                           "runs": {r: r for r in runs}, "world_size": d.world})
    d.barrier()
    results: dict[str, dict[str, Any]] = {}
    for recipe, folder in runs.items():
        done = _finished(folder)
        if done is not None and not (cfg.save and not done.get("model_dir")):  # else: --save exports it now
            log(f"[{recipe}] already finished in {folder}")
            results[recipe] = done
            continue
        sub = _arm_flags(plan.flags or cfg, cfg, recipe, folder)
        resume = ckpt.latest(folder) if folder.exists() else None
        if folder.exists() and resume is None and d.is_main:
            # Stopped before its first checkpoint: set aside (never deleted), and started again.
            aside = next(folder.with_name(f"{folder.name}.incomplete-{i}") for i in range(1, 10**6)
                         if not folder.with_name(f"{folder.name}.incomplete-{i}").exists())
            os.replace(folder, aside)
            log(f"[{recipe}] {folder} had no checkpoint; moved to {aside}, starting again")
        d.barrier()
        if not d.enabled:
            kept = {k: getattr(cfg, k) for k in RESUME_OVERRIDES}  # what a resume may change, all of it
            child = TrainConfig(resume=str(folder), **kept) if resume else sub
            rc, signalled = _run_child(child, {"resume", *kept} if resume else None)
            summary = folder / "summary.json"
            if rc == 2 and not summary.is_file():  # a usage error, already printed by the child: stop cleanly
                raise ChildUsageError(recipe)
            if summary.is_file():
                results[recipe] = json.loads(summary.read_text())
            else:  # it failed, or was aborted (a second Ctrl-C), before its summary: its output says why
                results[recipe] = {"finished": False, "exit_status": rc,
                                   "stopped_by": {130: "SIGINT", 143: "SIGTERM"}.get(rc)}
                log(f"[{recipe}] ended with exit status {rc} before writing {summary}")
                if rc in (130, 143) and not folder.exists():
                    print(f"[{recipe}] interrupted before its first step; nothing was kept", file=sys.stderr)
            if signalled and results[recipe].get("finished"):  # the signal came as it ended: stop here
                log(f"stopped by {signalled} after the {recipe} run; continue with: coat train --resume {plan.out}")
                return {"runs": results, "out_dir": str(plan.out), "stopped_by": signalled}
        else:
            if d.is_main and resume is None:
                folder.mkdir()
            if resume is not None:  # as a resume in one process checks it (coat.cli.train)
                identity = ckpt.run_identity(json.loads((folder / "config.json").read_text()))
                step = int(resume.name.removeprefix("step_"))
                verdict = d.broadcast(ckpt.verify_or_offer(folder, step, d.world, identity) if d.is_main else None)
                if verdict is not None:
                    raise ConfigError("--resume", verdict)
            resolved = resolve_config(sub, plan.init.max_positions if plan.init else None)
            sub_plan = RunPlan(resolved, plan.corpus, folder, plan.init, plan.tokenizer, resume, sub)
            results[recipe] = runner.run(sub_plan, d, log)
        if not results[recipe].get("finished"):
            return {"runs": results, "out_dir": str(plan.out)}
    _check_same_data(runs)
    table = comparison_table(results, base, other, one_seed=one_seed)
    out: dict[str, Any] = {"runs": results, "table": table["markdown"], "out_dir": str(plan.out)}
    if d.is_main:
        (plan.out / "comparison.md").write_text(table["markdown"] + "\n")
        ckpt.write_json_atomic(plan.out / "comparison.json", table["rows"])
        out["plot"] = str(plot_comparison({r: runs[r] / "metrics.jsonl" for r in runs}, plan.out / "comparison.png",
                                          title=table["title"]))
        log("\n" + table["markdown"])
        log(f"\nplot: {out['plot']}\ntable: {plan.out / 'comparison.md'}")
    return out


def _fmt_bytes(n: float | None) -> str:
    return "n/a" if n is None else f"{n / _MiB:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def _fmt_seconds(t: float) -> str:
    return f"{t:.1f} s" if t < 100 else f"{t:.0f} s"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if not a or not b else f"{b / a:.2f}x"


def _held_out_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = []
    for name in (b.get("final_eval_batch_losses") or {}):
        key = f"final_val_{name}_loss"
        if name != "val" and a.get(key) is not None and b.get(key) is not None:
            dv = b[key] - a[key]
            rows.append((f"final held-out {name} loss", f"{a[key]:.4f}", f"{b[key]:.4f}",
                         f"{dv:+.4f} ({dv / a[key]:+.2%})"))
    return rows


def evaluation_noise(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """What the fixed held-out batches can resolve: the standard error of one run's mean loss over
    its batches, and of the two runs' difference paired batch by batch (None without batch losses)."""
    from coat.cli.stats import mean_se

    sa, sb = a.get("final_eval_batch_losses") or {}, b.get("final_eval_batch_losses") or {}
    parts = []
    for name, xs in sb.items():
        ys = sa.get(name)
        if ys is None or len(ys) != len(xs) or len(xs) < 2:
            continue
        mean, se = mean_se(ys)
        _, se_diff = mean_se([x - y for x, y in zip(xs, ys)])
        parts.append(f"{name}: {se:.4f} ({se / mean:.2%}) for one run's loss, {se_diff:.4f} "
                     f"({se_diff / mean:.2%}) for the difference ({len(xs)} batches)")
    if not parts:
        return None
    return ("Evaluation noise (standard error over the fixed held-out batches; every run scores the same "
            "batches, so a seed-to-seed spread comes from training, not from the evaluation): " + "; ".join(parts) + ".")


def comparison_table(results: dict[str, dict[str, Any]], base: str, other: str,
                     one_seed: bool = False) -> dict[str, Any]:
    """Markdown and JSON rows: losses, memory, optimizer state, throughput of two finished runs.
    ``one_seed``: the whole comparison is this one seed; say what it cannot resolve."""
    a, b = results[base], results[other]
    mem_kind = {"cuda_max_allocated": "peak memory (CUDA max allocated)", "peak_rss": "peak memory (process RSS)",
                "peak_rss_process_lifetime": "peak memory (process RSS, whole process lifetime)"}
    dv = b["final_val_loss"] - a["final_val_loss"]
    rows = [
        ("final validation loss", f"{a['final_val_loss']:.4f}", f"{b['final_val_loss']:.4f}",
         f"{dv:+.4f} ({dv / a['final_val_loss']:+.2%})"),
        *_held_out_rows(a, b),
        ("final train loss", f"{a['final_train_loss']:.4f}", f"{b['final_train_loss']:.4f}",
         f"{b['final_train_loss'] - a['final_train_loss']:+.4f}"),
        (mem_kind.get(b["peak_memory_kind"], "peak memory"), _fmt_bytes(a["peak_memory_bytes"]),
         _fmt_bytes(b["peak_memory_bytes"]), _ratio(a["peak_memory_bytes"], b["peak_memory_bytes"])),
        *([("  added by training (peak RSS - RSS at start)", _fmt_bytes(a["peak_memory_above_start_bytes"]),
             _fmt_bytes(b["peak_memory_above_start_bytes"]),
             _ratio(a["peak_memory_above_start_bytes"], b["peak_memory_above_start_bytes"]))]
          if b.get("peak_memory_above_start_bytes") is not None else []),
        ("optimizer states", _fmt_bytes(a["optimizer_state_bytes"]), _fmt_bytes(b["optimizer_state_bytes"]),
         _ratio(a["optimizer_state_bytes"], b["optimizer_state_bytes"])),
        ("tokens/s", f"{a['tokens_per_s']:,.0f}", f"{b['tokens_per_s']:,.0f}",
         _ratio(a["tokens_per_s"], b["tokens_per_s"])),
        ("training time", _fmt_seconds(a["train_time_s"]), _fmt_seconds(b["train_time_s"]),
         _ratio(a["train_time_s"], b["train_time_s"])),
    ]
    device = b["device"]
    title = (f"{b['n_params'] / 1e6:.1f}M params, {b['steps']} steps, {b['tokens']:,} tokens, "
             f"{b['world_size']} x {device}")
    lines = [f"{title}", "", f"| | {base} | {other} | {other} vs {base} |", "|---|---:|---:|---:|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} |" for r in rows]
    lines += ["", f"{other}, in FP8: " + "; ".join(b["precision"]["fp8"]) + ".",
              f"{other}, not in FP8: " + "; ".join(b["precision"]["not_fp8"]) + "."]
    noise = evaluation_noise(a, b)
    if noise:
        lines.append(noise)
    if one_seed:
        lines.append("This is one seed. Training itself varies from seed to seed (and, on a GPU, from run to run): "
                     "a difference smaller than that variation cannot be told apart from it, and the evaluation "
                     "noise is only its floor. `coat train --seeds 5` pairs 5 seeds and gives the mean difference "
                     "with a 95% confidence interval; benchmarks/RESULTS.md (section 10) has the spread measured "
                     "on the default runs.")
    if b.get("dtype") == "fp32" and base == BASELINE_RECIPE:
        lines.append(f"The {base} baseline is plain PyTorch; here it computed in fp32 (--dtype fp32, the CPU default; "
                     "GPUs default to bf16 autocast).")
    if device == "cpu":
        lines.append("On a CPU the FP8 path runs coat's C++ reference kernels (FP8 emulated in software): its "
                     "tokens/s says nothing about GPU speed; losses, memory and optimizer-state bytes do carry over.")
    keys = ("final_val_loss", "final_val_prose_loss", "final_val_loss_se", "final_train_loss", "peak_memory_bytes", "peak_memory_kind",
            "peak_memory_above_start_bytes", "optimizer_state_bytes",
            "tokens_per_s", "train_time_s", "steps", "tokens", "n_params", "world_size", "device", "dtype")
    return {"markdown": "\n".join(lines), "title": title,
            "rows": {"title": title, **{r: {k: results[r].get(k) for k in keys} for r in (base, other)}}}

