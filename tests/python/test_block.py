"""One call per layer block (coat._ops.block, csrc/bindings/block.cpp) against the same block run
op by op: bit-identical outputs, saved tensors and gradients.

CPU: the bindings themselves (every core step has its CPU reference) against the single ops, for
each pre-op, with and without weight gradients. GPU: the layers (fused norm + linear, the plain
projection, SwiGLU + down) with the one-call path against the step-by-step path, on odd-sized
shapes the FP8 GEMM takes as they are; and which path a call takes."""

import pytest
import torch

from coat import _C
from coat._ops import block as blk
from coat._ops import gemm as gops
from coat._ops import norm as nops
from coat._ops import quantize as qops
from coat._ops import swiglu as sops
from coat._ops.enums import NORM_KINDS
from coat.nn import _fp8mm as mm
from coat.nn import weights as W
from coat.nn.fused import norm_linear
from coat.nn.mlp import swiglu_down
from coat.nn.recipe import resolve

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
U8 = torch.uint8
WS = torch.empty(0, dtype=U8)  # the CPU path reads no GEMM workspace


def _same(a, b, what):
    assert a.shape == b.shape and torch.equal(a.view(U8) if a.dtype in (E4, E5, U8) else a,
                                              b.view(U8) if b.dtype in (E4, E5, U8) else b), what


def _inputs(gen, pre, m=20, k=32, rows=(16, 8, 8), dtype=torch.bfloat16):
    x = torch.randn(m, 2 * k if pre == blk.SWIGLU else k, generator=gen).to(dtype)
    nw = (torch.rand(k, generator=gen) + 0.5).to(dtype)
    ws = [(torch.randn(r, k, generator=gen) / k**0.5).to(dtype) for r in rows]
    return x, nw, ws


def _steps_fwd(x, pre, nw, ws, save_t, unit_offset=False, act=sops.SILU):
    """The forward op by op: (out, w_scale, saved)."""
    if pre == blk.NORM:
        y, rstd, xq, xs = nops.rmsnorm_fwd(x, nw, 1e-5, True, E4, False, unit_offset)
        saved = (xq, xs, rstd)
    elif pre == blk.SWIGLU:
        y, q, s = sops.swiglu_fwd(x, True, E4, False, act)
        saved = (q, s)
    else:
        y = x
    q, q_t, s, _ = qops.quantize_per_tensor_amax(y, 0, pre == blk.NONE and save_t)
    if pre == blk.NONE:
        saved = (q_t if save_t else None, s)
    wq, _, w_scale = qops.quantize_stacked_amax(ws, 0, True, False)
    out = gops.fp8_gemm(q.view(E4), wq.view(E4), s, w_scale, None, torch.float32)
    return out, w_scale, saved


def _steps_bwd(d, pre, need_w, nw, ws, w_scale, saved, y_dtype, unit_offset=False, act=sops.SILU):
    """The backward op by op: (dx, dnorm, dw)."""
    dq, dq_t, ds, _ = qops.quantize_per_tensor_amax(d, 1, need_w)
    _, w_t = qops.quantize_stacked(ws, w_scale, 0, False, True)
    dy = gops.fp8_gemm(dq.view(E5), w_t.view(E4), ds, w_scale, None, d.dtype)

    def wgrad(in_t, in_scale):
        return gops.fp8_gemm(dq_t.view(E5), in_t.view(E4), ds, in_scale, None, torch.float32)

    def wgrad_of(y):
        _, y_t, ys, _ = qops.quantize_per_tensor_amax(y, 0, True)
        return wgrad(y_t, ys)

    dw = dnorm = None
    if pre == blk.NORM:
        if need_w:
            dw = wgrad_of(nops.rmsnorm_fwd_fp8(*saved, nw, y_dtype, unit_offset))
        dx, dnorm = nops.rmsnorm_bwd(*saved, nw, dy, unit_offset)
    elif pre == blk.SWIGLU:
        dx, h = sops.swiglu_bwd(*saved, dy, need_w, act)
        if need_w:
            dw = wgrad_of(h)
    else:
        if need_w:
            dw = wgrad(*saved)
        dx = dy
    return dx, dnorm, dw


