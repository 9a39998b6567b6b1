"""Final RMSNorm + LM head + cross-entropy, forward + backward: Hugging Face's loss path (LlamaRMSNorm,
``nn.Linear`` lm_head, ``ForCausalLMLoss``) against ``coat.nn.loss.fused_lm_head_loss`` (chunked,
logits never whole), in the same run, on random data.

Default shape: Llama-3-8B (hidden 4096, vocabulary 128,256) at batch 8 x 2048 tokens, bf16 weights
(``--autocast``: fp32 weights under bf16 autocast). Reported per variant:
- peak: ``torch.cuda.max_memory_allocated`` over one forward + backward, minus what was allocated
  before it (hidden states, weights, labels), so it includes the weight gradient (and, for HF, the
  logits, which a training loop holds in the model's output until backward ends);
- saved: bytes autograd keeps for backward (saved_tensors_hooks, storages counted once, weights
  excluded); the fused path saves nothing: from its forward to its backward it holds its finished
  gradients (dW, dx) instead, which the peak counts;
- fwd+bwd ms: median of CUDA-event timings after warm-up (eager calls), and the model TFLOP/s
  this is (6 x tokens x hidden x vocab FLOPs: three GEMMs, on both paths; the fused one computes
  its gradients in the forward, so its backward is only a scaling);
- numerics against HF: loss, dX, d(norm weight), dW, as ||a - b|| / ||b||.
Variants: the fused path at each ``--chunks`` size (MiB of bf16 logits per chunk) with BF16 GEMMs,
and at the first size with FP8 gradient GEMMs (``fp8_backward=True``).

``--accuracy``: no timing; the error of an FP8 LM head (per-tensor E4M3 operands, E5M2 logit
gradient, coat's FP8 GEMM, exact CPU emulation off the GPU) against fp64, beside BF16's, at
random init and at a trained-like logit distribution (labels drawn from the model's own softmax,
loss ~2-3 nats). This is how the fused loss's precision was chosen (BF16; see docs/numerics.md).

    python benchmarks/bench_loss.py [--batch 8 --seq 2048 --hidden 4096 --vocab 128256]
        [--chunks 512,128] [--autocast] [--reps 10] [--out results.json]
    python benchmarks/bench_loss.py --accuracy [--device cpu]     # ~10 s on a CPU
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, markdown_table, time_ms, write_json  # noqa: E402

from coat.nn.loss import fused_lm_head_loss  # noqa: E402

EPS = 1e-5


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


# ---- speed and memory ------------------------------------------------------------------------------


def hf_step(x, norm, head, labels, vocab):
    """HF's LlamaForCausalLM path after the decoder: norm, lm_head, ForCausalLMLoss; returns the
    logits too, as CausalLMOutputWithPast does (the caller keeps them through backward)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits = head(norm(x))
    return ForCausalLMLoss(logits, labels, vocab), logits


def fused_step(x, norm, head, labels, chunk, fp8):
    return fused_lm_head_loss(x, head.weight, labels, norm_weight=norm.weight, eps=EPS, chunk_mib=chunk,
                              fp8_backward=fp8), None


