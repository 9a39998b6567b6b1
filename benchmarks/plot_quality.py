"""Plot a multi-seed quality comparison recorded in benchmarks/results/quality_*.json: each recipe's
mean validation curve, and its paired difference from BF16 (same seed: same initial weights and
batches) per evaluation, mean with a min-max band over seeds. The records (default: all of them)
are one study, read by benchmarks/quality_records.py as README's quality table reads them.

    python benchmarks/plot_quality.py --prefix B --out benchmarks/results/quality_base_49m.png
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import quality_records as qr

from coat.cli.plot import _figure, _save


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, nargs="*",
                    help="quality_*.json records (default: every one under benchmarks/results)")
    ap.add_argument("--prefix", default="", help="plot the runs whose name starts with this (one setup)")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    records = qr.read(args.results or None)
    runs = {n: r for n, r in qr.merge(records).items() if n.startswith(args.prefix)}
    if len({qr.setup(n) for n in runs}) > 1:
        raise SystemExit(f"runs of several setups under prefix {args.prefix!r}: name one with --prefix")
    groups: dict[str, dict[int, dict[int, float]]] = defaultdict(dict)
    for r in runs.values():
        groups[qr.label(r)][r["seed"]] = {s: v for s, v in r["val_curve"]}
    if "bf16" not in groups:
        raise SystemExit(f"no bf16 runs under prefix {args.prefix!r} in {', '.join(records)}")
    devices = sorted({records[r["source"]]["device"].split(" (")[0] for r in runs.values()})  # the plotted runs
    commits = sorted({r["commit"] for r in runs.values()})
    fig = _figure(12)
    ax, dx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for i, (label, seeds) in enumerate(sorted(groups.items())):
        steps = sorted(set.intersection(*(set(c) for c in seeds.values())) - {0})
        mean = [sum(c[s] for c in seeds.values()) / len(seeds) for s in steps]
        ax.plot(steps, mean, color=f"C{i}", marker="o", markersize=3, label=f"{label}, mean of {len(seeds)} "
                f"({mean[-1]:.4f})")
        if label == "bf16":
            continue
        paired = [sd for sd in seeds if sd in groups["bf16"]]
        rel = [[(seeds[sd][s] / groups["bf16"][sd][s] - 1) * 100 for sd in paired] for s in steps]
        dx.plot(steps, [sum(v) / len(v) for v in rel], color=f"C{i}", marker="o", markersize=3,
                label=f"{label} - bf16, mean of {len(paired)} paired seeds")
        dx.fill_between(steps, [min(v) for v in rel], [max(v) for v in rel], color=f"C{i}", alpha=0.2)
    ax.set_yscale("log")
    ax.set_title(args.title or "validation loss")
    fig.suptitle(f"{', '.join(devices)}; commits {', '.join(commits)}", fontsize=9)
    dx.axhline(0, color="k", linewidth=0.8)
    dx.set_title("paired difference from bf16, % (band: min-max over seeds)")
    _save(fig, [ax], args.out)
    dx.set_xlabel("step")
    dx.set_ylabel("% of bf16's loss")
    dx.grid(True, alpha=0.3)
    dx.legend()
    fig.tight_layout()
    _save(fig, [], args.out)
    print(args.out)


if __name__ == "__main__":
    main()
