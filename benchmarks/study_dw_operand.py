"""Which operand should a projection's weight-gradient GEMM read? (issue 24 item 7)

The forward GEMM of a fused block reads the per-tensor E4M3 copy of its input Y (the RMSNorm
output for q/k/v and gate/up, the SwiGLU output for down, the attention output for o). The
backward's dW = dY^T Y GEMM reads, for the blocks with a pre-op, a different operand: Y rebuilt
from the op's saved 1x16-group E4M3 input (``rmsnorm_fwd_fp8`` / ``swiglu_bwd``), then quantized
per tensor again (two roundings instead of one). o_proj saves its forward operand itself.

For each projection of one synthetic Llama decoder layer this computes dW three ways, with the
same bf16 output gradient dY (from an fp32 backward through the layer):
  ref      dY^T Y in fp32 from the bf16 operands (what BF16 training computes, up to order)
  current  coat's path: E5M2 dY (per tensor) x E4M3 of Y recomputed from the 1x16 copy
  fwd-op   E5M2 dY x the forward's own per-tensor E4M3 copy of Y
and reports ||dW - ref|| / ||ref|| (over the whole matrix, and the median over input channels of
each column's ratio, which outlier channels cannot dominate), plus two parts of it: the operand's own error
||Y~ - Y|| / ||Y|| and the error of E5M2 dY alone (exact Y). Every FP8 step is coat's own op
(coat._ops, coat.nn._fp8mm); the first seed of each configuration also checks that "current"
equals the weight gradient of the real blocks (coat.nn.fused.norm_linear, coat.nn.mlp.swiglu_down)
bit for bit on the CPU (the single-op path, which block.cpp's one-call path matches bit for bit).

Activations (--profile): "gaussian": N(0,1) residual stream, norm weights 1, random weights;
"llm": LLM-like statistics: per-token scales (lognormal), a few residual channels ~20x the rest,
one "attention sink" token with two channels at ~400, norm weights |1 + 0.2 N|, and a few
intermediate channels whose gate/up weights read the outlier channels (massive down_proj inputs).
Output gradients: N(0,1) at the layer's output with lognormal per-token scales, carried back
through the layer in fp32. No RoPE (it does not change the GEMM operands' statistics).

    python benchmarks/study_dw_operand.py [--shapes 1024x1024x2816,2048x2048x5632] [--seeds 3]
        [--profiles gaussian,llm] [--act-scale fp32|e8m0] [--device cpu|cuda] [--out f.json]

Shapes are TOKENSxHIDDENxINTERMEDIATE. On the CPU the FP8 codes are bit-identical to the GPU's
and the GEMMs accumulate in fp32 (other order), so the errors carry over.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import environment  # noqa: E402

from coat._ops import norm as nops  # noqa: E402
from coat._ops import swiglu as sops  # noqa: E402
from coat.nn import _fp8mm as mm  # noqa: E402
from coat.nn.fused import norm_linear  # noqa: E402
from coat.nn.mlp import swiglu_down  # noqa: E402
from coat.nn.norm import hf_rms_norm  # noqa: E402
from coat.nn.recipe import DEFAULT, Fp8Recipe  # noqa: E402

ACT_DTYPE, GRAD_DTYPE = DEFAULT.act_dtype, DEFAULT.grad_dtype

BF16 = torch.bfloat16
EPS = 1e-5
HEAD_DIM = 128
PROJ = ("qkv", "o", "gate_up", "down")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def col_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The median over input channels k of ||a[:, k] - b[:, k]|| / ||b[:, k]||: every channel's weights
    count alike (Adam normalizes each element), where the global ratio sees only the largest."""
    a, b = a.double(), b.double()
    return ((a - b).norm(dim=0) / b.norm(dim=0)).median().item()


