"""Convergence of `coat train` with coat.optim.AdamW against torch.optim.AdamW: the same run (same
seed, data order and initialisation) twice, --optim torch and --optim coat, plotted in one PNG;
prints both final validation losses and their relative difference (target: within 1%).

    python benchmarks/convergence_optim.py --steps 2000 --out runs/convergence_optim
    python benchmarks/convergence_optim.py --steps 2000 --master-weights bf16_sr   # no master copy

Extra arguments after `--` go to both `coat train` runs (e.g. `-- --model small --batch-size 16`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from coat.cli.main import main as coat_main
from coat.cli.plot import plot_runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--master-weights", choices=("fp32", "bf16_sr"), default="fp32")
    ap.add_argument("--out", default="runs/convergence_optim")
    ap.add_argument("rest", nargs="*", help="extra `coat train` arguments (after --)")
    args = ap.parse_args()
    out = Path(args.out)
    runs = {}
    for optim in ("torch", "coat"):
        d = out / optim
        argv = ["train", "--optim", optim, "--steps", str(args.steps), "--seed", str(args.seed), "--out", str(d),
                *args.rest]
        if optim == "coat":
            argv += ["--master-weights", args.master_weights]
        print("coat", " ".join(argv), flush=True)
        if coat_main(argv) != 0:
            return 1
        runs[optim] = json.loads((d / "summary.json").read_text())
    png = plot_runs({f"torch AdamW": out / "torch" / "metrics.jsonl",
                     f"coat AdamW (FP8 states, {args.master_weights})": out / "coat" / "metrics.jsonl"},
                    out / "convergence_optim.png", title=f"coat train, {args.steps} steps: torch vs coat AdamW")
    t, c = runs["torch"]["final_val_loss"], runs["coat"]["final_val_loss"]
    rel = (c - t) / t
    result = {"steps": args.steps, "torch_final_val_loss": t, "coat_final_val_loss": c, "relative_difference": rel,
              "master_weights": args.master_weights, "plot": str(png)}
    (out / "convergence_optim.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nfinal val loss: torch {t:.4f}, coat {c:.4f}, relative difference {rel:+.2%} "
          f"({'within' if abs(rel) <= 0.01 else 'OUTSIDE'} 1%); plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
