"""What ``coat.fp8_stats`` costs: the training step (forward + backward) of a few converted
Llama-2-7B-shaped decoder layers with FP8 operand statistics off and on, in the same run.

Variants (same layers, inputs and output gradient):
- ``off``: the default path (each block forward/backward is one core call);
- ``stats on``: recording every step (the statistics' device passes; the blocks stay one call each
  and also return the GEMM inputs they make, which live until recorded);
- ``read()``: one read of everything recorded (the one host sync), timed on its own.
The cost when one step in k records (``coat train --fp8-stats`` records one step per log
interval) is (on - off) / k per step.

Times: median of CUDA-event timings of whole steps after warm-up (wall-clock on the CPU).

    python benchmarks/bench_fp8_stats.py [--layers 2] [--batch 4] [--seq 2048] [--reps 20] [--out r.json]
    python benchmarks/bench_fp8_stats.py --device cpu     # smoke test: tiny shapes, slow, not a figure
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import _median_events, environment  # noqa: E402

import coat  # noqa: E402

_CPU_SHAPES = dict(hidden=64, intermediate=160, heads=4, batch=1, seq=32, reps=3)


def median_ms(fn, reps: int, device: torch.device) -> float:
    """Median of CUDA-event timings (benchmarks/common.py) on a GPU, of wall-clock times on the CPU."""
    if device.type == "cuda":
        return _median_events(fn, reps)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build(args, device):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads, max_position_embeddings=max(4096, args.seq))
    cfg._attn_implementation = "sdpa"
    layers = torch.nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(args.layers)).to(device, torch.bfloat16)
    with torch.no_grad():  # HF init leaves linears at nn.Linear defaults; use the LM's std 0.02
        for p in layers.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    layers = torch.nn.ModuleList(coat.convert(layer, recipe="fp8") for layer in layers)
    x = torch.randn(args.batch, args.seq, args.hidden, device=device, dtype=torch.bfloat16)
    dy = torch.randn_like(x) * 1e-2
    pos = torch.arange(args.seq, device=device)[None]
    pe = LlamaRotaryEmbedding(cfg).to(device)(x, pos)
    return layers, x, dy, pe, pos


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--layers", type=int, default=2)
    for name, default in (("batch", 4), ("seq", 2048), ("hidden", 4096), ("intermediate", 11008), ("heads", 32),
                          ("reps", 20)):
        ap.add_argument(f"--{name}", type=int, default=None, help=f"default {default} (cuda), "
                        f"{_CPU_SHAPES[name]} (cpu)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    cuda = dict(batch=4, seq=2048, hidden=4096, intermediate=11008, heads=32, reps=20)
    for name, default in (_CPU_SHAPES if args.device == "cpu" else cuda).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA device (use --device cpu for a smoke test)")
    device = torch.device(args.device)
    layers, x, dy, pe, pos = build(args, device)
    params = list(layers.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        h = x.detach().requires_grad_()
        for layer in layers:
            h = layer(h, position_embeddings=pe, position_ids=pos)
        h.backward(dy)

    stats = coat.fp8_stats(layers)

    def recorded_step() -> None:
        with stats:
            step()

    rows = {}
    for name, fn in (("off", step), ("stats on", recorded_step), ("off (again)", step)):
        for _ in range(3):  # warm-up: cuBLASLt plans, allocator, the collector's buffers
            fn()
        rows[name] = median_ms(fn, args.reps, device)
    rows["read()"] = median_ms(lambda: stats.read(), args.reps, device)
    data = stats.read()
    off = min(rows["off"], rows["off (again)"])
    env = environment() | dict(layers=args.layers, batch=args.batch, seq=args.seq, hidden=args.hidden,
                               intermediate=args.intermediate, heads=args.heads, reps=args.reps)
    result = dict(env=env, ms=rows, overhead_on=rows["stats on"] / off - 1, recorded=sum(len(r) for r in data.values()))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\n{env['device']}, torch {env['torch']}, commit {env['commit']}; {args.layers} Llama layers, hidden "
          f"{args.hidden}, intermediate {args.intermediate}, {args.heads} heads, {args.batch}x{args.seq} tokens; "
          f"median of {args.reps} steps ({'CUDA events' if device.type == 'cuda' else 'wall clock'})\n")
    print("| variant | ms per step | vs off |")
    print("|---|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.3f} | {'' if name == 'read()' else f'{ms / off - 1:+.1%}'} |")
    print(f"\nstats on every step: {result['overhead_on']:+.1%}; one step in 10: {result['overhead_on'] / 10:+.1%}; "
          f"{result['recorded']} (projection, role) entries recorded\n")
    print(stats.table({k: data[k] for k in list(data)[:4]}))


if __name__ == "__main__":
    main()
