"""How many non-zero GEMM inputs FP8 flushes to zero, per scaling granularity (issue 28's statistic,
docs/scaling.md): the inputs of every decoder linear of a trained model on held-out tokens, in bf16
as coat's layers see them, quantized to E4M3 per tensor (coat's default), per row (per token) and in
1 x 128 groups (block scaling), and for the weight-gradient GEMM per tensor, per channel and in
128 x 1 groups (their transposes). The codes are coat's own (its CPU reference equals its kernels
bit for bit), so the figures hold for the GPU as well.

    python benchmarks/study_underflow.py MODEL_DIR --val-tokens VAL.npy [--batches 4] [--seq 256] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np
import torch
import transformers as tf

from coat._ops import quantize as Q
from coat._ops.enums import FP8_FORMATS

E4 = FP8_FORMATS["e4m3"]
OPS = {"q_proj": "q/k/v input (norm output)", "o_proj": "o_proj input (attention output)",
       "gate_proj": "gate/up input (norm output)", "down_proj": "down_proj input (SwiGLU output)"}


def flushed(x: torch.Tensor) -> dict[str, float]:
    """Fraction of x's non-zero elements whose E4M3 code is zero, per granularity."""
    nz = x != 0
    n = max(int(nz.sum()), 1)
    rows, cols = x.shape
    out = {}

    def frac(codes: torch.Tensor, mask: torch.Tensor) -> float:
        return int(((codes.view(torch.uint8) & 0x7F) == 0).logical_and(mask).sum()) / n

    out["tensor"] = frac(Q.quantize_per_tensor_amax(x, E4, False)[0], nz)
    out["row"] = frac(Q.quantize_scaled([x], rows, cols, E4, "row", None)[0], nz)
    out["block 1x128"] = frac(Q.quantize_scaled([x], rows, cols, E4, "1x128", None)[0], nz)
    nz_t = nz.t()
    out["dW: per channel"] = frac(Q.quantize_scaled([x], rows, cols, E4, None, "row")[2], nz_t)
    out["dW: block 128x1"] = frac(Q.quantize_scaled([x], rows, cols, E4, None, "1x128")[2], nz_t)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a Hugging Face Llama folder (coat train --save writes one)")
    ap.add_argument("--val-tokens", required=True, help="held-out token ids (.npy), e.g. coat's cached *.val.npy")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    model = tf.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    toks = np.load(args.val_tokens)
    need = args.batches * args.batch_size * args.seq
    if toks.size < need:
        raise SystemExit(f"--val-tokens holds {toks.size} tokens, fewer than the {need} asked for")
    ids = torch.from_numpy(toks[:need].astype(np.int64)).view(args.batches, args.batch_size, args.seq)
    sums: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    per_layer = defaultdict(dict)

    def hook(name, layer):
        def pre(mod, inp):
            x = inp[0].detach().reshape(-1, inp[0].shape[-1]).to(torch.bfloat16)
            r = flushed(x)
            for k, v in r.items():
                sums[name][k].append(v)
            if name == "down_proj":
                per_layer[layer].setdefault("down_proj", []).append(r)
        return pre

    handles = []
    for i, layer in enumerate(model.model.layers):
        for name in OPS:
            mod = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
            handles.append(mod.register_forward_pre_hook(hook(name, i)))
    with torch.no_grad():
        for b in range(args.batches):
            model(input_ids=ids[b])
    for h in handles:
        h.remove()
    table = {OPS[n]: {k: float(np.mean(v)) for k, v in d.items()} for n, d in sums.items()}
    layers = {i: {k: float(np.mean([r[k] for r in d["down_proj"]])) for k in d["down_proj"][0]}
              for i, d in per_layer.items()}
    res = dict(model=args.model, tokens=need, table=table, down_proj_per_layer=layers)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    cols = list(next(iter(table.values())))
    print(f"{args.model}: {need:,} held-out tokens; fraction of non-zero inputs whose E4M3 code is 0\n")
    print("| GEMM input | " + " | ".join(cols) + " |\n|---|" + "---:|" * len(cols))
    for name, r in table.items():
        print(f"| {name} | " + " | ".join(f"{r[c]:.2e}" for c in cols) + " |")
    print("\n| down_proj input, layer | " + " | ".join(cols) + " |\n|---|" + "---:|" * len(cols))
    for i, r in layers.items():
        print(f"| {i} | " + " | ".join(f"{r[c]:.2e}" for c in cols) + " |")


if __name__ == "__main__":
    main()
