"""``coat train --seeds N``: N paired comparisons, seeds ``--seed`` .. ``--seed + N - 1``.

Seed s trains both recipes from the same initial weights on the same batches (a comparison of
``coat.cli.compare`` in ``OUT/seed_<s>/``, with its own table and plot). The summary
(``OUT/comparison.md``, ``.json``, ``.png``) gives the paired differences of final validation
loss, their mean with a 95% Student t confidence interval, and each recipe's seed-to-seed spread.

In one process a seed whose run fails is reported and the next seed runs; a Ctrl-C or SIGTERM
stops the whole set after the current step. ``coat train --resume OUT`` continues the seeds that
did not finish and then writes the summary. Under torchrun the seeds run one after another in the
ranks' processes; an error there ends the set (the finished seeds stay, --resume continues).
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from coat.cli import checkpoint as ckpt
from coat.cli import distributed_train as dt
from coat.cli.plan import RunPlan
from coat.cli.stats import mean_std, t975

def paired_stats(losses: Mapping[int, tuple[float, float]]) -> dict[str, Any]:
    """``losses``: seed -> (baseline, recipe) final validation loss. The paired differences
    (recipe - baseline), their mean, standard deviation and 95% CI (Student t, n - 1 df; None
    for one seed), and each recipe's mean and standard deviation over seeds."""
    seeds = sorted(losses)
    base = [losses[s][0] for s in seeds]
    other = [losses[s][1] for s in seeds]
    diffs = [o - b for b, o in zip(base, other)]
    mean, sd = mean_std(diffs)
    half = t975(len(diffs) - 1) * sd / math.sqrt(len(diffs)) if sd is not None else None
    return {"seeds": seeds, "n": len(seeds), "diffs": diffs, "rel_diffs": [d / b for d, b in zip(diffs, base)],
            "mean_diff": mean, "sd_diff": sd, "ci95": None if half is None else [mean - half, mean + half],
            "half_width": half, "t": t975(len(diffs) - 1) if len(diffs) > 1 else None,
            "base": dict(zip(("mean", "sd"), mean_std(base))), "other": dict(zip(("mean", "sd"), mean_std(other)))}


def summary_markdown(stats: dict[str, Any], losses: Mapping[int, tuple[float, float]], base: str, other: str,
                     failed: Mapping[int, str] = {}, what: str = "validation loss") -> str:
    """The summary table of one held-out set (``what``) and the sentences that read it."""
    of = f" of {stats['n'] + len(failed)}" if failed else ""
    lines = [f"Final {what} over {stats['n']}{of} paired seed{'s' * (stats['n'] + len(failed) > 1)} "
             f"(seed s: both recipes from the same initial weights, on the same batches)", "",
             f"| seed | {base} | {other} | {other} - {base} | relative |", "|---:|---:|---:|---:|---:|"]
    for s, d, r in zip(stats["seeds"], stats["diffs"], stats["rel_diffs"]):
        lines.append(f"| {s} | {losses[s][0]:.4f} | {losses[s][1]:.4f} | {d:+.4f} | {r:+.2%} |")
    for s, why in sorted(failed.items()):
        lines.append(f"| {s} | - | - | {why} | |")

    def spread(r: dict[str, Any]) -> str:
        return f"{r['mean']:.4f}" + (f" ± {r['sd']:.4f} (std)" if r["sd"] is not None else "")

    lines += ["", f"| | {base} | {other} | {other} - {base} |", "|---|---:|---:|---:|",
              f"| mean over seeds | {spread(stats['base'])} | {spread(stats['other'])} | "
              f"{stats['mean_diff']:+.4f} |"]
    if stats["ci95"] is None:
        lines += ["", f"One seed: {other} - {base} = {stats['mean_diff']:+.4f}. A confidence interval needs 2 or more "
                  "seeds (--seeds N)."]
        return "\n".join(lines)
    lo, hi = stats["ci95"]
    verdict = ("includes 0: these seeds do not tell the recipes apart" if lo <= 0 <= hi else
               f"excludes 0: {other} is {'worse' if lo > 0 else 'better'} than {base} on this setup")
    lines += ["", f"Mean paired difference {other} - {base}: {stats['mean_diff']:+.4f}, 95% CI "
              f"[{lo:+.4f}, {hi:+.4f}] (Student t, {stats['n'] - 1} df, t = {stats['t']:.3f}; std of the "
              f"differences {stats['sd_diff']:.4f}); the interval {verdict}.",
              f"With {stats['n']} seeds and this spread, a true difference smaller than about "
              f"{stats['half_width']:.4f} (the CI's half-width) cannot be told from zero; halving it takes "
              "about 4 times as many seeds."]
    return "\n".join(lines)


def _seed_plan(plan: RunPlan, seed: int) -> RunPlan:
    out = plan.out / f"seed_{seed}"
    cfg, flags = (replace(c, seed=seed, seeds=1, out=str(out)) for c in (plan.cfg, plan.flags or plan.cfg))
    return replace(plan, cfg=cfg, flags=flags, out=out)


def _val_curve(metrics: Path) -> dict[int, float]:
    from coat.cli.plot import read_metrics

    return {r["step"]: r["val_loss"] for r in read_metrics(metrics) if r.get("val_loss") is not None}


