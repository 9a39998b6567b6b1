"""Whole-model training benchmark (issue 11 item 5, issue 15 item 1): ``coat bench`` with the
repository's result files as defaults.

Every configuration (model, setup, batch) runs in its own process: peak memory (beside the
estimate of ``coat/memory.py``), resident memory, tokens/s, step-time spread, host time per step,
and tokens/s over both BF16 baselines at the same batch, measured in the same run. Results merge
into ``benchmarks/results/bench_e2e.json`` (keyed by device, model, setup, batch, sequence, ranks);
the PNG goes to ``benchmarks/results/bench_e2e_<device>.png``. ``coat/cli/bench_worker.py``
defines each figure.

    python benchmarks/bench_e2e.py                                  # Llama-2-7B, amp bf16 coat coat-lean
    python benchmarks/bench_e2e.py --models llama2-7b llama2-13b llama3-8b --skip-predicted-oom
    python benchmarks/bench_e2e.py --setups bf16 coat-lean torchao --setup-batches torchao=1,4
    python benchmarks/bench_e2e.py --fsdp 2                         # torchrun, FSDP2, per-GPU figures
    python benchmarks/bench_e2e.py --report-only                    # tables + PNGs from the JSON, no runs

Under torchrun directly (``torchrun --nproc-per-node 2 benchmarks/bench_e2e.py --fsdp 2 --models
llama2-7b --setups amp --batches 1``) each process is one rank of that one configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from coat.cli import bench

RESULTS = Path(__file__).resolve().parent / "results"
JSON_DEFAULT = RESULTS / "bench_e2e.json"


def _slug(device: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "device"


def report_only(args: argparse.Namespace) -> int:
    """Print the tables and draw the PNGs of what the JSON already holds (filtered by the flags)."""
    path = Path(args.json)
    if not path.exists():
        raise bench.BenchError(f"argument --json: {path} does not exist (nothing to report)")
    records = json.loads(path.read_text()).get("records", [])
    if args.models:
        records = [r for r in records if r["model"] in args.models]
    if args.setups:
        records = [r for r in records if r["setup"] in args.setups]
    if args.fsdp:
        records = [r for r in records if r.get("world", 1) == args.fsdp]
    if not records:
        print(f"no records in {path} match the flags")
        return 1
    for dev in sorted({r.get("device", "?") for r in records}):
        rs = [r for r in records if r.get("device", "?") == dev]
        print(f"\n### {dev}\n")
        print(bench.markdown(rs))
        if args.png is not None:
            for p in bench.plot(rs, Path(args.png or RESULTS / f"bench_e2e_{_slug(dev)}.png")):
                print(f"plot: {p}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(p, json_default=str(JSON_DEFAULT), png_default="")
    p.add_argument("--report-only", action="store_true", help="run nothing: tables and PNGs from --json")
    args = p.parse_args(argv)
    try:
        if args.report_only:
            return report_only(args)
        png_given = bool(args.png)
        if not png_given:
            args.png = None  # named after the device, known once the run has reported
        records, _ = bench.run(args)
        if not png_given and not (bench.in_torchrun() and os.environ.get("RANK") != "0"):
            devices = {r.get("device") for r in records if r.get("device")}
            for dev in sorted(devices):
                rs = [r for r in records if r.get("device") == dev]
                for path in bench.plot(rs, RESULTS / f"bench_e2e_{_slug(dev)}.png"):
                    print(f"plot: {path}")
    except bench.BenchError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