@pytest.mark.parametrize("pre", [blk.NONE, blk.NORM, blk.SWIGLU])
@pytest.mark.parametrize("need_w", [True, False])
def test_binding_matches_single_ops_cpu(gen, pre, need_w):
    rows = (24,) if pre == blk.SWIGLU else (16, 8, 8)
    x, nw, ws = _inputs(gen, pre, rows=rows)
    norm = nw if pre == blk.NORM else None
    ref_out, ref_scale, ref_saved = _steps_fwd(x, pre, nw, ws, need_w)
    got = _C.block_fwd(x, pre, norm, 1e-5, False, ws, need_w, 0, False, WS, False, 0)
    _same(got[0], ref_out, "out")
    _same(got[1], ref_scale, "w_scale")
    for i, r in enumerate(ref_saved):
        if r is None:  # no transposed input kept when no weight trains
            assert got[2 + i] is None and pre == blk.NONE and not need_w
        else:
            _same(got[2 + i], r, f"saved[{i}]")
    if pre == blk.NORM:
        assert got[4] is not None
    else:
        assert got[4] is None

    d = torch.randn(x.shape[0], sum(rows), generator=gen).bfloat16()
    s = tuple(got[2:5])
    dx, dnorm, dw = _C.block_bwd(d, pre, need_w, ws, got[1], *s, norm, 1, 0, WS, False, 0)
    rdx, rdnorm, rdw = _steps_bwd(d, pre, need_w, nw, ws, ref_scale, ref_saved, torch.bfloat16)
    _same(dx, rdx, "dx")
    assert (dnorm is None) == (rdnorm is None) and (dnorm is None or torch.equal(dnorm, rdnorm))
    assert (dw is None) == (not need_w) and (dw is None or torch.equal(dw, rdw))


def _same_saved(got, ref_saved, pre, need_w):
    for i, r in enumerate(ref_saved):
        if r is None:
            assert got[i] is None and pre == blk.NONE and not need_w
        else:
            _same(got[i], r, f"saved[{i}]")


# (pre, kinds): Gemma's unit-offset norm and GeGLU, through the binding's keyword arguments.
NEW_KINDS = [(blk.NORM, {"norm_kind": NORM_KINDS["unit_offset"]}), (blk.SWIGLU, {"act": sops.GELU_TANH})]


@pytest.mark.parametrize("pre,kinds", NEW_KINDS)
@pytest.mark.parametrize("need_w", [True, False])
def test_binding_kinds_match_single_ops_cpu(gen, pre, kinds, need_w):
    rows = (24,) if pre == blk.SWIGLU else (16, 8, 8)
    x, nw, ws = _inputs(gen, pre, m=21, rows=rows)
    if pre == blk.NORM:
        nw = (0.1 * torch.randn(nw.shape, generator=gen)).to(nw.dtype)  # an offset from 1
    uo, act = pre == blk.NORM, sops.GELU_TANH if pre == blk.SWIGLU else sops.SILU
    norm = nw if pre == blk.NORM else None
    ref_out, ref_scale, ref_saved = _steps_fwd(x, pre, nw, ws, need_w, uo, act)
    got = _C.block_fwd(x, pre, norm, 1e-5, False, ws, need_w, 0, False, WS, False, 0, **kinds)
    _same(got[0], ref_out, "out")
    _same(got[1], ref_scale, "w_scale")
    _same_saved(got[2:], ref_saved, pre, need_w)
    # the new kind changes the result: the default kind's output differs
    plain = _C.block_fwd(x, pre, norm, 1e-5, False, ws, need_w, 0, False, WS, False, 0)
    assert not torch.equal(plain[0], got[0])

    d = torch.randn(x.shape[0], sum(rows), generator=gen).bfloat16()
    dx, dnorm, dw = _C.block_bwd(d, pre, need_w, ws, got[1], *got[2:5], norm, 1, 0, WS, False, 0, **kinds)
    rdx, rdnorm, rdw = _steps_bwd(d, pre, need_w, nw, ws, ref_scale, ref_saved, torch.bfloat16, uo, act)
    _same(dx, rdx, "dx")
    assert (dnorm is None) == (rdnorm is None) and (dnorm is None or torch.equal(dnorm, rdnorm))
    assert (dw is None) == (not need_w) and (dw is None or torch.equal(dw, rdw))
    pdx = _C.block_bwd(d, pre, need_w, ws, got[1], *got[2:5], norm, 1, 0, WS, False, 0)[0]
    assert not torch.equal(pdx, dx)


