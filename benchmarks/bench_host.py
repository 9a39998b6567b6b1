"""Host overhead of coat: microseconds of host time per op call on tiny CUDA tensors (the kernels
take a few microseconds, so the host's work is what is timed), next to torch eager ops of the same
kind; and the host time of a whole training step.

The whole step is timed on a narrow copy of Llama-2-7B (32 layers, every op of the 7B step, hidden
256): its kernels are too small to hold the host back, so the wall time of issuing a step on an
idle GPU is the host's own work. On the 7B model itself the host cannot be timed that way once it
is ahead of the GPU by a full launch queue: it then waits for the GPU, and a host-bound and a
GPU-bound step look alike. Compare the figure with the 7B step's GPU time from bench_e2e.py.
Targets (issue 11): at most ~25 us per coat op call; host time below 60% of the GPU time.

Under torchrun the step is sharded with FSDP2 (coat.integrations.fsdp.shard, as ``bench_e2e.py
--fsdp``), once per ``--fsdp-units`` value (decoder layers per fully_shard unit); only the step
table is printed (issue 30 item 2: the host's own work in a sharded step).

    python benchmarks/bench_host.py [--out results/bench_host.json] [--setups bf16 coat coat-lean]
    torchrun --nproc-per-node 2 benchmarks/bench_host.py --fsdp-units 1 2 4 --setups coat coat-lean
"""

from __future__ import annotations

import argparse
import json
import os
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
    ap.add_argument("--setups", nargs="*", default=["bf16", "coat", "coat-lean"],
                    help="bench_e2e setups whose whole step is timed on the narrow Llama-2-7B (none: skip)")
    ap.add_argument("--fsdp-units", type=int, nargs="+", default=[1], metavar="K",
                    help="under torchrun: decoder layers per fully_shard unit, one table row per value")
    args = ap.parse_args()
    if "WORLD_SIZE" in os.environ:
        return sharded_main(args)
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
    steps = {name: step_host_ms(name, dev) for name in args.setups}
    if steps:
        print("\nhost ms per training step, Llama-2-7B ops on a narrow model (hidden 256), batch 1, sequence 2048")
        print("| setup | median | min - max of 7 |\n|---|---:|---:|")
        for name, ms in steps.items():
            print(f"| {name} | {statistics.median(ms):.1f} | {min(ms):.1f} - {max(ms):.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "host_us": table,
                       "step_host_ms": steps}, f, indent=1)


def step_host_ms(setup: str, dev: torch.device, runs: int = 7, mesh=None, unit: int = 1) -> list[float]:
    """Wall ms of issuing one whole step of ``setup`` (coat bench's own step) on an idle GPU; with
    ``mesh``, sharded by FSDP2 at ``unit`` decoder layers per unit (every rank in step)."""
    from coat import memory
    from coat.cli import bench_worker as bw

    shape = memory.ModelShape("llama2-7b-narrow", hidden=256, layers=32, heads=2, kv_heads=2, intermediate=688,
                              vocab=32000)
    s = bw.SETUPS[setup]
    model = bw.build_model(shape, s.param_dtype, dev)
    step = s.prepare(model, bw.Context(dev, mesh, layers_per_unit=unit))
    ids = torch.randint(0, shape.vocab, (1, 2048), device=dev)
    for _ in range(3):
        step(ids)
    out = []
    for _ in range(runs):
        torch.cuda.synchronize()
        if mesh is not None:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        step(ids)
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return out


def sharded_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (world,))
    rows = {(name, k): step_host_ms(name, dev, mesh=mesh, unit=k) for name in args.setups for k in args.fsdp_units}
    if rank == 0:
        print(f"\nhost ms per training step, FSDP2 over {world} GPUs ({torch.cuda.get_device_name()}), Llama-2-7B ops "
              "on a narrow model (hidden 256), batch 1, sequence 2048")
        print("| setup | layers per unit | median | min - max of 7 |\n|---|---:|---:|---:|")
        for (name, k), ms in rows.items():
            print(f"| {name} | {k} | {statistics.median(ms):.1f} | {min(ms):.1f} - {max(ms):.1f} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "world": world,
                           "step_host_ms": [{"setup": n, "layers_per_unit": k, "ms": v} for (n, k), v in rows.items()]},
                          f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
