"""One Llama-2-7B decoder layer: Hugging Face LlamaDecoderLayer (SDPA, bf16) vs the same layer
after ``coat.convert`` (FP8 GEMMs, FP8 saved activations), in the same run.

Shapes: hidden 4096, intermediate 11008, 32 heads (MHA), batch 4 x 2048 tokens, bf16 weights.
Reported per variant:
- saved activations in U (U = tokens x hidden x 2 bytes), two ways: (a) every tensor autograd
  keeps, caught with saved_tensors_hooks, counted by the storage it keeps alive (views of one
  buffer count once; parameters and coat's cached FP8 weights are excluded: they are not
  activations), and (b) the growth of torch.cuda.memory_allocated over the forward, minus the
  output;
- forward, backward and forward+backward time: median of CUDA-event timings after warm-up;
- numerics: ||a - b|| / ||b|| of the output, dX and the weight gradients against the HF layer.
The FP8 weight copies are made once (first call) and reused, as within one optimizer step.

    python benchmarks/bench_layer.py [--batch 4] [--seq 2048] [--reps 20] [--out results.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment  # noqa: E402

import coat


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def saved_bytes(fn, params) -> int:
    """Bytes of the storages autograd keeps for backward during fn(), parameters excluded."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def median_ms(fn, reps, pre=None) -> float:
    times = []
    for _ in range(reps):
        if pre is not None:
            pre()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def bench(name, layer, x, dy, pe, pos, reps):
    params = list(layer.parameters())
    u = x.numel() * 2

    def fwd(inp):
        return layer(inp, position_embeddings=pe, position_ids=pos)

    def clear():
        for p in params:
            p.grad = None

    # warm-up (also builds coat's FP8 weight cache and cuBLASLt plans)
    for _ in range(3):
        xi = x.detach().requires_grad_()
        fwd(xi).backward(dy)
        clear()
    torch.cuda.synchronize()

    xi = x.detach().requires_grad_()
    hooked, out = saved_bytes(lambda: fwd(xi), params)
    del out
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = fwd(xi)
    torch.cuda.synchronize()
    delta = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
    del out

    def fwd_only():
        with torch.no_grad():
            fwd(x)

    state = {}

    def make_graph():
        clear()
        state["x"] = x.detach().requires_grad_()
        state["y"] = fwd(state["x"])
        torch.cuda.synchronize()

    def run_bwd():
        state["y"].backward(dy)

    def run_both():
        clear()
        xi = x.detach().requires_grad_()
        fwd(xi).backward(dy)

    t_fwd = median_ms(lambda: fwd(x.detach().requires_grad_()), reps)
    t_fwd_nograd = median_ms(fwd_only, reps)
    t_bwd = median_ms(run_bwd, reps, pre=make_graph)
    t_tot = median_ms(run_both, reps)

    clear()
    xi = x.detach().requires_grad_()
    y = fwd(xi)
    y.backward(dy)
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
    return dict(name=name, saved_U_hooks=hooked / u, saved_U_alloc=delta / u, fwd_ms=t_fwd,
                fwd_nograd_ms=t_fwd_nograd, bwd_ms=t_bwd, total_ms=t_tot), y.detach(), xi.grad.detach(), grads


def build(batch: int, seq: int, hidden: int, intermediate: int, heads: int):
    """(HF bf16 LlamaDecoderLayer on CUDA, x, dY, position embeddings, position ids), seeded."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                      num_key_value_heads=heads, max_position_embeddings=max(4096, seq))
    cfg._attn_implementation = "sdpa"
    dev = torch.device("cuda")
    hf = LlamaDecoderLayer(cfg, 0).to(dev, torch.bfloat16)
    with torch.no_grad():  # HF init leaves linears at nn.Linear defaults; use the LM's std 0.02
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    rope = LlamaRotaryEmbedding(cfg).to(dev)
    x = torch.randn(batch, seq, hidden, device=dev, dtype=torch.bfloat16)
    dy = torch.randn_like(x) * 1e-2
    pos = torch.arange(seq, device=dev)[None]
    return hf, x, dy, rope(x, pos), pos


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_layer.py needs a CUDA device")
    hf, x, dy, pe, pos = build(args.batch, args.seq, args.hidden, args.intermediate, args.heads)

    rows = []
    r, y_ref, dx_ref, g_ref = bench("HF LlamaDecoderLayer bf16 (SDPA)", hf, x, dy, pe, pos, args.reps)
    rows.append(r)
    # The layer blocks run coat's GEMM inside the block op: no torch._scaled_mm variant.
    # (Group scaling on and off: benchmarks/bench_group_scaling.py, whose alternating rounds resolve
    # a difference these single medians do not.)
    variants = [("coat fp8 (fp32 group scales)", "fp8"), ("coat fp8 (e8m0 group scales)", "fp8-e8m0")]
    if torch.cuda.get_device_capability() == (9, 0):  # row and block scaling: sm_90 only
        variants += [("coat fp8, row scaling", coat.Fp8Recipe(granularity="row")),
                     ("coat fp8, block scaling (1x128, 128x128)", coat.Fp8Recipe(granularity="block"))]
    for name, recipe in variants:
        coat.nn.invalidate_weight_cache()
        layer = coat.convert(copy.deepcopy(hf), recipe=recipe)
        r, y, dx, g = bench(name, layer, x, dy, pe, pos, args.reps)
        r.update(err_out=rel(y, y_ref), err_dx=rel(dx, dx_ref),
                 err_dw_max=max(rel(g[n], g_ref[n]) for n in g_ref), speedup=rows[0]["total_ms"] / r["total_ms"])
        r["err_dw"] = {n: rel(g[n], g_ref[n]) for n in g_ref}
        rows.append(r)
        del layer
        torch.cuda.empty_cache()

    commit = environment()["commit"]
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, commit=commit,
               batch=args.batch, seq=args.seq, hidden=args.hidden, intermediate=args.intermediate, heads=args.heads,
               U_bytes=x.numel() * 2)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=2)
    print(f"\n{env['device']}, torch {env['torch']}, commit {commit}; tokens {args.batch}x{args.seq}, hidden "
          f"{args.hidden}, intermediate {args.intermediate}, {args.heads} heads. Targets: <= 10 U saved, "
          f">= 1.5x faster fwd+bwd than HF bf16.\n")
    print("| variant | saved U (hooks) | saved U (alloc) | fwd ms | fwd no-grad ms | bwd ms | fwd+bwd ms | speed-up "
          "| err out | err dX | max err dW |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        e = (f"{r['err_out']:.4f} | {r['err_dx']:.4f} | {r['err_dw_max']:.4f}" if "err_out" in r else "- | - | -")
        print(f"| {r['name']} | {r['saved_U_hooks']:.2f} | {r['saved_U_alloc']:.2f} | {r['fwd_ms']:.2f} | "
              f"{r['fwd_nograd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['total_ms']:.2f} | "
              f"{r.get('speedup', 1.0):.2f}x | {e} |")


if __name__ == "__main__":
    main()