def _median_wall_ms(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_variant(name, step, x, params, autocast, reps):
    cuda = x.is_cuda

    def once():
        for p in params:
            p.grad = None
        xi = x.detach().requires_grad_()
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss, logits = step(xi)
        loss.backward()
        return loss.detach(), xi.grad, logits

    # warm-up (cuBLAS plans, allocator pools)
    for _ in range(2):
        once()
    for p in params:
        p.grad = None
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    loss, dx, logits = once()
    peak = None
    if cuda:
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    grads = [p.grad.detach().clone() for p in params]
    del logits

    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    xi = x.detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            out = step(xi)
    del out, xi
    ms = time_ms(once, warmup=1, reps=reps, graph=False) if cuda else _median_wall_ms(once, reps)
    for p in params:
        p.grad = None
    return dict(variant=name, peak_gib=peak, saved_mib=sum(seen.values()) / 2**20, ms=ms), (loss, dx, *grads)


def bench(args):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    dev = torch.device(args.device)  # cpu: a smoke run of the script (no memory figures)
    torch.manual_seed(0)
    wdt = torch.float32 if args.autocast else torch.bfloat16
    cfg = LlamaConfig(hidden_size=args.hidden, vocab_size=args.vocab, rms_norm_eps=EPS)
    norm = LlamaRMSNorm(args.hidden, eps=cfg.rms_norm_eps).to(dev, wdt)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False).to(dev, wdt)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        head.weight.normal_(0, args.init_std)
    x = torch.randn(args.batch, args.seq, args.hidden, device=dev, dtype=wdt)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    labels[:, : args.seq // 8] = -100  # a masked prompt
    params = [norm.weight, head.weight]
    tokens = args.batch * args.seq
    model_flop = 6 * tokens * args.hidden * args.vocab

    rows, results = [], {}
    try:
        r, results["hf"] = run_variant("HF (norm, lm_head, ForCausalLMLoss)",
                                       lambda xi: hf_step(xi, norm, head, labels, args.vocab), x, params,
                                       args.autocast, args.reps)
        rows.append(r)
    except torch.OutOfMemoryError:
        rows.append(dict(variant="HF (norm, lm_head, ForCausalLMLoss)", peak_gib="OOM"))
        results["hf"] = None
    _release()
    variants = [(c, False) for c in args.chunks] + [(args.chunks[0], True)]
    for c, fp8 in variants:
        name = f"coat fused, chunk {c:g} MiB" + (", FP8 gradient GEMMs" if fp8 else "")
        r, res = run_variant(name, lambda xi, c=c, fp8=fp8: fused_step(xi, norm, head, labels, c, fp8),
                             x, params, args.autocast, args.reps)
        if results["hf"] is not None:
            ref = results["hf"]
            r.update(err_loss=f"{abs(res[0].item() - ref[0].item()) / ref[0].item():.1e}",
                     err_dx=f"{rel(res[1], ref[1]):.1e}", err_dnorm=f"{rel(res[2], ref[2]):.1e}",
                     err_dw=f"{rel(res[3], ref[3]):.1e}")
            if isinstance(rows[0].get("peak_gib"), float):
                r["peak_saved_gib"] = rows[0]["peak_gib"] - r["peak_gib"]
            r["speedup"] = rows[0]["ms"] / r["ms"]
        rows.append(r)
        _release()
    for r in rows:
        if isinstance(r.get("ms"), float):
            r["model_tflops"] = model_flop / r["ms"] / 1e9
        for k, v in list(r.items()):
            if isinstance(v, float):
                r[k] = round(v, 2)

    env = environment()
    env.update(tokens=tokens, batch=args.batch, seq=args.seq, hidden=args.hidden, vocab=args.vocab,
               weights="fp32 + bf16 autocast" if args.autocast else "bf16",
               logits_bf16_gib=round(tokens * args.vocab * 2 / 2**30, 2))
    print(f"\n{env['device']}, torch {env['torch']}, commit {env['commit']}; {tokens} tokens ({args.batch} x "
          f"{args.seq}), hidden {args.hidden}, vocab {args.vocab}, {env['weights']} weights; bf16 logits alone "
          f"would be {env['logits_bf16_gib']} GiB. Target: peak >= 8 GiB lower than HF, not slower.\n")
    cols = ["variant", "peak_gib", "peak_saved_gib", "saved_mib", "ms", "speedup", "model_tflops",
            "err_loss", "err_dx", "err_dnorm", "err_dw"]
    print(markdown_table(rows, cols))
    write_json(args.out, dict(env=env, rows=rows))


def _release():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- accuracy of an FP8 LM head --------------------------------------------------------------------


def accuracy(args):
    from coat.nn import _fp8mm as mm

    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    dev = torch.device(args.device)
    t, h, v = args.acc_tokens, args.acc_hidden, args.acc_vocab
    rows = []
    settings = [("random init (W std 0.02)", 0.02, None), ("trained-like, T=1", 0.25, 1.0),
                ("trained-like, T=0.5", 0.25, 0.5)]
    g = torch.Generator(device="cpu").manual_seed(0)
    for name, std, temp in settings:
        y = torch.randn(t, h, generator=g).to(dev, torch.bfloat16)  # the normed hidden state
        w = (torch.randn(v, h, generator=g) * std).to(dev, torch.bfloat16)
        logits64 = y.double() @ w.double().t()
        if temp is None:
            lab = torch.randint(0, v, (t,), generator=g).to(dev)
        else:  # a model that predicts its data well: labels drawn from its own distribution
            lab = torch.multinomial(torch.softmax(logits64 / temp, -1).float().cpu(), 1, generator=g).squeeze(1).to(dev)

        def grads(logits_fn, bwd_fp8):
            lg = logits_fn().float().requires_grad_()
            loss = F.cross_entropy(lg, lab)
            loss.backward()
            d = lg.grad.to(torch.bfloat16)
            if not bwd_fp8:
                return loss.item(), d.t() @ y, d @ w
            dq, dq_t, ds = mm.quantize(d.contiguous(), e5, True)
            _, y_t, ys = mm.quantize(y, e4, True)
            w_t, _, ws = mm.quantize(w.t().contiguous(), e4, False)  # the same amax, so W's scale
            return loss.item(), mm.fp8_mm(dq_t, ds, y_t, ys, torch.float32), mm.fp8_mm(dq, ds, w_t, ws, torch.float32)

        def fp8_logits():
            yq, _, ys = mm.quantize(y, e4, False)
            wq, _, ws = mm.quantize(w, e4, False)
            return mm.fp8_mm(yq, ys, wq, ws, torch.bfloat16)

        ys = y.double().requires_grad_()
        ws_ = w.double().requires_grad_()
        truth = F.cross_entropy(ys @ ws_.t(), lab)
        truth.backward()
        for variant, fn, bwd8 in (("bf16 (HF)", lambda: y @ w.t(), False), ("fp8 fwd + bwd", fp8_logits, True),
                                  ("bf16 fwd, fp8 bwd", lambda: y @ w.t(), True)):
            loss, dw, dy = grads(fn, bwd8)
            rows.append(dict(setting=name, loss=f"{truth.item():.3f}", variant=variant,
                             loss_rel_err=f"{abs(loss - truth.item()) / truth.item():.1e}",
                             dW_rel_err=f"{rel(dw, ws_.grad):.1e}", dX_rel_err=f"{rel(dy, ys.grad):.1e}"))
    env = environment()
    print(f"\nFP8 LM head accuracy on {args.device} (coat {env['commit']}): {t} tokens, hidden {h}, vocab {v}; "
          "errors against fp64. Budget: loss within 0.1 %, gradients within the other FP8 layers' error (7-15 % "
          "measured in tests/python/test_convert.py).\n")
    print(markdown_table(rows, ["setting", "loss", "variant", "loss_rel_err", "dW_rel_err", "dX_rel_err"]))
    write_json(args.out, dict(env=env, rows=rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--chunks", default="512,128", help="comma-separated chunk_mib values of the fused path")
    ap.add_argument("--autocast", action="store_true", help="fp32 weights under bf16 autocast")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--accuracy", action="store_true", help="FP8 vs BF16 LM head error instead of speed/memory")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu: --accuracy, or a smoke run of the timing (no memory figures)")
    ap.add_argument("--acc-tokens", type=int, default=256)
    ap.add_argument("--acc-hidden", type=int, default=256)
    ap.add_argument("--acc-vocab", type=int, default=8192)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    try:
        args.chunks = [float(c) for c in args.chunks.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--chunks must be comma-separated numbers, got {args.chunks!r}")
    if not args.chunks or min(args.chunks) <= 0:
        ap.error("--chunks must list positive chunk sizes in MiB")
    for name in ("batch", "seq", "hidden", "vocab", "reps", "acc_tokens", "acc_hidden", "acc_vocab"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    accuracy(args) if args.accuracy else bench(args)


if __name__ == "__main__":
    main()
