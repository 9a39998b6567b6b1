"""The FP8 block layer (coat.nn.block over the block op, csrc/bindings/block.cpp) against an
independent reference made of the single ops (quantize, RMSNorm, SwiGLU, FP8 GEMM), bit for bit:
outputs, saved tensors and gradients.

CPU: the binding for each pre-op, weight source and odd shape; the layers (norm + linear, plain
linear, SwiGLU + down, the torch pre-ops of widths without an FP8 kernel). GPU: the same layers on
CUDA, on shapes cuBLASLt takes as they are and on shapes the block pads, against the reference
whose GEMMs pad as coat's layers always have (coat.nn._fp8mm.fp8_mm)."""

import pytest
import torch

from coat import _C
from coat._ops import block as blk
from coat._ops import gemm as gops
from coat._ops import norm as nops
from coat._ops import quantize as qops
from coat._ops import swiglu as sops
from coat._ops.enums import DTYPE_IDS, NORM_KINDS
from coat.nn import _fp8mm as mm
from coat.nn import weights as W
from coat.nn.block import gated
from coat.nn.fused import norm_linear
from coat.nn.mlp import swiglu_down
from coat.nn.norm import hf_rms_norm
from coat.nn.recipe import resolve

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
U8 = torch.uint8
F32 = DTYPE_IDS[torch.float32]


def _bits(t):
    return t.view(U8) if t.dtype in (E4, E5, U8) else t.contiguous().view({1: U8, 2: torch.int16, 4: torch.int32,
                                                                           8: torch.int64}[t.element_size()])


def _same(a, b, what):
    """Equal values, or (NaN included) the same bits."""
    assert a.shape == b.shape and (torch.equal(_bits(a), _bits(b)) or (a.dtype == b.dtype and torch.equal(a, b))), what


def _inputs(gen, pre, m=20, k=32, rows=(16, 8, 8), dtype=torch.bfloat16):
    x = torch.randn(m, 2 * k if pre == blk.SWIGLU else k, generator=gen).to(dtype)
    nw = (torch.rand(k, generator=gen) + 0.5).to(dtype)
    ws = [(torch.randn(r, k, generator=gen) / k**0.5).to(dtype) for r in rows]
    return x, nw, ws


def _mm(a, sa, b, sb, dt, fast_accum=False):
    """The reference FP8 GEMM: the single op on the CPU (its reference takes every shape), on CUDA
    coat's layers' GEMM of the LM head (pads K and N to 16, fp16 through fp32). ``fast_accum``:
    Hopper's faster accumulation, which the recipe's forward GEMMs use (results differ once K
    spans several MMA steps)."""
    if a.is_cuda:
        return mm.fp8_mm(a, sa, b, sb, dt, fast_accum)
    out = gops.fp8_gemm(a, b, sa, sb, None, torch.float32 if dt == torch.float16 else dt, fast_accum)
    return out.to(dt)


def _steps_fwd(x, pre, nw, ws, save_t, out_dtype=torch.float32, unit_offset=False, act=sops.SILU,
               fast_accum=False):
    """The forward op by op: (out, w_scale, saved, gemm input, its scale)."""
    if pre == blk.NORM:
        y, rstd, xq, xs = nops.rmsnorm_fwd(x, nw, 1e-5, True, E4, False, unit_offset)
        saved = (xq, xs, rstd)
    elif pre == blk.SWIGLU:
        y, q, s = sops.swiglu_fwd(x, True, E4, False, act)
        saved = (q, s, None)
    else:
        y = x
    q, q_t, s, _ = qops.quantize_per_tensor_amax(y, 0, pre == blk.NONE and save_t)
    if pre == blk.NONE:
        saved = (q_t if save_t else None, s, None)
    wq, _, w_scale = qops.quantize_stacked_amax(ws, 0, True, False)
    out = _mm(q.view(E4), s, wq.view(E4), w_scale, out_dtype, fast_accum)
    return out, w_scale, saved, y, s


