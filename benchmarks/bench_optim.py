"""Benchmark coat.optim.AdamW (fused FP8-state step), coat.optim.AdamW4bit (4-bit states) and
coat.optim.SubsetNormSM against torch.optim.AdamW(fused=True) on the
Llama-2-7B parameter set (6.74e9 parameters: embed_tokens and lm_head 32000 x 4096; per layer
q/k/v/o 4096 x 4096, gate/up/down 11008 x 4096, two 4096 norms; a final 4096 norm).

Configurations, run one after another with memory freed in between:
  coat  bf16 params + fp32 master + bf16 grads  (COAT-faithful)
  coat  bf16 params, bf16_sr (no master) + bf16 grads
  coat  fp32 params + fp32 grads
  4bit  bf16 params + fp32 master + bf16 grads  (coat.optim.AdamW4bit)
  4bit  bf16 params, bf16_sr (no master) + bf16 grads
  4bit  the same two with v_scaling="block" (v in blocks of 128 on the matrices too: no first pass)
  torch AdamW(fused=True), fp32 params + fp32 grads   (the baseline; needs ~108 GB at full size)
  snsm  bf16 params, bf16_sr + bf16 grads  (coat.optim.SubsetNormSM: rank 128 on the matrices, FP8 AdamW
        on the embedding and norms; its first step, every projection's SVD, reported apart), with the
        full SVD (proj_type="svd") and the randomized refresh (proj_type="randomized")
For each: the step time of `--iters` steps run back to back (CUDA events around them all; the host
queues ahead as in training, so this is the GPU's time), also the median of steps timed one at a
time from an idle GPU (which adds the host's work in step()) and that host time; bytes moved per parameter
(counted from what the kernel must read and write), achieved bandwidth, the bandwidth floor from a
device-to-device copy measured in the same run, the ratio to torch, optimizer-state bytes per
parameter and the extra memory allocated during a step. A markdown table is printed last and JSON
written to --out.

    python benchmarks/bench_optim.py                 # full 7B set (H200: 139 GB)
    python benchmarks/bench_optim.py --layers 8      # fewer layers for smaller GPUs (per-param figures hold)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment  # noqa: E402

STATE_B = 2 * 2 * (1 + 5 / 128)  # m and v, read and written: codes + gmax + k16 per 128
# AdamW4bit: m and v read and written as 4-bit codes + an fp32 absmax per 128 (v of the matrices: row
# and column maxima, ~0), plus the first pass over the rank-1 tensors (nearly every parameter of this
# set), which reads the bf16 gradient and v's codes once more to find the new maxima.
STATE4_B = 2 * 2 * (0.5 + 4 / 128) + 2 + 0.5
# AdamW4bit(v_scaling="block"): both moments in blocks of 128, no first pass.
STATE4_BLOCK_B = 2 * 2 * (0.5 + 4 / 128)
# Bytes per parameter each configuration must move at least.
BYTES = {
    "coat bf16+fp32 master, bf16 grads": 2 + 8 + 2 + STATE_B,  # param write, master r/w, grad read
    "coat bf16_sr, bf16 grads": 4 + 2 + STATE_B,               # param r/w, grad read
    "coat fp32, fp32 grads": 8 + 4 + STATE_B,                  # param r/w, grad read
    "4bit bf16+fp32 master, bf16 grads": 2 + 8 + 2 + STATE4_B,
    "4bit bf16_sr, bf16 grads": 4 + 2 + STATE4_B,
    "4bit v block, bf16+fp32 master, bf16 grads": 2 + 8 + 2 + STATE4_BLOCK_B,
    "4bit v block, bf16_sr, bf16 grads": 4 + 2 + STATE4_BLOCK_B,
    "torch fused AdamW fp32": 8 + 4 + 16,                      # param r/w, grad read, fp32 m and v r/w
    # SubsetNormSM (torch ops, not a fused kernel): param r/w, grad read, its ~0.2 B/param of states
    # r/w; it moves several times more (fp32 temporaries). Its first step refreshes every projection
    # (an SVD per matrix): timed apart as first_step_s.
    "snsm bf16_sr, bf16 grads": 4 + 2 + 0.5,
    "snsm randomized, bf16_sr, bf16 grads": 4 + 2 + 0.5,
}


def llama7b_shapes(layers: int) -> list[tuple[int, ...]]:
    h, f, v = 4096, 11008, 32000
    shapes = [(v, h)]
    for _ in range(layers):
        shapes += [(h, h)] * 4 + [(f, h)] * 3 + [(h,), (h,)]
    return shapes + [(h,), (v, h)]


def copy_bandwidth(nbytes: int = 4 << 30, iters: int = 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)  # read + write


def make_params(shapes, dtype, grad_dtype):
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype) * 0.02)
        p.grad = (torch.randn(s, device="cuda", dtype=grad_dtype) * 1e-3)
        params.append(p)
    return params


def bench(name: str, shapes, warmup: int, iters: int) -> dict:
    import coat.optim as co

    if name.startswith("coat bf16+fp32"):
        params = make_params(shapes, torch.bfloat16, torch.bfloat16)
        opt = co.AdamW(params, lr=1e-4, weight_decay=0.01, master_weights="fp32")
    elif name.startswith("coat bf16_sr"):
        params = make_params(shapes, torch.bfloat16, torch.bfloat16)
        opt = co.AdamW(params, lr=1e-4, weight_decay=0.01, master_weights="bf16_sr")
    elif name.startswith("4bit"):
        params = make_params(shapes, torch.bfloat16, torch.bfloat16)
        master = "bf16_sr" if "bf16_sr" in name else "fp32"
        opt = co.AdamW4bit(params, lr=1e-4, weight_decay=0.01, master_weights=master,
                           v_scaling="block" if "v block" in name else "rank1")
    elif name.startswith("snsm"):
        params = make_params(shapes, torch.bfloat16, torch.bfloat16)
        matrices = [p for p in params[1:] if p.dim() == 2]  # params[0]: the embedding (AdamW, FP8 states)
        rest = [params[0]] + [p for p in params[1:] if p.dim() != 2]
        opt = co.SubsetNormSM([{"params": matrices}, {"params": rest, "adamw": True}], lr=1e-4, weight_decay=0.01,
                              master_weights="bf16_sr", proj_type="randomized" if "randomized" in name else "svd")
    elif name.startswith("coat fp32"):
        params = make_params(shapes, torch.float32, torch.float32)
        opt = co.AdamW(params, lr=1e-4, weight_decay=0.01)
    else:
        params = make_params(shapes, torch.float32, torch.float32)
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    n = sum(p.numel() for p in params)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.step()  # creates the states (SubsetNormSM: and refreshes every projection)
    torch.cuda.synchronize()
    first_step_s = time.perf_counter() - t0
    for _ in range(warmup - 1):
        opt.step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    # Steps one at a time, the GPU idle before each: these times include the host's work in
    # step() before the launch (host_s, timed on the host), which a training loop hides by queueing
    # ahead.
    times, host = [], []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        opt.step()
        host.append(time.perf_counter() - t0)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    # Steps back to back (the host queues ahead, as in training): the GPU time of a step.
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        opt.step()
    b.record()
    b.synchronize()
    step_s = a.elapsed_time(b) / 1e3 / iters
    peak_extra = torch.cuda.max_memory_allocated() - base
    state = [t for s in opt.state.values() for k, t in s.items() if isinstance(t, torch.Tensor) and k != "step"]
    moments = sum(t.numel() * t.element_size() for t, k in
                  ((t, k) for s in opt.state.values() for k, t in s.items()) if k.startswith("exp_avg"))
    if name.startswith("snsm"):  # the AdamW part's states live in the inner optimizer
        inner = [t for s in opt.adamw.state.values() for k, t in s.items() if isinstance(t, torch.Tensor) and k != "step"]
        state += inner
    res = {"config": name, "params": n, "step_s": step_s, "first_step_s": first_step_s,
           "step_s_synced": statistics.median(times),
           "step_s_synced_min": min(times), "host_s": statistics.median(host),
           "bytes_per_param": BYTES[name], "state_bytes_per_param": sum(t.numel() * t.element_size() for t in state) / n,
           "moment_bytes_per_param": moments / n, "step_peak_extra_bytes": peak_extra,
           "total_allocated_gb": base / 1e9}
    del opt, params, state
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (32: Llama-2-7B)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip-torch", action="store_true", help="skip the torch baseline (it needs 16 B/param)")
    ap.add_argument("--skip-snsm", action="store_true", help="skip SubsetNormSM (its first step runs an SVD per "
                    "matrix: minutes at 32 layers)")
    ap.add_argument("--out", default="bench_optim.json")
    args = ap.parse_args()

    shapes = llama7b_shapes(args.layers)
    bw = copy_bandwidth()
    names = [k for k in BYTES if not (args.skip_torch and k.startswith("torch"))
             and not (args.skip_snsm and k.startswith("snsm"))]
    rows = []
    for name in names:
        r = bench(name, shapes, args.warmup, args.iters)
        r["achieved_bw"] = r["bytes_per_param"] * r["params"] / r["step_s"]
        r["floor_s"] = r["bytes_per_param"] * r["params"] / bw
        r["vs_floor"] = r["step_s"] / r["floor_s"]
        rows.append(r)
        print(f"{name}: {r['step_s'] * 1e3:.2f} ms ({r['vs_floor']:.2f}x floor); one at a time "
              f"{r['step_s_synced'] * 1e3:.2f} ms, host {r['host_s'] * 1e3:.2f} ms; first step "
              f"{r['first_step_s']:.2f} s", flush=True)
    torch_row = next((r for r in rows if r["config"].startswith("torch")), None)
    for r in rows:
        r["speedup_vs_torch_fused"] = torch_row["step_s"] / r["step_s"] if torch_row else None

    commit = environment()["commit"]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit,
            "layers": args.layers, "params": rows[0]["params"], "copy_bw_Bps": bw}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)

    print(f"\n{meta['device']}, torch {meta['torch']}, commit {commit}, {meta['params'] / 1e9:.3f}e9 params "
          f"({args.layers} layers), copy bandwidth {bw / 1e12:.2f} TB/s\n")
    print("| config | step (ms) | B/param moved | achieved TB/s | of copy BW | floor (ms) | vs torch fused "
          "| state B/param (moments) | step extra mem (MB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sp = f"{r['speedup_vs_torch_fused']:.2f}x" if r["speedup_vs_torch_fused"] else "-"
        print(f"| {r['config']} | {r['step_s'] * 1e3:.2f} | {r['bytes_per_param']:.2f} | {r['achieved_bw'] / 1e12:.2f} "
              f"| {r['achieved_bw'] / bw:.0%} | {r['floor_s'] * 1e3:.2f} | {sp} "
              f"| {r['state_bytes_per_param']:.2f} ({r['moment_bytes_per_param']:.3f}) "
              f"| {r['step_peak_extra_bytes'] / 1e6:.1f} |")


if __name__ == "__main__":
    main()