def _kinds_match_steps(x, pre, nw, ws, need_w, d):
    """block.forward / block.backward with Gemma's kinds (the unit-offset norm for NORM, the tanh
    GeGLU for SWIGLU) against the single ops, bit for bit; ``d``: the output gradient."""
    uo, act = pre == blk.NORM, sops.GELU_TANH if pre == blk.SWIGLU else sops.SILU
    norm = nw if pre == blk.NORM else None
    out, w_scale, saved = blk.forward(x, pre, norm, 1e-5, False, ws, need_w, torch.float32, False,
                                      unit_offset=uo, act=act)
    ref_out, ref_scale, ref_saved = _steps_fwd(x, pre, nw, ws, need_w, uo, act)
    _same(out, ref_out, "out")
    _same_saved(saved, ref_saved, pre, need_w)
    dx, dnorm, dw = blk.backward(d, pre, need_w, ws, w_scale, saved, norm, d.dtype, torch.float32,
                                 unit_offset=uo, act=act)
    rdx, rdnorm, rdw = _steps_bwd(d, pre, need_w, nw, ws, ref_scale, ref_saved, d.dtype, uo, act)
    _same(dx, rdx, "dx")
    assert (dnorm is None) == (rdnorm is None) and (dnorm is None or torch.equal(dnorm, rdnorm))
    assert (dw is None) == (not need_w) and (dw is None or torch.equal(dw, rdw))


@pytest.mark.parametrize("pre", [blk.NORM, blk.SWIGLU])
def test_python_wrappers_pass_the_kinds(gen, monkeypatch, pre):
    """block.forward / block.backward (unit_offset=, act=) on CPU tensors (the GEMM workspace is
    only read on CUDA) against the single ops."""
    monkeypatch.setattr(blk, "_ws", lambda t, st: WS)
    rows = (24,) if pre == blk.SWIGLU else (16, 8, 8)
    x, nw, ws = _inputs(gen, pre, rows=rows)
    d = torch.randn(x.shape[0], sum(rows), generator=gen).bfloat16()
    _kinds_match_steps(x, pre, nw, ws, True, d)


def test_binding_errors_name_the_argument():
    x = torch.randn(4, 32)
    w = [torch.randn(16, 32)]
    with pytest.raises(ValueError, match="pre must be 0"):
        _C.block_fwd(x, 3, None, 1e-5, False, w, False, 0, False, WS, False, 0)
    with pytest.raises(ValueError, match="norm_weight is required"):
        _C.block_fwd(x, blk.NORM, None, 1e-5, False, w, False, 0, False, WS, False, 0)
    with pytest.raises(ValueError, match=r"weights\[0\] has shape \[16, 48\] but the GEMM input has K = 32"):
        _C.block_fwd(x, blk.NONE, None, 1e-5, False, [torch.randn(16, 48)], False, 0, False, WS, False, 0)
    with pytest.raises(ValueError, match="x must be 2-D"):
        _C.block_fwd(x[None], blk.NONE, None, 1e-5, False, w, False, 0, False, WS, False, 0)
    with pytest.raises(ValueError, match="saved\\[0\\] and saved\\[1\\] are required"):
        _C.block_bwd(torch.randn(4, 16), blk.NONE, True, w, torch.ones(1), None, None, None, None, 0, 0, WS, False, 0)
    with pytest.raises(ValueError, match="norm_kind must be 0"):
        _C.block_fwd(x, blk.NORM, torch.ones(32), 1e-5, False, w, False, 0, False, WS, False, 0, norm_kind=2)
    with pytest.raises(ValueError, match="act must be 0"):
        _C.block_fwd(torch.randn(4, 64), blk.SWIGLU, None, 1e-5, False, w, False, 0, False, WS, False, 0, act=5)
    with pytest.raises(ValueError, match="act must be 0"):
        _C.block_bwd(torch.randn(4, 16), blk.NONE, False, w, torch.ones(1), None, None, None, None, 0, 0, WS, False, 0,
                     act=-1)


def test_layers_run_step_by_step_on_the_cpu(gen):
    """CPU tensors never take the one-call path (the CPU GEMM is emulated in torch: faster)."""
    x, nw, ws = _inputs(gen, blk.NORM, m=32)
    assert not mm.one_call(x, ws[0], (32, 32), torch.bfloat16)


# ---- GPU: the layers, one call against step by step -------------------------------------------------


def _grads(fn, inputs):
    ins = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*ins)
    out.backward(torch.randn_like(out, generator=None))
    return out.detach(), [t.grad for t in ins]


def _both(monkeypatch, fn, inputs, seed=0):
    """(one-call result, step-by-step result, W.stats delta of the one-call run)."""
    torch.manual_seed(seed)
    before = dict(W.stats)
    fast = _grads(fn, inputs)
    delta = {k: W.stats[k] - before[k] for k in before}
    with monkeypatch.context() as mp:
        mp.setattr(mm, "one_call", lambda *a, **k: False)
        torch.manual_seed(seed)
        slow = _grads(fn, inputs)
    return fast, slow, delta