def _steps_bwd(d, pre, need_w, nw, ws, w_scale, saved, y_dtype, unit_offset=False, act=sops.SILU,
               wgrad_dtype=torch.float32, wgrad_input=None, grad_fp8=E5):
    """The backward op by op: (dx, dnorm, dw); ``grad_fp8``: the output gradient's format."""
    dq, dq_t, ds, _ = qops.quantize_per_tensor_amax(d, 1 if grad_fp8 == E5 else 0, need_w)
    _, w_t = qops.quantize_stacked(ws, w_scale, 0, False, True)
    dy = _mm(dq.view(grad_fp8), ds, w_t.view(E4), w_scale, d.dtype)

    def wgrad_of(y):
        _, y_t, ys, _ = qops.quantize_per_tensor_amax(y, 0, True)
        return _mm(dq_t.view(grad_fp8), ds, y_t.view(E4), ys, wgrad_dtype)

    dw = dnorm = None
    if pre == blk.NORM:
        if need_w:
            dw = wgrad_of(nops.rmsnorm_fwd_fp8(*saved, nw, y_dtype, unit_offset))
        dx, dnorm = nops.rmsnorm_bwd(*saved, nw, dy, unit_offset)
    elif pre == blk.SWIGLU:
        dx, h = sops.swiglu_bwd(*saved[:2], dy, need_w, act)
        if need_w:
            dw = wgrad_of(h)
    else:
        if need_w:
            dw = wgrad_of(wgrad_input) if wgrad_input is not None else _mm(dq_t.view(grad_fp8), ds,
                                                                            saved[0].view(E4), saved[1], wgrad_dtype)
        dx = dy
    return dx, dnorm, dw


def _same_saved(got, ref_saved, what="saved"):
    for i, r in enumerate(ref_saved):
        assert (got[i] is None) == (r is None), f"{what}[{i}]"
        if r is not None:
            _same(got[i], r, f"{what}[{i}]")


def _scribble(x):
    """On CUDA, reuse the small blocks the block op freed: an output still pointing there reads NaN."""
    if x.is_cuda:
        _ = [torch.full((n,), float("nan"), device=x.device) for n in (128, 512, 2048) for _ in range(4)]


def _check_block(x, pre, nw, ws, need_w, d, uo=False, act=sops.SILU, out_dtype=torch.float32, stats=False):
    """blk.forward / blk.backward (the custom ops) against the single ops, bit for bit."""
    norm = nw if pre == blk.NORM else None
    f = blk.forward(x, pre, norm, 1e-5, False, ws, None, None, need_w, out_dtype, False, uo, act, stats)
    _scribble(x)
    ref_out, ref_scale, ref_saved, ref_y, ref_ys = _steps_fwd(x, pre, nw, ws, need_w, out_dtype, uo, act)
    _same(f.out, ref_out, "out")
    _same(f.w_scale, ref_scale, "w_scale")
    _same_saved(f.saved, ref_saved)
    if stats and pre != blk.NONE:
        _same(f.stat_in, ref_y, "stat_in")
        _same(f.stat_scale, ref_ys, "stat_scale")
    else:
        assert f.stat_in is None and f.stat_scale is None
    b = blk.backward(d, pre, need_w, ws, f.w_scale, None, f.saved, norm, None, x.dtype, torch.float32, uo, act, stats)
    _scribble(x)
    rdx, rdnorm, rdw = _steps_bwd(d, pre, need_w, nw, ws, ref_scale, ref_saved, x.dtype, uo, act)
    _same(b.dx, rdx, "dx")
    assert (b.dnorm is None) == (rdnorm is None) and (b.dw is None) == (not need_w)
    for got, want, what in ((b.dnorm, rdnorm, "dnorm"), (b.dw, rdw, "dw")):
        if got is not None:
            _same(got, want, what)
    _same(b.d_scale, qops.quantize_per_tensor_amax(d, 1, False)[2], "d_scale")
    assert (b.stat_scale is not None) == (stats and need_w and pre != blk.NONE)
    return f, b


