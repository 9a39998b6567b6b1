"""SwiGLU over a fused gate/up output with FP8-saved pre-activations: the ops against a pure-torch
emulation of the same quantization (tight) and against the BF16 op (stated tolerance), and the
fused SwiGLU + down projection block."""

import pytest
import torch
import torch.nn.functional as F
from _emu import group_quant, rel

from coat._ops import swiglu as ops
from coat.nn import Fp8SwiGLUMLP
from coat.nn.mlp import swiglu_down
from coat.nn.recipe import resolve

E4 = torch.float8_e4m3fn
OPCHECK = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def bf16_swiglu(gu):
    g, u = gu.chunk(2, -1)
    return F.silu(g) * u


@pytest.mark.parametrize("rows,inter", [(1, 16), (7, 48), (0, 32), (9, 176)])
@pytest.mark.parametrize("e8m0", [False, True])
def test_fwd_matches_emulation(gen, rows, inter, e8m0):
    gu = (torch.randn(rows, 2 * inter, generator=gen) * 3).bfloat16()
    h, q, s = ops.swiglu_fwd(gu, True, E4, e8m0)
    eq, es, _ = group_quant(gu, e8m0)
    assert torch.equal(q.view(torch.uint8), eq.view(torch.uint8))
    assert torch.equal(s, es)
    # torch's silu and coat's differ by at most an exp ulp: one bf16 rounding may flip
    torch.testing.assert_close(h, bf16_swiglu(gu), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("e8m0", [False, True])
def test_bwd_matches_emulation(gen, e8m0):
    rows, inter = 13, 80
    gu = (torch.randn(rows, 2 * inter, generator=gen) * 2).bfloat16()
    dh = torch.randn(rows, inter, generator=gen).bfloat16()
    _, q, s = ops.swiglu_fwd(gu, True, E4, e8m0)
    _, _, deq = group_quant(gu, e8m0)
    dgu, h = ops.swiglu_bwd(q, s, dh, True)
    g, u = deq.double().chunk(2, -1)
    sg = torch.sigmoid(g)
    silu = (g * sg).bfloat16().double()
    edg = dh.double() * u * sg * (1 + g * (1 - sg))
    edu = dh.double() * silu
    assert rel(dgu[:, :inter], edg) < 4e-3 and rel(dgu[:, inter:], edu) < 4e-3  # bf16 output rounding
    assert rel(h, silu * u) < 4e-3
    d2, h2 = ops.swiglu_bwd(q, s, dh, False)
    assert torch.equal(d2, dgu) and h2.numel() == 0


def test_autograd_vs_bf16(gen):
    """silu(g) * u then down_proj, FP8 vs BF16: the forward differs by the FP8 GEMM operands, the
    grads by E4M3 activations and E5M2 output gradients."""
    rows, inter, hid = 37, 96, 48
    gu = torch.randn(rows, 2 * inter, generator=gen).bfloat16().requires_grad_()
    wd = (torch.randn(hid, inter, generator=gen) / inter**0.5).bfloat16().requires_grad_()
    dout = torch.randn(rows, hid, generator=gen).bfloat16()
    out = swiglu_down(gu, wd, None, resolve("fp8"))
    out.backward(dout)
    gu2, wd2 = gu.detach().clone().requires_grad_(), wd.detach().clone().requires_grad_()
    ref = bf16_swiglu(gu2) @ wd2.t()
    ref.backward(dout)
    assert rel(out, ref) < 0.06  # two E4M3 operands: ~2-3 % each, norm-wise
    assert rel(gu.grad, gu2.grad) < 0.12  # + E5M2 dY (2 mantissa bits)
    assert rel(wd.grad, wd2.grad) < 0.12


def test_module_odd_intermediate_falls_back(gen):
    """intermediate 40 is not a multiple of 16: BF16 SwiGLU, FP8 GEMMs."""
    m = Fp8SwiGLUMLP(32, 40).bfloat16()
    x = torch.randn(2, 5, 32, generator=gen).bfloat16().requires_grad_()
    y = m(x)
    ref = m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))
    # two stacked FP8 GEMMs (E4M3: ~3.6 % rms per operand): measured 6.6 % mean, 8.2 % max over 30 seeds
    assert rel(y, ref) < 0.12
    y.float().sum().backward()
    assert x.grad is not None and m.gate_proj.weight.grad is not None and m.down_proj.weight.grad is not None


