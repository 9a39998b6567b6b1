"""FP8 scaling granularity on Llama-2-7B shapes (docs/scaling.md): per granularity, coat's GEMM
against torch._scaled_mm in the same scale mode, and the quantizers that make the operands.

GEMMs, for each linear of the decoder layer (M = --tokens): forward (X x W), dX (dY x W^T) and dW
(dY^T x X^T), in TFLOP/s:
- tensor: one scale per operand (coat's default), fast accumulation on the forward as coat's layers;
- row: per-token x per-channel scales (cuBLASLt OUTER_VEC), fast accumulation on the forward;
- block: 1x128 activations/gradients x 128x128 weights (fwd, dX) and 1x128 x 1x128 (dW), split
  accumulation (the only one cuBLASLt has for block scales). E4M3 gradients (DeepSeek-V3's).
torch._scaled_mm rows use the same codes and scales (tensorwise, rowwise, and the v1 blockwise
layouts), where this torch offers the mode.
Quantizers (GB/s of bf16 read), one [tokens, hidden] activation with its transpose, as the layers
make them: per tensor (amax pass + quantize pass), row (amax pass for the transposed per-channel
scales + quantize), block (1x128 and 128x1 from one read).
Timing as bench_gemm.py (CUDA events, median, operands rotated past L2).

    python benchmarks/bench_scaling.py [--tokens 4096] [--reps 30] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_gemm import LINEARS, copies, time_ms  # noqa: E402
from common import environment  # noqa: E402

from coat._ops import gemm as G  # noqa: E402
from coat._ops import quantize as Q  # noqa: E402
from coat._ops.enums import FP8_FORMATS  # noqa: E402

E4 = torch.float8_e4m3fn
MODES = {  # granularity -> (a mode, b mode) of fwd / dX, and of dW
    "tensor": (("tensor", "tensor"), ("tensor", "tensor")),
    "row": (("row", "row"), ("row", "row")),
    "block": (("1x128", "128x128"), ("1x128", "1x128")),
    # what dW would cost with 128x128 tiles of X^T (not a recipe: DeepSeek-V3 keeps activations 1x128)
    "block-dW-128x128": (("1x128", "128x128"), ("1x128", "128x128")),
}


def operand(x: torch.Tensor, mode: str):
    """(codes as E4M3, scales) of x [rows, K] in mode; per tensor through the per-tensor quantizer."""
    if mode == "tensor":
        q, _, s, _ = Q.quantize_per_tensor_amax(x, FP8_FORMATS["e4m3"], False)
        return q.view(E4), s
    q, s, _, _ = Q.quantize_scaled([x], x.shape[0], x.shape[1], FP8_FORMATS["e4m3"], mode, None)
    return q.view(E4), s


def smm_scales(sa, sb, a_mode, b_mode, m, n, k):
    """The same scales in torch._scaled_mm's v1 shapes, or None where it has no such mode."""
    kb = -(-k // 128)
    if a_mode == "tensor":
        return sa.reshape(()), sb.reshape(())
    if a_mode == "row":
        return sa.view(m, 1), sb.view(1, n)
    a = sa.view(kb, m).t()  # [M, K/128] with strides (1, M): coat's layout is already that
    if b_mode == "1x128":
        return a, sb.view(kb, n)  # [K/128, N], N-major
    l4 = -(-kb // 4) * 4
    return a, sb.view(-(-n // 128), l4)[:, :kb].t()  # [K/128, N/128], strides (1, L4)


def bench_gemm(name, m, n, k, gran, wgrad, reps):
    a_mode, b_mode = MODES[gran][1 if wgrad else 0]
    fast = gran != "block" and name.endswith("fwd")
    nset = copies(m * k + n * k)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ops = []
    for _ in range(nset):
        x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        ops.append((*operand(x, a_mode), *operand(w, b_mode)))
        del x, w
    flops = 2.0 * m * n * k
    tf = lambda t: flops / (t * 1e-3) / 1e12  # noqa: E731
    if gran == "tensor":
        t = time_ms(lambda i: G.fp8_gemm(ops[i % nset][0], ops[i % nset][2], ops[i % nset][1], ops[i % nset][3], None,
                                         torch.bfloat16, fast), reps)
    else:
        t = time_ms(lambda i: G.fp8_gemm_scaled(*(ops[i % nset][j] for j in (0, 2, 1, 3)), a_mode, b_mode,
                                                torch.bfloat16, fast), reps)
    row = {"name": name, "granularity": gran, "M": m, "N": n, "K": k, "a_mode": a_mode, "b_mode": b_mode,
           "fast_accum": fast, "coat_ms": t, "coat_tflops": tf(t)}
    try:
        sc = [smm_scales(o[1], o[3], a_mode, b_mode, m, n, k) for o in ops]
        ts = time_ms(lambda i: torch._scaled_mm(ops[i % nset][0], ops[i % nset][2].t(), scale_a=sc[i % nset][0],
                                                scale_b=sc[i % nset][1], out_dtype=torch.bfloat16,
                                                use_fast_accum=fast), reps)
        row.update(scaled_mm_ms=ts, scaled_mm_tflops=tf(ts))
        # the same numbers from both (same codes, same scales): the scale layouts are the same
        o = ops[0]
        ref = torch._scaled_mm(o[0], o[2].t(), scale_a=sc[0][0], scale_b=sc[0][1], out_dtype=torch.float32)
        got = (G.fp8_gemm(o[0], o[2], o[1], o[3], None, torch.float32) if gran == "tensor"
               else G.fp8_gemm_scaled(o[0], o[2], o[1], o[3], a_mode, b_mode, torch.float32))
        row["vs_scaled_mm_rel"] = ((got - ref).norm() / ref.norm()).item()
    except (RuntimeError, ValueError, TypeError) as e:
        row["scaled_mm_error"] = str(e).splitlines()[0][:160]
    del ops
    torch.cuda.empty_cache()
    return row


def bench_quantize(tokens, hidden, reps):
    """One activation [tokens, hidden] as the forward GEMM's operand and its transpose for dW."""
    nset = copies(tokens * hidden * 2)
    xs = [torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(nset)]
    e4 = FP8_FORMATS["e4m3"]
    gb = tokens * hidden * 2 / 1e9
    rows = []
    for name, fn in (
        ("tensor (amax + quantize, q and q_t)", lambda i: Q.quantize_per_tensor_amax(xs[i % nset], e4, True)),
        ("row (q per token, q_t per channel)", lambda i: Q.quantize_scaled([xs[i % nset]], tokens, hidden, e4, "row",
                                                                            "row")),
        ("block (q 1x128, q_t 128x1)", lambda i: Q.quantize_scaled([xs[i % nset]], tokens, hidden, e4, "1x128",
                                                                    "1x128")),
        ("block, q only (1x128)", lambda i: Q.quantize_scaled([xs[i % nset]], tokens, hidden, e4, "1x128", None)),
        ("tensor, q only", lambda i: Q.quantize_per_tensor_amax(xs[i % nset], e4, False)),
        ("block weight 128x128, q only", lambda i: Q.quantize_scaled([xs[i % nset]], tokens, hidden, e4, "128x128",
                                                                      None)),
        ("block weight 128x128, q_t only", lambda i: Q.quantize_scaled([xs[i % nset]], tokens, hidden, e4, None,
                                                                        "128x128")),
        ("row weight, q only (per channel, two passes)", lambda i: Q.quantize_scaled([xs[i % nset]], tokens, hidden,
                                                                                      e4, "row", None)),
    ):
        t = time_ms(fn, reps)
        rows.append({"name": name, "ms": t, "bf16_GBps": gb / (t * 1e-3)})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="M of the GEMMs (batch x sequence; default 2 x 2048)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--skip-gemms", action="store_true", help="time the quantizers only")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_scaling.py needs a CUDA device")
    m = args.tokens
    gemms = []
    for lin, n, k in ([] if args.skip_gemms else LINEARS):
        for gran in MODES:
            if gran != "block-dW-128x128":
                gemms.append(bench_gemm(f"{lin} fwd", m, n, k, gran, False, args.reps))
                gemms.append(bench_gemm(f"{lin} dX", m, k, n, gran, False, args.reps))
            gemms.append(bench_gemm(f"{lin} dW", n, k, m, gran, True, args.reps))
    quant = bench_quantize(m, 4096, args.reps)
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, commit=environment()["commit"],
               tokens=m)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(env=env, gemms=gemms, quantize=quant), indent=2))
    print(f"\n{env['device']}, torch {env['torch']}, commit {env['commit']}, M = {m} tokens\n")
    print("| GEMM | granularity | modes | coat TFLOP/s | vs tensor | torch._scaled_mm TFLOP/s | rel diff |")
    print("|---|---|---|---:|---:|---:|---:|")
    base = {r["name"]: r["coat_tflops"] for r in gemms if r["granularity"] == "tensor"}
    gemm_rows = bool(gemms)
    for r in gemms:
        smm = f"{r['scaled_mm_tflops']:.0f}" if "scaled_mm_tflops" in r else "n/a"
        d = f"{r['vs_scaled_mm_rel']:.1e}" if "vs_scaled_mm_rel" in r else r.get("scaled_mm_error", "")[:40]
        print(f"| {r['name']} | {r['granularity']} | {r['a_mode']} x {r['b_mode']} | {r['coat_tflops']:.0f} | "
              f"{r['coat_tflops'] / base[r['name']]:.2f} | {smm} | {d} |")
    if gemm_rows:
        tot = {g: sum(2.0 * r["M"] * r["N"] * r["K"] for r in gemms if r["granularity"] == g) /
               sum(r["coat_ms"] * 1e-3 for r in gemms if r["granularity"] == g) / 1e12 for g in ("tensor", "row", "block")}
        print("\nall 12 GEMMs of a layer, TFLOP/s: " + ", ".join(f"{g} {v:.0f}" for g, v in tot.items()))
    print("\n| quantizer [tokens, 4096] bf16 | ms | GB/s bf16 read |\n|---|---:|---:|")
    for r in quant:
        print(f"| {r['name']} | {r['ms']:.3f} | {r['bf16_GBps']:.0f} |")


if __name__ == "__main__":
    main()