@pytest.mark.parametrize("pre", [blk.NONE, blk.NORM, blk.SWIGLU])
@pytest.mark.parametrize("need_w", [True, False])
@pytest.mark.parametrize("stats", [False, True])
def test_block_op_matches_single_ops_cpu(gen, pre, need_w, stats):
    rows = (24,) if pre == blk.SWIGLU else (16, 8, 8)
    x, nw, ws = _inputs(gen, pre, rows=rows)
    d = torch.randn(x.shape[0], sum(rows), generator=gen).bfloat16()
    _check_block(x, pre, nw, ws, need_w, d, stats=stats)


# (m, k, rows, out dtype): odd GEMM shapes (no dimension a multiple of 16 but the FP8 groups'),
# one token, no tokens (also with N padded and a float16 output: nothing to pad), a float16 compute dtype.
ODD = [(21, 48, (40,), torch.float32), (1, 32, (8, 3), torch.bfloat16), (0, 32, (16,), torch.float32),
       (0, 32, (8, 3), torch.float16), (37, 64, (24, 24), torch.float16)]


@pytest.mark.parametrize("pre", [blk.NONE, blk.NORM, blk.SWIGLU])
@pytest.mark.parametrize("m,k,rows,dt", ODD)
def test_block_op_odd_shapes_cpu(gen, pre, m, k, rows, dt):
    x, nw, ws = _inputs(gen, pre, m=m, k=k, rows=rows, dtype=torch.bfloat16 if dt != torch.float16 else dt)
    d = torch.randn(m, sum(rows), generator=gen).to(dt)
    _check_block(x, pre, nw, ws, True, d, out_dtype=dt)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("pre", [blk.NONE, blk.NORM, blk.SWIGLU])
def test_block_op_non_finite_inputs(gen, pre, device):
    """Inf, -Inf and NaN in x and NaN in the output gradient: the block op gives the single ops'
    results bit for bit (quantization saturates infinities and keeps NaN, docs/numerics.md), and a
    NaN reaches its row's outputs instead of vanishing."""
    rows = (24,) if pre == blk.SWIGLU else (16, 8, 8)
    x, nw, ws = _inputs(gen, pre, rows=rows)
    x[2, 3], x[5, 1], x[7, 0] = float("inf"), float("nan"), -float("inf")
    d = torch.randn(x.shape[0], sum(rows), generator=gen).bfloat16()
    d[1, 2] = float("nan")
    if device == "cuda":
        x, nw, ws = _cuda(x, nw, ws, torch.bfloat16)
        d = d.cuda()
    f, b = _check_block(x, pre, nw, ws, True, d)
    assert f.out[5].isnan().all() and torch.isfinite(f.out[[0, 1, 3, 4, 6]]).all()
    assert b.dx.isnan().any() and b.dw.isnan().any()


@pytest.mark.parametrize("pre,kinds", [(blk.NORM, True), (blk.SWIGLU, True)])
@pytest.mark.parametrize("need_w", [True, False])
def test_block_op_kinds_cpu(gen, pre, kinds, need_w):
    """Gemma's unit-offset norm and tanh GeGLU through the op's kind arguments; they change the result."""
    rows = (24,) if pre == blk.SWIGLU else (16, 8, 8)
    x, nw, ws = _inputs(gen, pre, m=21, rows=rows)
    if pre == blk.NORM:
        nw = (0.1 * torch.randn(nw.shape, generator=gen)).to(nw.dtype)  # an offset from 1
    uo, act = pre == blk.NORM, sops.GELU_TANH if pre == blk.SWIGLU else sops.SILU
    d = torch.randn(x.shape[0], sum(rows), generator=gen).bfloat16()
    f, b = _check_block(x, pre, nw, ws, need_w, d, uo, act)
    norm = nw if pre == blk.NORM else None
    plain = blk.forward(x, pre, norm, 1e-5, False, ws, None, None, need_w, torch.float32, False)
    assert not torch.equal(plain.out, f.out)