def plot_mean_curves(runs: Mapping[str, list[Path]], out_png: Path, title: str) -> Path:
    """Mean validation loss over seeds per recipe, with a min-max band over the seeds (the steps
    every seed evaluated)."""
    from coat.cli.plot import _figure, _save

    fig = _figure(8)
    ax = fig.add_subplot()
    for i, (label, paths) in enumerate(runs.items()):
        curves = [_val_curve(p) for p in paths]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        vals = [[c[s] for c in curves] for s in steps]
        mean = [sum(v) / len(v) for v in vals]
        ax.plot(steps, mean, color=f"C{i}", marker="o", markersize=3,
                label=f"{label} val, mean of {len(paths)} ({mean[-1]:.4f})" if mean else label)
        ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=f"C{i}", alpha=0.2,
                        label=f"{label} min-max over seeds")
    ax.set_title(title)
    return _save(fig, [ax], out_png)


def run_seeds(plan: RunPlan, d: dt.Dist, log: Callable[[str], None]) -> dict[str, Any]:
    """The N comparisons, one seed after another, then the summary (of the seeds that finished)."""
    from coat.cli.compare import arms, run_compare

    cfg = plan.cfg
    base, other = arms(cfg)  # the baseline's and the recipe's runs (side tuning: LoRA's and its own)
    seeds = list(range(cfg.seed, cfg.seed + cfg.seeds))
    if d.is_main:
        ckpt.write_json_atomic(plan.out / "compare.json", {"train": asdict(cfg), "flags": asdict(plan.flags or cfg),
                                                           "seeds": seeds, "world_size": d.world})
    results: dict[int, dict[str, Any]] = {}
    failed: dict[int, str] = {}
    for s in seeds:
        sub = _seed_plan(plan, s)
        if d.is_main:
            sub.out.mkdir(exist_ok=True)
        d.barrier()
        log(f"\n=== seed {s} ({s - cfg.seed + 1} of {len(seeds)}): {sub.out} ===")
        results[s] = run_compare(sub, d, log, one_seed=False)
        stopped = results[s].get("stopped_by") or next(
            (r["stopped_by"] for r in results[s]["runs"].values() if r.get("stopped_by")), None)
        if stopped:
            log(f"stopped by {stopped} in seed {s}; continue with: coat train --resume {plan.out}")
            return _result(results, plan.out, stopped)
        if "table" not in results[s]:
            runs = results[s]["runs"]
            diverged = [f"{r} diverged at step {v['diverged_at']}" for r, v in runs.items() if v.get("diverged_at")]
            bad = [r for r, v in runs.items() if not v.get("finished") and not v.get("diverged_at")]
            failed[s] = "; ".join(diverged + ([f"{', '.join(bad)} did not finish"] if bad else []))
            log(f"seed {s}: {failed[s]} (see its output above); going on with the next seed"
                + (f". coat train --resume {plan.out} runs it again" if bad else
                   ": a diverged seed is a result, left out of the paired mean and listed in the table"))
    out = _result(results, plan.out, None)
    finished = {s: r["runs"] for s, r in results.items() if s not in failed}
    losses = {s: (r[base]["final_val_loss"], r[other]["final_val_loss"]) for s, r in finished.items()}
    if not losses or not d.is_main:
        return out
    stats = paired_stats(losses)
    md = summary_markdown(stats, losses, base, other, failed)
    summary = {**stats, "failed": failed, "final_val_loss": {
        s: {base: b, other: o} for s, (b, o) in losses.items()}}
    # The prose held-out set (the built-in corpus): the same paired reading on text unlike the training data.
    key = "final_val_prose_loss"
    if all(r[base].get(key) is not None and r[other].get(key) is not None for r in finished.values()):
        prose = {s: (r[base][key], r[other][key]) for s, r in finished.items()}
        summary["prose"] = paired_stats(prose) | {"final_loss": {
            s: {base: b, other: o} for s, (b, o) in prose.items()}}
        md += "\n\n" + summary_markdown(summary["prose"], prose, base, other, failed, what="held-out prose loss")
    (plan.out / "comparison.md").write_text(md + "\n")
    ckpt.write_json_atomic(plan.out / "comparison.json", summary)
    first = results[min(losses)]["runs"][other]
    title = (f"{first['n_params'] / 1e6:.1f}M params, {first['steps']} steps, {len(losses)} seeds, "
             f"{first['world_size']} x {first['device']}: validation loss, mean and min-max band")
    out["plot"] = str(plot_mean_curves({r: [plan.out / f"seed_{s}" / r / "metrics.jsonl" for s in losses]
                                        for r in (base, other)}, plan.out / "comparison.png", title))
    out["table"] = md
    log("\n" + md + f"\n\nplot: {out['plot']}\ntable: {plan.out / 'comparison.md'}")
    return out


def _result(results: dict[int, dict[str, Any]], out: Path, stopped: str | None) -> dict[str, Any]:
    # Flattened so that coat.cli.train.exit_code reads it as it reads one comparison.
    runs = {f"seed_{s}/{r}": v for s, res in results.items() for r, v in res["runs"].items()}
    return {"runs": runs, "out_dir": str(out), **({"stopped_by": stopped} if stopped else {}),
            "seeds": {s: res.get("table") is not None for s, res in results.items()}}
