"""The optimizer's weight amax (coat/nn/weight_amax.py; issue 28 item 2), paired A/B with
``weight_amax.ENABLED`` on and off (the same numerics bit for bit, tests/python/test_weight_amax.py,
so only time differs), in alternating rounds on one GPU:

- ``optim``: the optimizer step alone on 4 Llama-2-7B layers' matrices (1.07e9 bf16 parameters,
  bf16 gradients): what writing each weight's amax costs the step;
- ``step``: the whole Llama-2-7B training step (random init, sequence 2048) per recipe: "coat"
  (coat.optim.AdamW, fp32 master), "lean" (bf16_sr), "lean4" (AdamW4bit, bf16_sr), "graph" (lean,
  coat.CudaGraphStep: a fresh graph step per round, whose eager warm-up writes the slots before it
  captures).

    python benchmarks/bench_weight_amax.py [--parts optim step] [--recipes coat lean lean4 graph]
        [--batches 1 2] [--rounds 5] [--reps 8] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import back_to_back_ms, environment, write_json  # noqa: E402

import coat  # noqa: E402
import coat.optim  # noqa: E402
from coat.cli.bench_worker import build_model  # noqa: E402
from coat.memory_shapes import PRESETS  # noqa: E402
from coat.nn import weight_amax as WA  # noqa: E402
from coat.nn import weights as W  # noqa: E402


def paired(make_step, rounds: int, reps: int, warm: int = 3) -> dict:
    """Median ms per call with ENABLED on and off, alternating; round 0 warms both up.
    ``make_step(flag)`` returns the call to time under that flag (made after the flag is set)."""
    times: dict[bool, list[float]] = {True: [], False: []}
    used = {}
    for r in range(rounds + 1):
        for flag in (True, False):
            WA.ENABLED = flag
            step = make_step(flag)
            for _ in range(warm):
                step()
            torch.cuda.synchronize()
            before = W.stats["optimizer_amax"]
            t = back_to_back_ms(step, reps)
            used[str(flag)] = W.stats["optimizer_amax"] - before
            if r:
                times[flag].append(t)
    WA.ENABLED = True
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return dict(on_ms=on, off_ms=off, speedup=off / on, on_rounds=times[True], off_rounds=times[False],
                forwards_with_optimizer_amax_per_block=used)


def optim_part(rounds: int) -> list[dict]:
    dev = torch.device("cuda")
    shapes = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]
    params = [torch.nn.Parameter(torch.randn(s, device=dev, dtype=torch.bfloat16) * 0.02)
              for _ in range(4) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    rows = []
    for name, cls, master in (("AdamW fp32 master", coat.optim.AdamW, "fp32"),
                              ("AdamW bf16_sr", coat.optim.AdamW, "bf16_sr"),
                              ("AdamW4bit bf16_sr", coat.optim.AdamW4bit, "bf16_sr")):
        opt = cls(params, lr=1e-6, master_weights=master)
        r = paired(lambda flag, opt=opt: opt.step, rounds, 20)
        opt.step()  # ENABLED again: the slots now hold the weights' amax
        r["amax_exact"] = all(torch.equal(WA.current([p])[0], p.detach().float().abs().amax().reshape(1))
                              for p in params)
        rows.append(dict(config=name, **r))
    return rows


def step_part(recipe: str, batch: int, rounds: int, reps: int) -> dict:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = build_model(PRESETS["llama2-7b"], torch.bfloat16, dev)
    coat.convert(model)
    cls = coat.optim.AdamW4bit if recipe == "lean4" else coat.optim.AdamW
    opt = cls(model.parameters(), lr=1e-5, master_weights="fp32" if recipe == "coat" else "bf16_sr")
    ids = torch.randint(0, 32000, (batch, 2048), device=dev)

    def eager():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    holder = {}

    def make_step(flag):
        if recipe != "graph":
            return eager
        holder.pop("g", None)
        torch.cuda.empty_cache()
        g = holder["g"] = coat.CudaGraphStep(model, opt, warmup_steps=1)
        return lambda: g(input_ids=ids, labels=ids, use_cache=False)

    r = paired(make_step, rounds, reps)
    holder.clear()
    r.update(recipe=recipe, batch=batch, peak_gib=torch.cuda.max_memory_allocated() / 2**30,
             tokens_per_s_on=batch * 2048 / r["on_ms"] * 1e3, tokens_per_s_off=batch * 2048 / r["off_ms"] * 1e3)
    return r  # the model and optimizer go with this frame


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=("optim", "step"), default=["optim", "step"])
    ap.add_argument("--recipes", nargs="+", choices=("coat", "lean", "lean4", "graph"),
                    default=["coat", "lean", "lean4", "graph"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=8, help="timed steps per round (the optimizer part: 20)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_weight_amax.py needs a CUDA device")
    res: dict = {"env": environment()}
    if "optim" in args.parts:
        res["optim"] = optim_part(args.rounds)
        print("| optimizer (1.07e9 params) | amax off ms | on ms | on / off | amax exact |\n|---|---:|---:|---:|---|")
        for r in res["optim"]:
            print(f"| {r['config']} | {r['off_ms']:.3f} | {r['on_ms']:.3f} | {r['on_ms'] / r['off_ms']:.3f} | "
                  f"{r['amax_exact']} |")
    if "step" in args.parts:
        res["step"] = []
        for rc in args.recipes:
            for b in args.batches:
                res["step"].append(step_part(rc, b, args.rounds, args.reps))
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        print("| Llama-2-7B step | batch | amax off ms | on ms | speed-up | peak GiB |\n|---|---:|---:|---:|---:|---:|")
        for r in res["step"]:
            print(f"| {r['recipe']} | {r['batch']} | {r['off_ms']:.2f} | {r['on_ms']:.2f} | {r['speedup']:.4f}x | "
                  f"{r['peak_gib']:.2f} |")
    write_json(args.out, res)


if __name__ == "__main__":
    main()