def test_bad_inputs():
    with pytest.raises(ValueError, match="2 x a multiple of 16"):
        ops.swiglu_fwd(torch.randn(3, 40), True, E4, False)
    with pytest.raises(ValueError, match="gate_up must be"):
        ops.swiglu_fwd(torch.randint(0, 3, (3, 32)), True, E4, False)
    _, q, s = ops.swiglu_fwd(torch.randn(3, 64), True, E4, False)
    with pytest.raises(ValueError, match="dh must have shape"):
        ops.swiglu_bwd(q, s, torch.randn(3, 16), False)
    with pytest.raises(ValueError, match="scales must have"):
        ops.swiglu_bwd(q, s[:, :2].contiguous(), torch.randn(3, 32), False)
    with pytest.raises(ValueError, match="does not match"):
        swiglu_down(torch.randn(3, 64), torch.randn(8, 16), None, resolve("fp8"))


# ---- GeGLU (Gemma's gelu_pytorch_tanh): h = T(T(gelu_tanh(g)) * u) ------------------------------------

GELU = ops.GELU_TANH


def torch_geglu(gu: torch.Tensor) -> torch.Tensor:
    """Hugging Face's act_fn(gate) * up with hidden_activation="gelu_pytorch_tanh"."""
    g, u = gu.chunk(2, -1)
    return F.gelu(g, approximate="tanh") * u


def _tol(dtype):
    return 2**-7 if dtype == torch.bfloat16 else 1e-5


def assert_h_close(h: torch.Tensor, ref: torch.Tensor, gu: torch.Tensor, dtype) -> None:
    """GeGLU's h against another implementation's (torch's, or the GPU's against the CPU's), per
    element: one rounding of T may flip (rtol), and tanh's last-ulp differences (up to 3 ulps of
    fp32 between libraries, 2^-24 each near -1) are absolute errors of up to 2^-23 |g| |u| in
    act(g) * u where 1 + tanh cancels (-8 < g < 0; below, tanh is -1 in fp32 for every library).
    NaN and inf where ref has them."""
    g, u = gu.float().chunk(2, -1)
    hf, rf = h.float(), ref.float()
    assert torch.equal(hf.isnan(), rf.isnan())
    inf = rf.isinf()
    assert torch.equal(hf.isinf(), inf) and torch.equal(hf[inf], rf[inf])
    fin = rf.isfinite()
    cancel = (g > -8) & (g < 0)
    bound = _tol(dtype) * rf.abs() + torch.where(cancel, 2**-23 * g.abs() * u.abs(), 0.0) + 1e-6
    bad = ((hf - rf).abs() > bound) & fin
    assert not bad.any(), f"{int(bad.sum())} elements differ, e.g. {hf[bad][:4].tolist()} vs {rf[bad][:4].tolist()}"


def test_act_ids_are_the_exports():
    from coat._ops.enums import GATED_ACTS

    assert (ops.SILU, ops.GELU_TANH) == (GATED_ACTS["silu"], GATED_ACTS["gelu_tanh"])


