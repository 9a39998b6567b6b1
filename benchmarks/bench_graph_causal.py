"""The CUDA-graph step (coat.CudaGraphStep) of Llama-2-7B coat lean (AdamW, bf16_sr) with SDPA's
is_causal path in the captured forward ("on": coat.nn.attention.plain_causal, the default where no
batch can pad) against Hugging Face's materialized causal mask ("off": what a capture got before,
transformers treats a CUDA-graph capture as tracing), beside the eager step: paired rounds, a fresh
graph step per round.

    python benchmarks/bench_graph_causal.py [--batches 1 2] [--rounds 4] [--out FILE.json]
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import back_to_back_ms, environment, write_json  # noqa: E402

import coat  # noqa: E402
import coat.optim  # noqa: E402
from coat import graphs  # noqa: E402
from coat.cli.bench_worker import build_model  # noqa: E402
from coat.memory_shapes import PRESETS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = build_model(PRESETS["llama2-7b"], torch.bfloat16, dev)
    coat.convert(model)
    opt = coat.optim.AdamW(model.parameters(), lr=1e-5, master_weights="bf16_sr")
    plain = graphs.CudaGraphStep._unpadded
    res = {"env": environment(), "rows": {}}
    try:
        for batch in args.batches:
            ids = torch.randint(0, 32000, (batch, 2048), device=dev)

            def eager():
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            t = {"on": [], "off": [], "eager": []}
            for r in range(args.rounds + 1):  # round 0 warms up
                for mode in t:
                    if mode == "eager":
                        ms = back_to_back_ms(eager, args.reps, warmup=3)
                    else:
                        graphs.CudaGraphStep._unpadded = plain if mode == "on" else (lambda self, b: False)
                        g = graphs.CudaGraphStep(model, opt, warmup_steps=1)
                        ms = back_to_back_ms(lambda: g(input_ids=ids, labels=ids, use_cache=False), args.reps, warmup=3)
                        del g
                        torch.cuda.empty_cache()
                    if r:
                        t[mode].append(ms)
            res["rows"][batch] = {k: dict(ms=statistics.median(v), rounds=v) for k, v in t.items()}
    finally:
        graphs.CudaGraphStep._unpadded = plain
    print("| batch | graph, is_causal (ms) | graph, HF mask (ms) | eager (ms) | is_causal vs mask |")
    print("|---:|---:|---:|---:|---:|")
    for b, r in res["rows"].items():
        print(f"| {b} | {r['on']['ms']:.2f} | {r['off']['ms']:.2f} | {r['eager']['ms']:.2f} | "
              f"{r['off']['ms'] / r['on']['ms']:.3f}x |")
    write_json(args.out, res)


if __name__ == "__main__":
    main()
