"""Host overhead of coat's op calls: microseconds of host time per call on tiny CUDA tensors (the
kernels take a few microseconds, so the host's work is what is timed), next to torch eager ops of
the same kind. Target (issue 11): at most ~25 us per coat op call.

    python benchmarks/bench_host.py [--out results/bench_host.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import coat
from coat._ops import gemm as G
from coat._ops import norm as N
from coat._ops import quantize as Q
from coat._ops import swiglu as S


def host_us(fn, calls: int = 300, rounds: int = 5) -> float:
    """Median over rounds of the host microseconds per call (the queue is drained between rounds)."""
    for _ in range(20):
        fn()
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args()
    dev = torch.device("cuda")
    x = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    w = torch.randn(64, device=dev, dtype=torch.bfloat16)
    parts = [torch.randn(64, 64, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    q8 = x.to(torch.float8_e4m3fn)
    one = torch.ones(1, device=dev)
    gu = torch.randn(64, 128, device=dev, dtype=torch.bfloat16)
    lin = coat.nn.Fp8Linear(64, 64, bias=False, device=dev, dtype=torch.bfloat16)
    ref_lin = torch.nn.Linear(64, 64, bias=False, device=dev, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()

    def lin_step(m):
        def run():
            m(xg).sum().backward()
        return run

    from coat import _C
    from coat._ops._util import stream

    st = stream(x)
    ws = torch.empty(_C.GEMM_WORKSPACE_BYTES, device=dev, dtype=torch.uint8)

    class Ident(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t

        @staticmethod
        def backward(ctx, g):
            return g

    rows = {
        "torch.empty 64x64 (cuda)": lambda: torch.empty(64, 64, device=dev),
        "_C.quantize_per_tensor_amax (binding alone)": lambda: _C.quantize_per_tensor_amax(x, 0, True, st),
        "_C.gemm_fp8 (binding alone)": lambda: _C.gemm_fp8(q8, 0, one, q8, 0, one, None, 1, None, False, ws, False,
                                                            False, st),
        "autograd.Function.apply (identity)": lambda: Ident.apply(xg),

        "coat quantize_per_tensor_amax (+transpose)": lambda: Q.quantize_per_tensor_amax(x, 0, True),
        "coat quantize_stacked_amax (3 parts)": lambda: Q.quantize_stacked_amax(parts, 0, True, False),
        "coat quantize_stacked (transposed, given scale)": lambda: Q.quantize_stacked(parts, one, 0, False, True),
        "coat fp8_gemm": lambda: G.fp8_gemm(q8, q8, one, one, None, torch.bfloat16),
        "coat rmsnorm_fwd (+FP8 1x16)": lambda: N.rmsnorm_fwd(x, w, 1e-6, True, torch.float8_e4m3fn, False),
        "coat swiglu_fwd (+FP8 1x16)": lambda: S.swiglu_fwd(gu, True, torch.float8_e4m3fn, False),
        "torch x @ x.T (bf16)": lambda: x @ x.t(),
        "torch x * 2 + 1": lambda: x * 2 + 1,
        "Fp8Linear fwd+bwd (module)": lin_step(lin),
        "nn.Linear fwd+bwd (module)": lin_step(ref_lin),
    }
    table = {name: host_us(fn) for name, fn in rows.items()}
    print(f"\nhost us per call, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| call | host us |\n|---|---:|")
    for name, us in table.items():
        print(f"| {name} | {us:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "host_us": table}, f, indent=1)


if __name__ == "__main__":
    main()