def test_block_op_takes_the_recipes_formats_cpu(gen):
    """The formats reach the core: E4M3 output gradients give the single ops' E4M3 results, and
    E5M2 activations meet E5M2 weights, a product the FP8 GEMM refuses."""
    x, nw, ws = _inputs(gen, blk.NORM, m=18)
    d = torch.randn(18, 32, generator=gen).bfloat16()
    f = blk.forward(x, blk.NORM, nw, 1e-5, False, ws, None, None, True, torch.float32, False)
    b = blk.backward(d, blk.NORM, True, ws, f.w_scale, None, f.saved, nw, None, x.dtype, torch.float32,
                     grad_dtype=E4)
    rdx, rdnorm, rdw = _steps_bwd(d, blk.NORM, True, nw, ws, f.w_scale, f.saved, x.dtype, grad_fp8=E4)
    _same(b.dx, rdx, "dx")
    _same(b.dw, rdw, "dw")
    assert not torch.equal(b.dx, _steps_bwd(d, blk.NORM, True, nw, ws, f.w_scale, f.saved, x.dtype)[0])
    with pytest.raises(ValueError, match="both e5m2"):
        blk.forward(x, blk.NORM, nw, 1e-5, False, ws, None, None, True, torch.float32, False, act_dtype=E5)


def test_block_op_takes_the_callers_codes_cpu(gen):
    """A weight source's codes (cache, FP8-frozen) give the results of the live parameters."""
    x, nw, ws = _inputs(gen, blk.NORM, m=19)
    d = torch.randn(19, 32, generator=gen).bfloat16()
    live = blk.forward(x, blk.NORM, nw, 1e-5, False, ws, None, None, True, torch.float32, False)
    q, q_t, scale = qops.quantize_stacked_amax(ws, 0, True, True)
    got = blk.forward(x, blk.NORM, nw, 1e-5, False, [], q, scale, True, torch.float32, False)
    assert got.w_scale is None
    _same(got.out, live.out, "out")
    _same_saved(got.saved, live.saved)
    ref = blk.backward(d, blk.NORM, True, ws, live.w_scale, None, live.saved, nw, None, x.dtype, torch.float32)
    b = blk.backward(d, blk.NORM, True, [], scale, q_t, got.saved, nw, None, x.dtype, torch.float32)
    for name in ("dx", "dnorm", "dw"):
        _same(getattr(b, name), getattr(ref, name), name)


@pytest.mark.parametrize("stats", [False, True])
def test_block_op_wgrad_input_cpu(gen, stats):
    """A torch pre-op's output handed to the backward: dW from it, quantized there."""
    x, nw, ws = _inputs(gen, blk.NONE, m=23, k=40, rows=(24,))
    d = torch.randn(23, 24, generator=gen).bfloat16()
    f = blk.forward(x, blk.NONE, None, 0.0, False, ws, None, None, False, torch.float32, False)
    assert f.saved[0] is None
    b = blk.backward(d, blk.NONE, True, ws, f.w_scale, None, f.saved, None, x, x.dtype, torch.float32,
                     want_stats=stats)
    rdx, _, rdw = _steps_bwd(d, blk.NONE, True, nw, ws, f.w_scale, f.saved, x.dtype, wgrad_input=x)
    _same(b.dx, rdx, "dx")
    _same(b.dw, rdw, "dw")
    assert b.stat_in is None and (b.stat_scale is not None) == stats
    if stats:
        _same(b.stat_scale, qops.quantize_per_tensor_amax(x, 0, False)[2], "stat_scale")