def _check_same(fast, slow):
    _same(fast[0], slow[0], "output")
    for i, (a, b) in enumerate(zip(fast[1], slow[1])):
        assert (a is None) == (b is None), i
        if a is not None:
            _same(a, b, f"grad {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("train_w", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_linear_one_call_matches_steps(monkeypatch, norm, train_w, dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    m, k, rows = 48, 80, (48, 16, 16)
    x = torch.randn(3, m // 3, k, device="cuda", generator=g).to(dtype).requires_grad_()
    nw = (torch.rand(k, device="cuda", generator=g) + 0.5).to(dtype).requires_grad_()
    ws = [(torch.randn(r, k, device="cuda", generator=g) / k**0.5).to(dtype).requires_grad_(train_w) for r in rows]
    recipe = resolve("fp8")

    def fn(x, nw, *ws):
        return norm_linear(x, nw if norm else None, 1e-5, list(ws), [], recipe)

    fast, slow, delta = _both(monkeypatch, fn, [x, nw, *ws])
    _check_same(fast, slow)
    assert delta["forward"] == 1 and delta["backward"] == 1


@pytest.mark.gpu
def test_norm_linear_under_autocast_matches_steps(monkeypatch):
    """fp32 inputs, bf16 GEMM outputs (autocast's compute dtype), fp32 weight gradients."""
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(32, 64, device="cuda", generator=g).requires_grad_()
    nw = torch.rand(64, device="cuda", generator=g).requires_grad_()
    ws = [torch.randn(32, 64, device="cuda", generator=g).requires_grad_() for _ in range(2)]

    def fn(x, nw, *ws):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return norm_linear(x, nw, 1e-5, list(ws), [], resolve("fp8")).float()

    fast, slow, _ = _both(monkeypatch, fn, [x, nw, *ws])
    _check_same(fast, slow)
    assert fast[0].dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("train_w", [True, False])
def test_swiglu_down_one_call_matches_steps(monkeypatch, train_w):
    g = torch.Generator(device="cuda").manual_seed(3)
    m, inter, hid = 64, 176, 48
    gu = torch.randn(m, 2 * inter, device="cuda", generator=g).bfloat16().requires_grad_()
    wd = (torch.randn(hid, inter, device="cuda", generator=g) / inter**0.5).bfloat16().requires_grad_(train_w)

    fast, slow, delta = _both(monkeypatch, lambda gu, wd: swiglu_down(gu, wd, None, resolve("fp8")), [gu, wd])
    _check_same(fast, slow)
    assert delta["forward"] == 1 and delta["backward"] == 1


@pytest.mark.gpu
def test_unaligned_tokens_take_steps_in_backward(monkeypatch):
    """50 tokens: the forward runs as one call (its GEMM has no token alignment), the backward's
    weight-gradient GEMM would need 16 | tokens, so the backward runs op by op; the same results."""
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(50, 64, device="cuda", generator=g).bfloat16().requires_grad_()
    nw = torch.rand(64, device="cuda", generator=g).bfloat16().requires_grad_()
    w = torch.randn(32, 64, device="cuda", generator=g).bfloat16().requires_grad_()
    calls = []
    real = blk.backward
    monkeypatch.setattr(blk, "backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    fast, slow, _ = _both(monkeypatch, lambda x, nw, w: norm_linear(x, nw, 1e-5, [w], [], resolve("fp8")), [x, nw, w])
    _check_same(fast, slow)
    assert not calls


@pytest.mark.gpu
def test_compiled_layer_does_not_take_one_call(monkeypatch):
    """Under torch.compile the block runs the single ops (custom ops with fake implementations)."""
    calls = []
    real = blk.forward
    monkeypatch.setattr(blk, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(lambda x, w: norm_linear(x, None, 1e-5, [w], [], resolve("fp8")), fullgraph=True)
    out = fn(x, w)
    ref = norm_linear(x, None, 1e-5, [w], [], resolve("fp8"))
    assert len(calls) == 1  # the eager reference only
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("pre", [blk.NORM, blk.SWIGLU])
@pytest.mark.parametrize("need_w", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kinds_one_call_matches_steps_gpu(pre, need_w, dtype):
    """Gemma's kinds on CUDA: block.forward / block.backward against the single ops, bit for bit,
    on shapes the FP8 GEMM takes as they are."""
    gen = torch.Generator().manual_seed(5)
    rows = (48,) if pre == blk.SWIGLU else (48, 16, 16)
    x, nw, ws = _inputs(gen, pre, m=64, k=80, rows=rows, dtype=dtype)
    x, ws = x.cuda(), [w.cuda() for w in ws]
    nw = (0.1 * torch.randn(nw.shape, generator=gen)).to(dtype).cuda()
    _kinds_match_steps(x, pre, nw, ws, need_w, torch.randn(x.shape[0], sum(rows), generator=gen).to(dtype).cuda())