@pytest.mark.parametrize("rows,inter", [(1, 16), (7, 48), (0, 32), (9, 176)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("e8m0", [False, True])
def test_geglu_fwd_matches_torch(gen, rows, inter, dtype, e8m0):
    gu = (torch.randn(rows, 2 * inter, generator=gen) * 3).to(dtype)
    h, q, s = ops.swiglu_fwd(gu, True, E4, e8m0, act=GELU)
    eq, es, _ = group_quant(gu, e8m0)
    assert torch.equal(q.view(torch.uint8), eq.view(torch.uint8))  # the saved copy does not depend on act
    assert torch.equal(s, es)
    assert h.dtype == dtype and h.shape == (rows, inter)
    assert_h_close(h, torch_geglu(gu), gu, dtype)


def test_geglu_adversarial_fwd(gen):
    """Large |g| (tanh saturates; g^3 overflows fp32 past ~7e12) and NaN, as torch computes them."""
    big = [1e4, -1e4, 7.0, -7.0, 1e20, -1e20, 3e38, -3e38, 0.0, -0.0, float("nan"), 1.0, -1.0, 40.0, -40.0, 2.5]
    g = torch.tensor(big)
    u = torch.linspace(-2, 2, 16)
    u[3] = float("nan")
    for dtype in (torch.bfloat16, torch.float32):
        gu = torch.cat([g, u])[None].repeat(3, 1).to(dtype)
        h, _, _ = ops.swiglu_fwd(gu, True, E4, False, act=GELU)
        ref = torch_geglu(gu)
        assert_h_close(h, ref, gu, dtype)


def _geglu_autograd(deq: torch.Tensor, dh: torch.Tensor):
    """(dg, du) by fp64 autograd of gelu_tanh(g) * u at the dequantized input."""
    gu = deq.double().requires_grad_()
    torch_geglu(gu).backward(dh.double())
    inter = dh.shape[-1]
    return gu.grad[:, :inter], gu.grad[:, inter:]


@pytest.mark.parametrize("rows", [0, 1, 13])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("e8m0", [False, True])
def test_geglu_bwd_is_autograd(gen, rows, dtype, e8m0):
    inter = 80
    gu = (torch.randn(rows, 2 * inter, generator=gen) * 2).to(dtype)
    dh = torch.randn(rows, inter, generator=gen).to(dtype)
    _, q, s = ops.swiglu_fwd(gu, True, E4, e8m0, act=GELU)
    _, _, deq = group_quant(gu, e8m0)
    dgu, h = ops.swiglu_bwd(q, s, dh, True, act=GELU)
    assert dgu.shape == gu.shape and dgu.dtype == dtype and h.shape == dh.shape
    if rows == 0:
        return
    edg, edu = _geglu_autograd(deq, dh)
    # du = dh * T(gelu(g)) (the forward's rounding): within T's rounding of the fp64 product
    assert rel(dgu[:, :inter], edg) < 4e-3 if dtype == torch.bfloat16 else rel(dgu[:, :inter], edg) < 1e-5
    assert rel(dgu[:, inter:], edu) < 4e-3 if dtype == torch.bfloat16 else rel(dgu[:, inter:], edu) < 1e-5
    # h recomputed from the FP8 copy: the forward's formula (and roundings) on the fp32 dequantized input
    g, u = deq.chunk(2, -1)
    eh = (F.gelu(g, approximate="tanh").to(dtype).float() * u).to(dtype)
    assert_h_close(h, eh, deq, dtype)
    d2, h2 = ops.swiglu_bwd(q, s, dh, False, act=GELU)
    assert torch.equal(d2, dgu) and h2.numel() == 0


def _adversarial_gu() -> torch.Tensor:
    """[2, 96] gate/up rows, one kind of value per 16-group of the gate (a group keeps ~2^17 of
    dynamic range in E4M3, so mixing them would quantize the small ones to 0): |g| ~ 1e29-1e30,
    where g^2 overflows fp32; |g| 2.5-1e4, where tanh saturates or nearly does; ordinary values.
    One NaN in the second row."""
    huge = torch.tensor([1.0, 5.0, 2.0, 1.0, 3.0, 8.0, 6.0, 4.0]).repeat_interleave(2) * 1e29
    huge[1::2] *= -1
    sat = torch.tensor([1e4, 40.0, 9.0, 7.0, 5.0, 4.0, 3.0, 2.5]).repeat_interleave(2)
    sat[1::2] *= -1
    gate = torch.cat([huge, sat, torch.linspace(-2, 2, 16)])
    gu = torch.cat([gate, torch.linspace(1, 2, 48)])[None].repeat(2, 1)
    gu[1, 20] = float("nan")
    return gu


def test_geglu_adversarial_bwd():
    """Saturated tanh: the derivative is 1 (g >> 0) or 0 (g << 0), also where g^2 overflows fp32
    (fp64 autograd is the reference: fp32 autograd would give 0 * inf = NaN there); NaN propagates."""
    gu = _adversarial_gu()
    dh = torch.ones(2, 48)
    _, q, s = ops.swiglu_fwd(gu, True, E4, False, act=GELU)
    _, _, deq = group_quant(gu, False)
    dgu, h = ops.swiglu_bwd(q, s, dh, True, act=GELU)
    edg, edu = _geglu_autograd(deq, dh)
    assert torch.equal(dgu.isnan(), torch.cat([edg, edu], -1).isnan())
    assert dgu[0].isfinite().all() and h[0].isfinite().all() and h[1].isnan().sum() == 1
    # the saturated limits, exactly: dg = dh * u * 1 for g >> 0 and 0 for g << 0
    assert torch.equal(dgu[0, 0:16:2], deq[0, 48:64:2]) and torch.equal(dgu[0, 1:16:2], torch.zeros(8))
    # fp32's tanh resolves ~6e-8 near +-1: where it nearly saturates (|g| ~ 3-6), sech^2 = 1 - t^2
    # and with it dg carry an absolute error of a few 1e-6 (|u| <= 2)
    torch.testing.assert_close(dgu[:, :48].double(), edg, rtol=1e-5, atol=4e-6, equal_nan=True)
    torch.testing.assert_close(dgu[:, 48:].double(), edu, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_geglu_autograd_vs_bf16(gen):
    """The FP8-saved op pair against autograd of torch's bf16 GeGLU on arbitrary inputs: the
    forward within one rounding, the gradient within the E4M3 error of the saved input."""
    gu = (torch.randn(37, 192, generator=gen) * 2).bfloat16()
    dh = torch.randn(37, 96, generator=gen).bfloat16()
    h, q, s = ops.swiglu_fwd(gu, True, E4, False, act=GELU)
    dgu, _ = ops.swiglu_bwd(q, s, dh, False, act=GELU)
    gu2 = gu.clone().requires_grad_()
    ref = torch_geglu(gu2)
    ref.backward(dh)
    assert_h_close(h, ref, gu, torch.bfloat16)
    assert rel(dgu, gu2.grad) < 0.05  # E4M3 pre-activations: ~2-3 % norm-wise


def test_bad_act():
    gu = torch.randn(3, 64)
    with pytest.raises(ValueError, match="act must be 0 \\(silu\\) or 1 \\(gelu_tanh\\), got 2"):
        ops.swiglu_fwd(gu, True, E4, False, act=2)
    _, q, s = ops.swiglu_fwd(gu, True, E4, False)
    with pytest.raises(ValueError, match="act must be"):
        ops.swiglu_bwd(q, s, torch.randn(3, 32), False, act=-1)


def test_compiled_geglu_matches_eager(gen):
    """The schemas and fakes carry the activation through torch.compile."""
    gu = torch.randn(5, 96, generator=gen).bfloat16()
    dh = torch.randn(5, 48, generator=gen).bfloat16()

    def step(gu, dh):
        h, q, s = ops.swiglu_fwd(gu, True, E4, False, GELU)
        return (h, *ops.swiglu_bwd(q, s, dh, True, GELU))

    for a, b in zip(torch.compile(step, fullgraph=True, backend="aot_eager")(gu, dh), step(gu, dh)):
        assert torch.equal(a, b)


def test_opcheck(gen):
    gu = torch.randn(3, 64, generator=gen).bfloat16()
    torch.library.opcheck(ops.swiglu_fwd, (gu, True, E4, False), test_utils=OPCHECK)
    _, q, s = ops.swiglu_fwd(gu, True, E4, False)
    torch.library.opcheck(ops.swiglu_bwd, (q, s, torch.randn(3, 32).bfloat16(), True), test_utils=OPCHECK)
    torch.library.opcheck(ops.swiglu_fwd, (gu, True, E4, True), {"act": GELU}, test_utils=OPCHECK)
    _, q, s = ops.swiglu_fwd(gu, True, E4, True, act=GELU)
    torch.library.opcheck(ops.swiglu_bwd, (q, s, torch.randn(3, 32).bfloat16(), True), {"act": GELU},
                          test_utils=OPCHECK)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,inter", [(1, 16), (37, 80), (1000, 11008)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("e8m0", [False, True])
@pytest.mark.parametrize("act", [ops.SILU, ops.GELU_TANH])
def test_gpu_matches_cpu(gen, rows, inter, dtype, e8m0, act):
    gu = (torch.randn(rows, 2 * inter, generator=gen) * 3).to(dtype)
    dh = torch.randn(rows, inter, generator=gen).to(dtype)
    hc, qc, sc = ops.swiglu_fwd(gu, True, E4, e8m0, act)
    hg, qg, sg = ops.swiglu_fwd(gu.cuda(), True, E4, e8m0, act)
    assert torch.equal(qg.cpu().view(torch.uint8), qc.view(torch.uint8))
    assert torch.equal(sg.cpu(), sc)
    if act == ops.SILU:
        torch.testing.assert_close(hg.cpu(), hc, rtol=2**-7 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    else:
        assert_h_close(hg.cpu(), hc, gu, dtype)
    dc, h2c = ops.swiglu_bwd(qc, sc, dh, True, act)
    dg, h2g = ops.swiglu_bwd(qc.cuda(), sc.cuda(), dh.cuda(), True, act)
    tol = 4e-3 if dtype == torch.bfloat16 else 1e-5
    assert rel(dg.cpu(), dc) < tol and rel(h2g.cpu(), h2c) < tol


@pytest.mark.gpu
def test_gpu_unaligned(gen):
    buf = torch.randn(4 * 64 + 1, generator=gen).bfloat16().cuda()
    gu = buf[1:].view(4, 64)
    hg, qg, _ = ops.swiglu_fwd(gu, True, E4, False)
    hc, qc, _ = ops.swiglu_fwd(gu.cpu(), True, E4, False)
    assert torch.equal(qg.cpu().view(torch.uint8), qc.view(torch.uint8))
    torch.testing.assert_close(hg.cpu(), hc, rtol=2**-7, atol=1e-6)


@pytest.mark.gpu
def test_gpu_geglu_adversarial_matches_cpu():
    """Saturated tanh, fp32-overflowing g^3 and g^2, and NaN: CUDA and the CPU reference agree."""
    gu = _adversarial_gu()
    dh = torch.ones(2, 48)
    for dtype in (torch.bfloat16, torch.float32):
        x = gu.to(dtype)
        hc, qc, sc = ops.swiglu_fwd(x, True, E4, False, GELU)
        hg, qg, sg = ops.swiglu_fwd(x.cuda(), True, E4, False, GELU)
        assert torch.equal(qg.cpu().view(torch.uint8), qc.view(torch.uint8))
        assert_h_close(hg.cpu(), hc, x, dtype)
        dc, h2c = ops.swiglu_bwd(qc, sc, dh.to(dtype), True, GELU)
        dg, h2g = ops.swiglu_bwd(qg, sg, dh.to(dtype).cuda(), True, GELU)
        torch.testing.assert_close(dg.cpu(), dc, rtol=_tol(dtype), atol=4e-6, equal_nan=True)
        assert_h_close(h2g.cpu(), h2c, group_quant(x)[2], dtype)