def test_binding_errors_name_the_argument():
    x = torch.randn(4, 32)
    w = [torch.randn(16, 32)]

    def fwd(x, pre, norm, ws, **kw):
        return _C.block_fwd(x, pre, norm, 1e-5, False, ws, kw.pop("codes", None), kw.pop("scale", None), False, F32,
                            False, None, False, 0, **kw)

    def bwd(d, pre, need_w, **kw):
        return _C.block_bwd(d, pre, need_w, w, torch.ones(1), None, None, None, None, None, kw.pop("wgrad_input", None),
                            F32, F32, None, False, 0, **kw)

    with pytest.raises(ValueError, match="pre must be 0"):
        fwd(x, 3, None, w)
    with pytest.raises(ValueError, match="norm_weight is required"):
        fwd(x, blk.NORM, None, w)
    with pytest.raises(ValueError, match=r"weights\[0\] has shape \[16, 48\] but the GEMM input has K = 32"):
        fwd(x, blk.NONE, None, [torch.randn(16, 48)])
    with pytest.raises(ValueError, match=r"w_codes has shape \[16, 48\] but the GEMM input has K = 32"):
        fwd(x, blk.NONE, None, [], codes=torch.zeros(16, 48, dtype=U8), scale=torch.ones(1))
    with pytest.raises(ValueError, match="w_codes and w_scale are given together"):
        fwd(x, blk.NONE, None, w, codes=torch.zeros(16, 32, dtype=U8))
    with pytest.raises(ValueError, match="x must be 2-D"):
        fwd(x[None], blk.NONE, None, w)
    with pytest.raises(ValueError, match="parts must hold 1 to"):
        fwd(x, blk.NONE, None, [])
    with pytest.raises(ValueError, match="saved\\[0\\] and saved\\[1\\] are required"):
        bwd(torch.randn(4, 16), blk.NONE, True)
    with pytest.raises(ValueError, match="wgrad_input is only taken with pre=0"):
        bwd(torch.randn(4, 16), blk.NORM, True, wgrad_input=x)
    with pytest.raises(ValueError, match=r"dout has shape \[4, 12\] but the weight has N = 16 rows"):
        bwd(torch.randn(4, 12), blk.NONE, True, wgrad_input=x)
    with pytest.raises(ValueError, match=r"wgrad_input has shape \[4, 30\] but must be \[M, K\] = \[4, 32\]"):
        bwd(torch.randn(4, 16), blk.NONE, True, wgrad_input=torch.randn(4, 30))
    with pytest.raises(ValueError, match="norm_kind must be 0"):
        fwd(x, blk.NORM, torch.ones(32), w, norm_kind=2)
    with pytest.raises(ValueError, match="act must be 0"):
        fwd(torch.randn(4, 64), blk.SWIGLU, None, w, act=5)
    with pytest.raises(ValueError, match="act must be 0"):
        bwd(torch.randn(4, 16), blk.NONE, False, act=-1)


OPCHECK = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")  # as test_norm.py


def test_block_ops_pass_opcheck(gen):
    """Schemas, fake implementations and the eager path agree (torch.library.opcheck)."""
    x, nw, ws = _inputs(gen, blk.NORM, m=9)
    kinds = (NORM_KINDS["scaled"], sops.SILU)
    args = (x, blk.NORM, nw, 1e-5, False, ws, None, None, True, torch.bfloat16, False, *kinds, True, 0, 0, [])
    torch.library.opcheck(torch.ops.coat.block_fwd.default, args, test_utils=OPCHECK)
    amax = [w.float().abs().amax().reshape(1) for w in ws]  # the optimizer's amax of each part
    torch.library.opcheck(torch.ops.coat.block_fwd.default, args[:-1] + (amax,), test_utils=OPCHECK)
    f = blk.forward(x, blk.NORM, nw, 1e-5, False, ws, None, None, True, torch.float32, False)
    d = torch.randn(9, 32, generator=gen).bfloat16()
    bargs = (d, blk.NORM, True, ws, f.w_scale, None, *f.saved, nw, None, x.dtype, torch.float32, *kinds, True, 0, 1)
    torch.library.opcheck(torch.ops.coat.block_bwd.default, bargs, test_utils=OPCHECK)


# ---- the layers against the single ops ---------------------------------------------------------


