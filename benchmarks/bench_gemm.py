"""FP8 GEMM benchmark: torch BF16 matmul vs torch._scaled_mm vs coat fp8_gemm on Llama-2-7B shapes.

Each row is one GEMM Y[M,N] = A[M,K] B[N,K]^T (the layout of nn.Linear) with M = 8192 tokens
(4 x 2048): the forward GEMMs of the decoder layer's linears, their dX and dW GEMMs (operand A in
E5M2 as in coat's backward), and 8192^3. Timing: CUDA events per repetition, after warm-up, median
of --reps, with a GPU sleep queued first so the CPU enqueues every repetition before the GPU reaches
it (launch overhead is not timed), and inputs rotated over several copies so that no repetition
finds its operands in L2. Also one Fp8Linear forward+backward row against nn.Linear in bf16.

    python benchmarks/bench_gemm.py [--reps 30] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment  # noqa: E402
import torch.nn as nn

from coat import functional as F
from coat._ops import gemm as G
from coat.nn import Fp8Linear
from coat.nn import linear as L

DATASHEET_FP8_TFLOPS = 1979.0  # H100 SXM / H200, dense FP8 (3958 is the sparse figure)
L2_BYTES = 60 << 20

TOKENS = 8192
HIDDEN, INTER = 4096, 11008
# (name, N, K) of y = x W^T with W [N, K].
LINEARS = [("qkv", 3 * HIDDEN, HIDDEN), ("o_proj", HIDDEN, HIDDEN), ("gate_up", 2 * INTER, HIDDEN), ("down", HIDDEN, INTER)]


def shapes():
    rows = []
    for name, n, k in LINEARS:
        rows.append((f"{name} fwd", TOKENS, n, k, "e4m3"))
    for name, n, k in LINEARS:  # dX[M, K] = dY[M, N] W[N, K]: GEMM (M, K, N)
        rows.append((f"{name} dX", TOKENS, k, n, "e5m2"))
    for name, n, k in LINEARS:  # dW[N, K] = dY^T[N, M] X[M, K]: GEMM (N, K, M)
        rows.append((f"{name} dW", n, k, TOKENS, "e5m2"))
    rows.append(("8192^3", 8192, 8192, 8192, "e4m3"))
    return rows


def time_ms(fn, reps: int, warmup: int = 5) -> float:
    """Median CUDA-event time of fn(i) over reps, i the repetition index (for input rotation)."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work: the CPU runs ahead and enqueues everything
    for i in range(reps):
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copies(nbytes_per_set: int) -> int:
    """How many operand sets to rotate so consecutive repetitions never share L2 contents."""
    return max(2, min(8, -(-2 * L2_BYTES // max(nbytes_per_set, 1)) + 1))


def bench_gemm(name, m, n, k, fa, reps):
    dev = "cuda"
    flops = 2.0 * m * n * k
    nset = copies(m * k + n * k)
    gen = torch.Generator(device=dev).manual_seed(0)
    xs = [torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(nset)]
    ws = [torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02 for _ in range(nset)]
    q_a = [F.quantize_per_tensor(x, fa) for x in xs]
    q_b = [F.quantize_per_tensor(w, "e4m3") for w in ws]

    t_bf16 = time_ms(lambda i: torch.matmul(xs[i % nset], ws[i % nset].t()), reps)
    del xs, ws  # make room for the FP8 runs
    t_smm = time_ms(
        lambda i: torch._scaled_mm(
            q_a[i % nset].data, q_b[i % nset].data.t(), scale_a=q_a[i % nset].scale,
            scale_b=q_b[i % nset].scale, out_dtype=torch.bfloat16,
        ),
        reps,
    )
    t_coat = time_ms(
        lambda i: G.fp8_gemm(q_a[i % nset].data, q_b[i % nset].data, q_a[i % nset].scale, q_b[i % nset].scale, None, torch.bfloat16),
        reps,
    )
    torch.cuda.empty_cache()
    tf = lambda t: flops / (t * 1e-3) / 1e12  # noqa: E731
    return {
        "name": name, "M": m, "N": n, "K": k, "a_fmt": fa,
        "bf16_ms": t_bf16, "scaled_mm_ms": t_smm, "coat_ms": t_coat,
        "bf16_tflops": tf(t_bf16), "scaled_mm_tflops": tf(t_smm), "coat_tflops": tf(t_coat),
        "coat_vs_scaled_mm": t_smm / t_coat, "coat_vs_bf16": t_bf16 / t_coat,
    }


def bench_linear(n, k, reps):
    """Fp8Linear forward+backward vs nn.Linear in bf16, x [4, 2048, k]."""
    dev = "cuda"
    torch.manual_seed(0)
    ref = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    f8 = Fp8Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    f8.load_state_dict(ref.state_dict())
    nset = 3
    xs = [torch.randn(4, 2048, k, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(nset)]
    dys = [torch.randn(4, 2048, n, device=dev, dtype=torch.bfloat16) for _ in range(nset)]

    def step(mod, invalidate=False):
        def run(i):
            if invalidate:
                L.invalidate_weight_cache()
            mod(xs[i % nset]).backward(dys[i % nset])
        return run

    out = {"name": f"linear fwd+bwd {n}x{k}", "M": TOKENS, "N": n, "K": k}
    out["bf16_ms"] = time_ms(step(ref), reps)
    out["fp8_cached_w_ms"] = time_ms(step(f8), reps)
    out["fp8_requant_w_ms"] = time_ms(step(f8, invalidate=True), reps)
    out["speedup_cached"] = out["bf16_ms"] / out["fp8_cached_w_ms"]
    out["speedup_requant"] = out["bf16_ms"] / out["fp8_requant_w_ms"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemm needs a CUDA device")
    dev_name = torch.cuda.get_device_name()
    commit = environment()["commit"]
    rows = []
    for spec in shapes():
        r = bench_gemm(*spec, reps=args.reps)
        rows.append(r)
        print(f"{r['name']:>14}  bf16 {r['bf16_tflops']:7.1f}  _scaled_mm {r['scaled_mm_tflops']:7.1f}  "
              f"coat {r['coat_tflops']:7.1f} TFLOP/s  coat/_scaled_mm {r['coat_vs_scaled_mm']:.3f}", flush=True)
    ceiling = max(max(r["scaled_mm_tflops"], r["coat_tflops"]) for r in rows)
    for r in rows:
        r["coat_frac_measured_peak"] = r["coat_tflops"] / ceiling
        r["coat_frac_datasheet"] = r["coat_tflops"] / DATASHEET_FP8_TFLOPS
    lin = bench_linear(3 * HIDDEN, HIDDEN, args.reps)
    meta = {"device": dev_name, "torch": torch.__version__, "commit": commit, "reps": args.reps,
            "measured_fp8_ceiling_tflops": ceiling, "datasheet_fp8_dense_tflops": DATASHEET_FP8_TFLOPS}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "gemm": rows, "linear": lin}, f, indent=2)

    print(f"\n{dev_name}, torch {torch.__version__}, commit {commit}, median of {args.reps} reps, "
          f"M=8192 tokens, bf16 output, per-tensor scales, no fast accumulation")
    print(f"Measured FP8 ceiling (best row): {ceiling:.0f} TFLOP/s; datasheet dense FP8: {DATASHEET_FP8_TFLOPS:.0f}\n")
    print("| GEMM | M | N | K | A fmt | torch bf16 TFLOP/s | _scaled_mm TFLOP/s | coat TFLOP/s | coat / _scaled_mm | coat / ceiling | coat / datasheet |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['M']} | {r['N']} | {r['K']} | {r['a_fmt']} | {r['bf16_tflops']:.0f} | "
              f"{r['scaled_mm_tflops']:.0f} | {r['coat_tflops']:.0f} | {r['coat_vs_scaled_mm']:.3f} | "
              f"{r['coat_frac_measured_peak']:.2f} | {r['coat_frac_datasheet']:.2f} |")
    print("\n| layer (x [4, 2048, K]) | nn.Linear bf16 ms | Fp8Linear ms (cached W) | Fp8Linear ms (W re-quantized) | speed-up cached | speed-up re-quantized |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| {lin['name']} | {lin['bf16_ms']:.3f} | {lin['fp8_cached_w_ms']:.3f} | {lin['fp8_requant_w_ms']:.3f} | "
          f"{lin['speedup_cached']:.2f}x | {lin['speedup_requant']:.2f}x |")


if __name__ == "__main__":
    main()
