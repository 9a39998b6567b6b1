"""Where the time of a sharded (FSDP2) training step goes, on the GPU: torch.profiler over two steps of
coat bench's own step (a random-init model built as ``bench_e2e.py --fsdp`` builds it). Rank 0 prints
the wall time per step, how much of it some kernel ran (GPU busy) and some non-NCCL kernel ran
(compute busy: the rest is the compute stream waiting for a collective, or the host), kernel time
by class (streams summed: NCCL runs beside compute), and torch's tables by GPU and by host time.

    torchrun --nproc-per-node 2 benchmarks/profile_fsdp.py MODEL SETUP BATCH LAYERS_PER_UNIT [fp8-all-gather]
    torchrun --nproc-per-node 2 benchmarks/profile_fsdp.py llama2-70b coat4bit-lean+release 1 1
"""
import collections
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from coat import memory
from coat.cli import bench_worker as bw
from coat.integrations import fsdp

if len(sys.argv) not in (5, 6) or sys.argv[5:] not in ([], ["fp8-all-gather"]):
    sys.exit(__doc__)
model_name, setup, batch, unit = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
fp8_all_gather = sys.argv[5:] == ["fp8-all-gather"]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank); dev = torch.device("cuda", rank)
dist.init_process_group("nccl"); mesh = init_device_mesh("cuda", (world,))
shape = memory.load_shape(model_name); s = bw.SETUPS[setup]
with fsdp.matrices_on_meta():
    model = bw.build_model(shape, s.param_dtype, dev)
step = s.prepare(model, bw.Context(dev, mesh, layers_per_unit=unit, fp8_all_gather=fp8_all_gather))
ids = torch.randint(0, shape.vocab, (batch, 2048), device=dev)
for _ in range(3): step(ids)
torch.cuda.synchronize(); dist.barrier()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    t0 = time.perf_counter()
    for _ in range(2): step(ids)
    torch.cuda.synchronize(); wall = (time.perf_counter() - t0) / 2 * 1e3
if rank == 0:
    evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
    def cls(n):
        n = n.lower()
        if "nccl" in n: return "nccl"
        if "adamw4" in n or "adamw" in n: return "optimizer"
        if "gemm" in n or "xmma" in n or "cutlass" in n or "sm90" in n or "nvjet" in n: return "gemm"
        if "flash" in n or "fmha" in n or "attention" in n or "sdpa" in n: return "attention"
        if "quant" in n or "fp8" in n: return "quantize"
        if "copy" in n or "memcpy" in n or "cat" in n or "split" in n or "memset" in n: return "copy"
        return "other"
    by = collections.Counter(); busy = []; comp = []
    for e in evs:
        by[cls(e.name)] += e.time_range.elapsed_us()
        busy.append((e.time_range.start, e.time_range.end))
        if cls(e.name) != "nccl": comp.append((e.time_range.start, e.time_range.end))
    def union(iv):
        iv.sort(); tot = 0; cs = ce = None
        for a, b in iv:
            if cs is None or a > ce:
                if cs is not None: tot += ce - cs
                cs, ce = a, b
            else: ce = max(ce, b)
        return tot + (ce - cs if cs is not None else 0)
    print(f"{model_name} {setup} batch {batch} unit {unit}{' fp8-all-gather' if fp8_all_gather else ''}: wall {wall:.1f} ms/step; GPU busy (any kernel) "
          f"{union(busy)/2e3:.1f} ms/step; compute (non-NCCL) busy {union(comp)/2e3:.1f} ms/step")
    for k, v in by.most_common(): print(f"  {k:10s} {v/2e3:9.1f} ms/step (kernel time, streams summed)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)[:6000])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)[:6000])
dist.barrier(); dist.destroy_process_group()