def _layer_ref(x, pre, nw, ws, d, need_w, cdt, act="silu"):
    """A layer (norm_linear / swiglu_down without bias) op by op, with torch pre-ops where the width
    has no FP8 kernel: (out, dx, dnorm, dw)."""
    x2, d2 = x.reshape(-1, x.shape[-1]), d.reshape(-1, d.shape[-1]).to(cdt)
    k = x2.shape[1] // (2 if pre == blk.SWIGLU else 1)
    act_id = sops.SILU if act == "silu" else sops.GELU_TANH
    fast = resolve("fp8").fast_accum_fwd  # the layers' recipe
    if pre == blk.NONE or k % 16 == 0:
        out, w_scale, saved, _, _ = _steps_fwd(x2, pre, nw, ws, need_w, cdt, act=act_id, fast_accum=fast)
        dx, dnorm, dw = _steps_bwd(d2, pre, need_w, nw, ws, w_scale, saved, x.dtype, act=act_id,
                                   wgrad_dtype=ws[0].dtype)
        return out, dx, dnorm, dw
    xr = x2.detach().requires_grad_()
    wr = nw.detach().requires_grad_()
    y = hf_rms_norm(xr, wr, 1e-5) if pre == blk.NORM else gated(xr, act)
    out, w_scale, saved, _, _ = _steps_fwd(y.detach(), blk.NONE, nw, ws, False, cdt, fast_accum=fast)
    dy, _, dw = _steps_bwd(d2, blk.NONE, need_w, nw, ws, w_scale, saved, x.dtype, wgrad_dtype=ws[0].dtype,
                           wgrad_input=y.detach())
    dx, dnorm = torch.autograd.grad(y, (xr, wr), dy.to(y.dtype), allow_unused=True)
    return out, dx, dnorm, dw


def _check_layer(x, pre, nw, ws, need_w, gen_d):
    """norm_linear / swiglu_down (the layers' entry points) against _layer_ref, bit for bit."""
    xs = x.detach().clone().requires_grad_()
    nws = nw.detach().clone().requires_grad_()
    wss = [w.detach().clone().requires_grad_(need_w) for w in ws]
    if pre == blk.SWIGLU:
        out = swiglu_down(xs, wss[0], None, resolve("fp8"))
    else:
        out = norm_linear(xs, nws if pre == blk.NORM else None, 1e-5, wss, [], resolve("fp8"))
    d = torch.randn(out.shape, generator=gen_d).to(out.dtype).to(out.device)
    out.backward(d)
    r_out, r_dx, r_dnorm, r_dw = _layer_ref(x, pre, nw, ws, d, need_w, out.dtype)
    _same(out.reshape(r_out.shape), r_out, "out")
    _same(xs.grad.reshape(r_dx.shape), r_dx.to(x.dtype), "dx")
    if pre == blk.NORM:
        _same(nws.grad, r_dnorm.to(nw.dtype), "dnorm")
    if need_w:
        _same(torch.cat([w.grad for w in wss]), r_dw, "dw")
    else:
        assert all(w.grad is None for w in wss)


# (pre, m, k, rows): FP8 pre-ops on odd token counts, and widths without an FP8 kernel (torch pre-ops)
LAYERS = [(blk.NONE, 21, 40, (24, 8)), (blk.NORM, 19, 32, (16, 8, 8)), (blk.NORM, 13, 40, (24,)),
          (blk.SWIGLU, 17, 32, (24,)), (blk.SWIGLU, 11, 36, (20,))]


@pytest.mark.parametrize("pre,m,k,rows", LAYERS)
@pytest.mark.parametrize("need_w", [True, False])
def test_layers_match_single_ops_cpu(gen, pre, m, k, rows, need_w):
    x, nw, ws = _inputs(gen, pre, m=m, k=k, rows=rows)
    _check_layer(x, pre, nw, ws, need_w, gen)


def test_layers_count_weight_passes(gen):
    x, nw, ws = _inputs(gen, blk.NORM)
    ws = [w.requires_grad_() for w in ws]
    before = dict(W.stats)
    norm_linear(x, nw, 1e-5, ws, [], resolve("fp8")).sum().backward()
    assert W.stats["forward"] - before["forward"] == 1 and W.stats["backward"] - before["backward"] == 1


# ---- GPU: the layers on CUDA against the single ops ----------------------------------------------------


