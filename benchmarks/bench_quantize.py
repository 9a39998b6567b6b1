"""FP8 quantization kernels against torch eager and torch.compile, as a fraction of copy bandwidth.

    python benchmarks/bench_quantize.py [--out results.json] [--no-compile]

Bytes: 'useful' counts each input read once and each output written once (the floor of any
implementation); per-tensor quantize with a fused amax must read the input twice (the scale depends
on every element before any code can be written), so it also reports the bytes it actually moves.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    copy_bandwidth_gbs,
    environment,
    host_us_per_call,
    markdown_table,
    rotation,
    time_ms,
    write_json,
)

import coat.functional as F  # noqa: E402

SHAPES = {
    "16384x8192": (16384, 8192),
    "llama7b act 8192x4096": (8192, 4096),
    "llama7b mlp 8192x11008": (8192, 11008),
    "llama7b gate_up 8192x22016": (8192, 22016),
    "llama7b weight 11008x4096": (11008, 4096),
}
E4M3 = torch.float8_e4m3fn


def torch_per_tensor_amax(x):
    amax = x.abs().amax().float()
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (x.float() * (1.0 / scale)).clamp(-448, 448).to(E4M3), scale


def torch_per_group(x, g):
    xg = x.float().reshape(*x.shape[:-1], -1, g)
    amax = xg.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (xg * (1.0 / scale)).clamp(-448, 448).to(E4M3).reshape(x.shape), scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write all figures as JSON here")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), help="subset of: " + ", ".join(SHAPES))
    args = ap.parse_args()

    env = environment()
    copy_gbs = copy_bandwidth_gbs()
    compiled = {}
    if not args.no_compile:
        compiled["per_tensor"] = torch.compile(torch_per_tensor_amax, dynamic=False)
        compiled["group16"] = torch.compile(lambda x: torch_per_group(x, 16), dynamic=False)
        compiled["group128"] = torch.compile(lambda x: torch_per_group(x, 128), dynamic=False)

    rows = []
    for name in args.shapes:
        m, k = SHAPES[name]
        n = m * k
        xs = rotation(lambda: torch.randn(m, k, device="cuda", dtype=torch.bfloat16), 2 * n)
        cases = [
            # (kernel, coat fn, torch eager fn, compiled key, useful bytes, moved bytes)
            ("per-tensor + fused amax", lambda x: F.quantize_per_tensor(x), torch_per_tensor_amax,
             "per_tensor", 3 * n, 5 * n),
            ("per-tensor, given scale", lambda x, s=torch.ones(1, device="cuda"): F.quantize_per_tensor(x, scale=s),
             None, None, 3 * n, 3 * n),
            ("per-tensor + amax + transpose", lambda x: F.quantize_per_tensor(x, transpose=True), None, None,
             4 * n, 6 * n),
            ("per-group 1x16 fp32", lambda x: F.quantize_per_group(x, 16), lambda x: torch_per_group(x, 16),
             "group16", 3 * n + n // 16 * 4, 3 * n + n // 16 * 4),
            ("per-group 1x128 fp32", lambda x: F.quantize_per_group(x, 128), lambda x: torch_per_group(x, 128),
             "group128", 3 * n + n // 128 * 4, 3 * n + n // 128 * 4),
            ("per-group 1x16 e8m0", lambda x: F.quantize_per_group(x, 16, scale_kind="e8m0"), None, None,
             3 * n + n // 16, 3 * n + n // 16),
        ]
        for label, ours, eager, ckey, useful, moved in cases:
            ms = time_ms(ours, inputs=[(x,) for x in xs])
            row = {
                "shape": name, "kernel": label, "coat ms": f"{ms:.3f}",
                "useful GB/s": f"{useful / ms / 1e6:.0f}",
                "useful/copy": f"{useful / ms / 1e6 / copy_gbs:.2f}",
                "moved GB/s": f"{moved / ms / 1e6:.0f}",
                "moved/copy": f"{moved / ms / 1e6 / copy_gbs:.2f}",
            }
            if eager is not None:
                e_ms = time_ms(eager, inputs=[(x,) for x in xs])
                row["eager ms"] = f"{e_ms:.3f}"
                row["speed-up vs eager"] = f"{e_ms / ms:.2f}x"
            if ckey in compiled:
                c_ms = time_ms(compiled[ckey], inputs=[(x,) for x in xs], warmup=3)
                row["compile ms"] = f"{c_ms:.3f}"
                row["speed-up vs compile"] = f"{c_ms / ms:.2f}x"
            rows.append(row)
        # Dequantize (1x16 groups back to bf16) and DRE on fp32 moments of the same element count.
        t = F.quantize_per_group(xs[0], 16)
        ms = time_ms(lambda: t.dequantize(torch.bfloat16))
        b = 3 * n + n // 16 * 4
        rows.append({"shape": name, "kernel": "dequantize 1x16 -> bf16", "coat ms": f"{ms:.3f}",
                     "useful GB/s": f"{b / ms / 1e6:.0f}", "useful/copy": f"{b / ms / 1e6 / copy_gbs:.2f}"})
        del xs, t
        torch.cuda.empty_cache()

    m32 = torch.randn(6_740_000 * 64, device="cuda") * 1e-4  # 431M fp32 elements, like 1/16 of Llama-2-7B's m
    n = m32.numel()
    ms = time_ms(lambda: F.dre_quantize(m32), reps=10, graph=False)
    b = 5 * n + n // 128 * 5
    rows.append({"shape": f"fp32 {n/1e6:.0f}M", "kernel": "DRE quantize (groups of 128)", "coat ms": f"{ms:.3f}",
                 "useful GB/s": f"{b / ms / 1e6:.0f}", "useful/copy": f"{b / ms / 1e6 / copy_gbs:.2f}"})
    d = F.dre_quantize(m32)
    ms = time_ms(lambda: d.dequantize(), reps=10, graph=False)
    rows.append({"shape": f"fp32 {n/1e6:.0f}M", "kernel": "DRE dequantize", "coat ms": f"{ms:.3f}",
                 "useful GB/s": f"{b / ms / 1e6:.0f}", "useful/copy": f"{b / ms / 1e6 / copy_gbs:.2f}"})

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    host = {
        "quantize_per_tensor (fused amax)": host_us_per_call(F.quantize_per_tensor, (x,)),
        "quantize_per_group (1x16)": host_us_per_call(F.quantize_per_group, (x, 16)),
        "torch eager per-tensor": host_us_per_call(torch_per_tensor_amax, (x,)),
    }

    cols = ["shape", "kernel", "coat ms", "useful GB/s", "useful/copy", "moved GB/s", "moved/copy",
            "eager ms", "speed-up vs eager", "compile ms", "speed-up vs compile"]
    write_json(args.out, {"env": env, "copy_GBps": copy_gbs, "rows": rows, "host_us_per_call": host})
    print(f"\n{env['device']} | torch {env['torch']} | commit {env['commit']} | copy {copy_gbs:.0f} GB/s\n")
    print(markdown_table(rows, cols))
    print("\nhost overhead per call (us): " + ", ".join(f"{k} {v:.1f}" for k, v in host.items()))


if __name__ == "__main__":
    main()