def deq(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s


# ---- a synthetic decoder layer: its GEMM inputs (bf16) and output gradients (bf16) ---------------

def make_layer(t: int, h: int, inter: int, profile: str, gen: torch.Generator, dev: str) -> dict:
    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dev)

    llm = profile == "llm"
    x = randn(t, h)
    if llm:
        x = x * torch.exp(0.25 * randn(t, 1))
        n_out = max(2, h // 512)
        ch = torch.randperm(h, generator=gen)[:n_out].to(dev)
        sign = torch.where(randn(n_out) > 0, 1.0, -1.0)
        x[:, ch] = sign * (20 + 5 * randn(t, n_out))
        x[0, ch[:2]] = sign[:2] * 400.0  # an attention-sink token
        w1, w2 = (1 + 0.2 * randn(h)).abs(), (1 + 0.2 * randn(h)).abs()
    else:
        w1, w2 = torch.ones(h, device=dev), torch.ones(h, device=dev)
    w_qkv = randn(3 * h, h) / math.sqrt(h)
    w_o = randn(h, h) / math.sqrt(h)
    w_gu = randn(2 * inter, h) / math.sqrt(h)
    w_d = randn(h, inter) / math.sqrt(inter)
    if llm:  # a few intermediate channels driven by the outlier channels: massive down_proj inputs
        rows = torch.randperm(inter, generator=gen)[: max(2, inter // 1024)].to(dev)
        for r in (rows, rows + inter):
            w_gu[r[:, None], ch[None, :]] += 0.3 * sign
    x, w1, w2 = x.to(BF16), w1.to(BF16), w2.to(BF16)
    w_qkv, w_o, w_gu, w_d = (w.to(BF16) for w in (w_qkv, w_o, w_gu, w_d))

    # Forward as the converted layer computes it (bf16 activations, coat's norm and SwiGLU ops).
    y1, rstd1, xq1, xs1 = nops.rmsnorm_fwd(x, w1, EPS, True, ACT_DTYPE, ARGS.e8m0)
    qkv = (y1.float() @ w_qkv.float().t()).requires_grad_()
    heads = h // HEAD_DIM
    with torch.enable_grad():
        q, k, v = (z.view(t, heads, HEAD_DIM).transpose(0, 1) for z in qkv.split(h, -1))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(t, h)
    a = att.detach().to(BF16)
    o = a.float() @ w_o.float().t()
    x2 = (x.float() + o).to(BF16)
    y2, rstd2, xq2, xs2 = nops.rmsnorm_fwd(x2, w2, EPS, True, ACT_DTYPE, ARGS.e8m0)
    gu = (y2.float() @ w_gu.float().t()).to(BF16)
    hh, guq, gus = sops.swiglu_fwd(gu, True, ACT_DTYPE, ARGS.e8m0)

    # Backward in fp32 from a lognormal-per-token output gradient.
    dout = (randn(t, h) * torch.exp(0.5 * randn(t, 1)) * 1e-3).to(BF16)
    dh = dout.float() @ w_d.float()
    with torch.enable_grad():
        gur = gu.float().requires_grad_()
        g, u = gur.chunk(2, -1)
        (dgu,) = torch.autograd.grad(F.silu(g) * u, gur, dh)
        dy2 = dgu.to(BF16).float() @ w_gu.float()
        x2r, w2r = x2.float().requires_grad_(), w2.float()
        (dx2n,) = torch.autograd.grad(hf_rms_norm(x2r, w2r, EPS), x2r, dy2)
    dx2 = dout.float() + dx2n
    da = dx2.to(BF16).float() @ w_o.float()
    with torch.enable_grad():
        (dqkv,) = torch.autograd.grad(att, qkv, da.to(BF16).float())
    return {
        "x": x, "w1": w1, "x2": x2, "w2": w2, "gu": gu,
        "weights": {"qkv": w_qkv, "o": w_o, "gate_up": w_gu, "down": w_d},
        "y": {"qkv": y1, "o": a, "gate_up": y2, "down": hh},
        "dy": {"qkv": dqkv.to(BF16), "o": dx2.to(BF16), "gate_up": dgu.to(BF16), "down": dout},
        "saved": {"qkv": (xq1, xs1, rstd1, w1), "gate_up": (xq2, xs2, rstd2, w2), "down": (guq, gus)},
    }


def recomputed_operand(layer: dict, p: str) -> torch.Tensor:
    """The dW GEMM input as coat's backward rebuilds it (before its per-tensor quantization)."""
    if p == "o":
        return layer["y"]["o"]  # saved as the forward's own FP8 copy: nothing is rebuilt
    if p == "down":
        guq, gus = layer["saved"]["down"]
        dh = torch.zeros(guq.shape[0], guq.shape[1] // 2, dtype=BF16, device=guq.device)  # h does not read dh
        return sops.swiglu_bwd(guq, gus, dh, True)[1]
    xq, xs, rstd, w = layer["saved"][p]
    return nops.rmsnorm_fwd_fp8(xq, xs, rstd, w, BF16)


def measure(layer: dict) -> dict:
    out = {}
    for p in PROJ:
        y, dy = layer["y"][p], layer["dy"][p]
        ref = dy.float().t() @ y.float()
        dq, dq_t, ds = mm.quantize(dy, GRAD_DTYPE, True)
        yq_f, yq_f_t, ys_f = mm.quantize(y, ACT_DTYPE, True)  # the forward GEMM's operand
        if p == "o":
            yq_b, yq_b_t, ys_b = yq_f, yq_f_t, ys_f
        else:
            yq_b, yq_b_t, ys_b = mm.quantize(recomputed_operand(layer, p), ACT_DTYPE, True)
        dw_cur = mm.fp8_mm(dq_t, ds, yq_b_t, ys_b, torch.float32)
        dw_fwd = mm.fp8_mm(dq_t, ds, yq_f_t, ys_f, torch.float32)
        out[p] = {
            "current": rel(dw_cur, ref), "fwd_op": rel(dw_fwd, ref),
            "chan_current": col_rel(dw_cur, ref), "chan_fwd_op": col_rel(dw_fwd, ref),
            "y_err_current": rel(deq(yq_b, ys_b), y.float()), "y_err_fwd_op": rel(deq(yq_f, ys_f), y.float()),
            "dy_e5m2_only": rel(deq(dq_t, ds) @ y.float(), ref),
            "cur_vs_fwd": rel(dw_cur, dw_fwd), "_dw_cur": dw_cur,
        }
    return out


def check_against_blocks(layer: dict, res: dict) -> None:
    """'current' must be the real blocks' weight gradient (CPU single-op path), bit for bit."""
    rec = Fp8Recipe(act_scale="e8m0" if ARGS.e8m0 else "fp32")
    h = layer["x"].shape[1]
    for p, norm_in, norm_w in (("qkv", "x", "w1"), ("gate_up", "x2", "w2"), ("o", None, None)):
        w = layer["weights"][p].float().requires_grad_()
        x = layer["y"]["o"] if p == "o" else layer[norm_in]
        parts = list(w.split(h, 0)) if p == "qkv" else list(w.split(w.shape[0] // 2, 0)) if p == "gate_up" else [w]
        y = norm_linear(x, None if p == "o" else layer[norm_w], 0.0 if p == "o" else EPS, parts, [], rec)
        y.backward(layer["dy"][p])
        assert torch.equal(w.grad, res[p]["_dw_cur"]), f"{p}: the study's dW differs from the block's"
    w = layer["weights"]["down"].float().requires_grad_()
    swiglu_down(layer["gu"], w, None, rec).backward(layer["dy"]["down"])
    assert torch.equal(w.grad, res["down"]["_dw_cur"]), "down: the study's dW differs from the block's"


def summarize(vals: list[float]) -> str:
    m = statistics.mean(vals)
    return f"{m:.4f} ± {statistics.stdev(vals):.4f}" if len(vals) > 1 else f"{m:.4f}"


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_grad_enabled(False)
    rows = []
    for shape in ARGS.shapes.split(","):
        t, h, inter = (int(z) for z in shape.split("x"))
        for profile in ARGS.profiles.split(","):
            per_seed = []
            t0 = time.perf_counter()
            for seed in range(ARGS.seeds):
                gen = torch.Generator().manual_seed(seed)
                layer = make_layer(t, h, inter, profile, gen, ARGS.device)
                res = measure(layer)
                if seed == 0 and not ARGS.no_check:
                    with torch.enable_grad():
                        check_against_blocks(layer, res)
                per_seed.append(res)
            secs = time.perf_counter() - t0
            for p in PROJ:
                row = {"shape": shape, "profile": profile, "proj": p}
                for key in ("current", "fwd_op", "chan_current", "chan_fwd_op", "y_err_current", "y_err_fwd_op",
                            "dy_e5m2_only", "cur_vs_fwd"):
                    row[key] = [r[p][key] for r in per_seed]
                row["ratio"] = [r[p]["current"] / r[p]["fwd_op"] for r in per_seed]
                rows.append(row)
            print(f"# {shape} {profile}: {ARGS.seeds} seeds in {secs:.0f} s", file=sys.stderr)
    cols = ("current", "fwd_op", "ratio", "chan_current", "chan_fwd_op", "y_err_current", "y_err_fwd_op",
            "dy_e5m2_only")
    print("| shape TxHxI | profile | proj | dW err current | dW err fwd-op | current / fwd-op "
          "| per-channel median current | per-channel median fwd-op | Y err current | Y err fwd-op "
          "| dW err E5M2 dY alone |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['profile']} | {r['proj']} | " + " | ".join(summarize(r[c]) for c in cols) + " |")
    if ARGS.out:
        Path(ARGS.out).write_text(json.dumps({"args": vars(ARGS), "env": environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1024x1024x2816,2048x2048x5632")
    ap.add_argument("--profiles", default="gaussian,llm")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--act-scale", choices=("fp32", "e8m0"), default="fp32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-check", action="store_true", help="skip the bit-exact check against the real blocks")
    ap.add_argument("--out", default=None)
    ARGS = ap.parse_args()
    ARGS.e8m0 = ARGS.act_scale == "e8m0"
    main()