def _cuda(x, nw, ws, dtype):
    return x.to("cuda", dtype), nw.to("cuda", dtype), [w.to("cuda", dtype) for w in ws]


@pytest.mark.gpu
@pytest.mark.parametrize("pre,m,k,rows", [(blk.NONE, 48, 80, (48, 16, 16)), (blk.NORM, 48, 80, (48, 16, 16)),
                                          (blk.SWIGLU, 64, 176, (48,))] + LAYERS)
@pytest.mark.parametrize("need_w", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layers_match_single_ops_gpu(gen, pre, m, k, rows, need_w, dtype):
    """Aligned shapes (the GEMMs as they are) and LAYERS' odd ones (the block pads K and N to 16 as
    the reference does)."""
    x, nw, ws = _cuda(*_inputs(gen, pre, m=m, k=k, rows=rows), dtype)
    _check_layer(x, pre, nw, ws, need_w, gen)


@pytest.mark.gpu
def test_norm_linear_under_autocast_gpu(gen):
    """fp32 inputs, bf16 GEMM outputs (autocast's compute dtype), fp32 weight gradients."""
    x, nw, ws = _cuda(*_inputs(gen, blk.NORM, m=32, k=64, rows=(32, 32)), torch.float32)
    xs, nws = x.clone().requires_grad_(), nw.clone().requires_grad_()
    wss = [w.clone().requires_grad_() for w in ws]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = norm_linear(xs, nws, 1e-5, wss, [], resolve("fp8"))
    assert out.dtype == torch.bfloat16
    d = torch.randn(out.shape, generator=gen).bfloat16().cuda()
    out.backward(d)
    r_out, r_dx, r_dnorm, r_dw = _layer_ref(x, blk.NORM, nw, ws, d, True, torch.bfloat16)
    _same(out, r_out, "out")
    _same(xs.grad, r_dx.float(), "dx")
    _same(nws.grad, r_dnorm, "dnorm")
    _same(torch.cat([w.grad for w in wss]), r_dw, "dw")


@pytest.mark.gpu
@pytest.mark.parametrize("pre", [blk.NORM, blk.SWIGLU])
@pytest.mark.parametrize("need_w", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_op_kinds_gpu(gen, pre, need_w, dtype):
    """Gemma's kinds on CUDA: the block op against the single ops, bit for bit."""
    rows = (48,) if pre == blk.SWIGLU else (48, 16, 16)
    x, nw, ws = _cuda(*_inputs(gen, pre, m=64, k=80, rows=rows), dtype)
    nw = (0.1 * torch.randn(nw.shape, generator=gen)).to(dtype).cuda()
    uo, act = pre == blk.NORM, sops.GELU_TANH if pre == blk.SWIGLU else sops.SILU
    d = torch.randn(x.shape[0], sum(rows), generator=gen).to(dtype).cuda()
    _check_block(x, pre, nw, ws, need_w, d, uo, act, stats=True)


@pytest.mark.gpu
@pytest.mark.parametrize("pre", [blk.NONE, blk.NORM, blk.SWIGLU])
@pytest.mark.parametrize("m,k,rows,dt", ODD)
def test_block_op_odd_shapes_gpu(gen, pre, m, k, rows, dt):
    x, nw, ws = _cuda(*_inputs(gen, pre, m=m, k=k, rows=rows), torch.bfloat16 if dt != torch.float16 else dt)
    d = torch.randn(m, sum(rows), generator=gen).to(dt).cuda()
    _check_block(x, pre, nw, ws, True, d, out_dtype=dt)


@pytest.mark.gpu
def test_compiled_layer_matches_eager_gpu():
    """Under torch.compile (inductor) the block op runs through its schema and fake implementation."""
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(lambda x, w: norm_linear(x, None, 1e-5, [w], [], resolve("fp8")), fullgraph=True)
    torch.testing.assert_close(fn(x, w), norm_linear(x, None, 1e-5, [w], [], resolve("fp8")), rtol=0, atol=0)
