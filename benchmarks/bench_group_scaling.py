"""Group scaling (issue 28, item 2) on one Llama-2-7B decoder layer: forward + backward of the
converted layer (per-tensor FP8, coat's default) in three settings, the same codes and results bit
for bit (tests/python/test_group_amax.py, test_weight_amax.py), so only the time differs:
- "off": an amax pass per operand (``coat._ops.block.PRODUCER_AMAX = False``, no weight amax);
- "on": the norm and SwiGLU kernels write their outputs' amax (PRODUCER_AMAX, the default), the
  weights still take an amax pass each;
- "on+weights" (coat's default with its optimizers): also each weight's amax as coat.optim.AdamW's
  step wrote it (``coat.nn.weight_amax``; one step with lr 0 before timing, so the weights stay put).

Per batch, alternating the two in ``--rounds`` rounds (each round a median of ``--reps`` steps):
- kernel time: the step captured in a CUDA graph and replayed (no host launch overhead), CUDA events;
- eager time: the step as a training loop runs it, CUDA events;
- the amax passes left per step and what they read, from a torch.profiler trace.

    python benchmarks/bench_group_scaling.py [--batch 1 2] [--rounds 5] [--reps 20] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_layer import build  # noqa: E402
from common import _median_events, environment  # noqa: E402

import coat  # noqa: E402
import coat.optim  # noqa: E402
from coat._ops import block as blk  # noqa: E402
from coat.nn import weight_amax  # noqa: E402


def amax_launches(step, n: int = 5) -> tuple[float, float]:
    """(amax-pass kernels per step, their device microseconds per step), from a profiler trace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "amax_kernel" in e.name]
    us = sum(getattr(e, "device_time_total", 0) or e.cuda_time_total for e in ev)
    return len(ev) / n, us / n


def measure(batch: int, rounds: int, reps: int) -> dict:
    hf, x, dy, pe, pos = build(batch, 2048, 4096, 11008, 32)
    layer = coat.convert(copy.deepcopy(hf))
    del hf
    params = list(layer.parameters())

    def step():
        for p in params:
            p.grad = None
        xi = x.detach().requires_grad_()
        layer(xi, position_embeddings=pe, position_ids=pos).backward(dy)

    # the weights' amax slots, written once: with lr 0 and no weight decay the step leaves them as they are
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = coat.optim.AdamW(params, lr=0.0, weight_decay=0.0, master_weights="bf16_sr")
    opt.step()
    assert all(weight_amax.current([p]) is not None for p in params if weight_amax.wants_slot(p))

    res = {name: {"graph": [], "eager": []} for name, *_ in SETTINGS}
    graphs = {}
    for name, producer, weights in SETTINGS:
        set_flags(producer, weights)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()  # warm the side stream's allocator pool
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g), weight_amax.readable_in_capture():  # the weights never change here
            step()
        graphs[name] = g
        res[name]["amax_kernels"], res[name]["amax_us"] = amax_launches(step)
    for _ in range(rounds):
        for name, producer, weights in SETTINGS:
            set_flags(producer, weights)
            res[name]["graph"].append(_median_events(graphs[name].replay, reps))
            res[name]["eager"].append(_median_events(step, reps))
    set_flags(True, True)
    out = {"batch": batch}
    for name, *_ in SETTINGS:
        r = res[name]
        out[name] = dict(graph_ms=statistics.median(r["graph"]), eager_ms=statistics.median(r["eager"]),
                         graph_rounds=r["graph"], eager_rounds=r["eager"], amax_kernels=r["amax_kernels"],
                         amax_us=r["amax_us"])
    for name in ("on", "on+weights"):
        out[f"graph_speedup_{name}"] = out["off"]["graph_ms"] / out[name]["graph_ms"]
        out[f"eager_speedup_{name}"] = out["off"]["eager_ms"] / out[name]["eager_ms"]
    return out


#: (name, producer amax, the optimizer's weight amax)
SETTINGS = (("off", False, False), ("on", True, False), ("on+weights", True, True))


def set_flags(producer: bool, weights: bool) -> None:
    blk.PRODUCER_AMAX = producer
    weight_amax.ENABLED = weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_group_scaling.py needs a CUDA device")
    rows = [measure(b, args.rounds, args.reps) for b in args.batch]
    env = environment()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=2)
    print(f"\n{env['device']}, torch {env['torch']}, commit {env['commit']}; one Llama-2-7B layer, fwd+bwd, "
          "per-tensor FP8\n")
    print("| tokens | group scaling | kernel ms (graph) | eager ms | amax passes / step | their us |")
    print("|---|---|---:|---:|---:|---:|")
    labels = {"off": "off (amax pass per operand)", "on": "producers only", "on+weights": "+ weights (default)"}
    for r in rows:
        for name, *_ in SETTINGS:
            o = r[name]
            print(f"| {r['batch']}x2048 | {labels[name]} | {o['graph_ms']:.3f} | {o['eager_ms']:.3f} | "
                  f"{o['amax_kernels']:.0f} | {o['amax_us']:.0f} |")
        for name in ("on", "on+weights"):
            print(f"| {r['batch']}x2048 | speed-up, {labels[name]} | {r[f'graph_speedup_{name}']:.3f}x | "
                  f"{r[f'eager_speedup_{name}']:.3f}x | | |")


if __name__ == "__main__":
    main()
