"""RMSNorm with an FP8 saved input: the ops against a pure-torch emulation of the same
quantization (tight) and against the BF16 Hugging Face RMSNorm (stated tolerance)."""

import pytest
import torch
from _emu import group_quant, hf_rmsnorm, rel

from coat._ops import norm as ops
from coat.nn.norm import rms_norm

E4 = torch.float8_e4m3fn


@pytest.mark.parametrize("rows,cols", [(1, 16), (7, 48), (13, 80), (0, 32), (5, 208)])
@pytest.mark.parametrize("e8m0", [False, True])
def test_fwd_matches_emulation(gen, rows, cols, e8m0):
    x = (torch.randn(rows, cols, generator=gen) * 3).bfloat16()
    w = (1 + 0.1 * torch.randn(cols, generator=gen)).bfloat16()
    y, rstd, q, s = ops.rmsnorm_fwd(x, w, 1e-5, True, E4, e8m0)
    eq, es, _ = group_quant(x, e8m0)
    assert torch.equal(q.view(torch.uint8), eq.view(torch.uint8))  # FP8 codes bit-exact
    assert torch.equal(s, es)
    ers = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-5)
    torch.testing.assert_close(rstd, ers, rtol=4e-7, atol=0)  # fp32 summation order only
    # y: the HF rounding; rstd's last-ulp difference may flip one bf16 rounding
    torch.testing.assert_close(y, hf_rmsnorm(x, w, 1e-5), rtol=2**-7, atol=0)


def test_fwd_fp32_weight_and_no_quantize(gen):
    x = torch.randn(4, 32, generator=gen)
    w = torch.randn(32, generator=gen)
    y, rstd, q, s = ops.rmsnorm_fwd(x, w, 1e-6, False, E4, False)
    assert q.numel() == 0 and s.numel() == 0
    torch.testing.assert_close(y, hf_rmsnorm(x, w, 1e-6), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("e8m0", [False, True])
def test_recompute_and_bwd_match_emulation(gen, e8m0):
    rows, cols = 11, 80
    x = (torch.randn(rows, cols, generator=gen) * 2).bfloat16()
    w = (1 + 0.1 * torch.randn(cols, generator=gen)).bfloat16()
    dy = torch.randn(rows, cols, generator=gen).bfloat16()
    _, rstd, q, s = ops.rmsnorm_fwd(x, w, 1e-5, True, E4, e8m0)
    _, _, xd = group_quant(x, e8m0)
    y2 = ops.rmsnorm_fwd_fp8(q, s, rstd, w, torch.bfloat16)
    ey = ((xd * rstd[:, None]).bfloat16().float() * w.float()).bfloat16()
    assert torch.equal(y2, ey)  # elementwise with the same rstd: bit-exact
    dx, dw = ops.rmsnorm_bwd(q, s, rstd, w, dy)
    xh = xd.double() * rstd.double()[:, None]
    g = dy.double() * w.double()
    edx = rstd.double()[:, None] * (g - xh * (g * xh).mean(-1, keepdim=True))
    edw = (dy.double() * xh).sum(0)
    assert rel(dx, edx) < 4e-3  # bf16 output rounding
    assert dw.dtype == torch.float32 and rel(dw, edw) < 1e-5  # fp32 accumulation


def test_autograd_vs_bf16(gen):
    """FP8-saved input vs the BF16 HF norm: forward identical, grads within E4M3 error."""
    x = (torch.randn(2, 9, 96, generator=gen) * 4).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(96, generator=gen)).bfloat16().requires_grad_()
    dy = torch.randn(2, 9, 96, generator=gen).bfloat16()
    y = rms_norm(x, w, 1e-6)
    y.backward(dy)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = hf_rmsnorm(x2, w2, 1e-6)
    y2.backward(dy)
    torch.testing.assert_close(y, y2, rtol=2**-7, atol=0)
    # E4M3 keeps 3 mantissa bits: per-element error <= 2^-4, the norm-wise error ~2-3 %.
    assert rel(x.grad, x2.grad) < 0.05
    assert rel(w.grad, w2.grad) < 0.05


def test_odd_width_falls_back_to_bf16(gen):
    x = torch.randn(3, 40, generator=gen).bfloat16().requires_grad_()
    w = torch.ones(40, dtype=torch.bfloat16, requires_grad=True)
    y = rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y, hf_rmsnorm(x, w, 1e-6))
    y.float().sum().backward()
    assert x.grad is not None and w.grad is not None


def test_bad_inputs():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.rmsnorm_fwd(torch.randn(4, 24), torch.ones(24), 1e-6, True, E4, False)
    with pytest.raises(ValueError, match="weight"):
        ops.rmsnorm_fwd(x, torch.ones(16), 1e-6, True, E4, False)
    with pytest.raises(ValueError, match="eps"):
        ops.rmsnorm_fwd(x, torch.ones(32), -1.0, True, E4, False)
    with pytest.raises(ValueError, match="x must be"):
        ops.rmsnorm_fwd(x.to(torch.int32), torch.ones(32), 1e-6, True, E4, False)
    with pytest.raises(ValueError, match="contiguous"):
        ops.rmsnorm_fwd(torch.randn(32, 32).t(), torch.ones(32), 1e-6, False, E4, False)
    _, rstd, q, s = ops.rmsnorm_fwd(x, torch.ones(32), 1e-6, True, E4, False)
    with pytest.raises(ValueError, match="dy"):
        ops.rmsnorm_bwd(q, s, rstd, torch.ones(32), torch.randn(4, 16))
    with pytest.raises(ValueError, match="rstd"):
        ops.rmsnorm_bwd(q, s, rstd[:2], torch.ones(32), torch.randn(4, 32))


# ---- unit-offset weight (Gemma's norm): y = T(x * rstd * (1 + w)), one rounding -----------------------


def gemma_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face Gemma3RMSNorm.forward: normalize and scale by (1 + w) in fp32, round once."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).to(x.dtype)


def y_given_rstd(x, w, rstd, unit_offset: bool, dtype) -> torch.Tensor:
    """y from x and a given rstd, with either kind's rounding."""
    h = x.float() * rstd[..., None]
    if unit_offset:
        return (h * (1.0 + w.float())).to(dtype)
    return (h.to(dtype).float() * w.float()).to(dtype)


def e4m3_exact(gen, rows: int, cols: int, dtype) -> torch.Tensor:
    """Values the 1 x 16 E4M3 copy holds exactly (E4M3 codes, 448 in every group, so the group
    scale is 1 in fp32 and E8M0 alike): the backward then reads x itself, and autograd of the
    reference at x is the exact expectation."""
    x = (torch.randn(rows, cols, generator=gen) * 64).to(E4).float()
    x.view(rows, cols // 16, 16)[..., 0] = 448.0
    return x.to(dtype)


@pytest.mark.parametrize("rows,cols", [(1, 16), (7, 48), (13, 80), (0, 32), (5, 208)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("e8m0", [False, True])
def test_unit_offset_fwd_matches_gemma(gen, rows, cols, dtype, e8m0):
    x = (torch.randn(rows, cols, generator=gen) * 3).to(dtype)
    w = (0.1 * torch.randn(cols, generator=gen)).to(dtype)
    y, rstd, q, s = ops.rmsnorm_fwd(x, w, 1e-6, True, E4, e8m0, unit_offset=True)
    eq, es, _ = group_quant(x, e8m0)
    assert torch.equal(q.view(torch.uint8), eq.view(torch.uint8))  # the saved copy is unchanged
    assert torch.equal(s, es)
    torch.testing.assert_close(rstd, torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6), rtol=4e-7, atol=0)
    # With the same rstd the formula is elementwise: bit-exact, one rounding at the end.
    assert torch.equal(y, y_given_rstd(x, w, rstd, True, dtype))
    # Against the HF module itself, rstd's last-ulp difference may flip one rounding.
    torch.testing.assert_close(y, gemma_rmsnorm(x, w, 1e-6), rtol=2**-7 if dtype == torch.bfloat16 else 1e-6,
                               atol=0)


def test_unit_offset_zero_weight_is_plain_normalization(gen):
    """Gemma initializes the offset to 0: the unit-offset norm is then the scaled norm with w = 1."""
    x = (torch.randn(9, 64, generator=gen) * 2).bfloat16()
    a = ops.rmsnorm_fwd(x, torch.zeros(64, dtype=torch.bfloat16), 1e-6, True, E4, False, unit_offset=True)
    b = ops.rmsnorm_fwd(x, torch.ones(64, dtype=torch.bfloat16), 1e-6, True, E4, False)
    for u, v in zip(a, b):
        assert torch.equal(u.view(torch.uint8) if u.dtype == E4 else u, v.view(torch.uint8) if v.dtype == E4 else v)


@pytest.mark.parametrize("rows", [0, 1, 11])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("e8m0", [False, True])
def test_unit_offset_recompute_and_bwd_match_emulation(gen, rows, dtype, e8m0):
    cols = 80
    x = (torch.randn(rows, cols, generator=gen) * 2).to(dtype)
    w = (0.1 * torch.randn(cols, generator=gen)).to(dtype)
    dy = torch.randn(rows, cols, generator=gen).to(dtype)
    _, rstd, q, s = ops.rmsnorm_fwd(x, w, 1e-5, True, E4, e8m0, unit_offset=True)
    _, _, xd = group_quant(x, e8m0)
    y2 = ops.rmsnorm_fwd_fp8(q, s, rstd, w, dtype, unit_offset=True)
    assert torch.equal(y2, (xd * rstd[:, None] * (1.0 + w.float())).to(dtype))  # elementwise: bit-exact
    dx, dw = ops.rmsnorm_bwd(q, s, rstd, w, dy, unit_offset=True)
    xh = xd.double() * rstd.double()[:, None]
    g = dy.double() * (1.0 + w.double())
    edx = rstd.double()[:, None] * (g - xh * (g * xh).mean(-1, keepdim=True))
    edw = (dy.double() * xh).sum(0)
    assert dx.dtype == dtype and dw.dtype == torch.float32
    if rows == 0:
        assert dx.shape == (0, cols) and torch.equal(dw, torch.zeros(cols))
        return
    assert rel(dx, edx) < (4e-3 if dtype == torch.bfloat16 else 1e-5)  # bf16 output rounding
    assert rel(dw, edw) < 1e-5  # fp32 accumulation


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("e8m0", [False, True])
def test_unit_offset_bwd_is_autograd_of_gemma(gen, dtype, e8m0):
    """On inputs the FP8 copy holds exactly, dx and dw are autograd of Gemma3RMSNorm (in fp64)."""
    rows, cols = 7, 96
    x = e4m3_exact(gen, rows, cols, dtype)
    w = (0.1 * torch.randn(cols, generator=gen)).to(dtype)
    dy = torch.randn(rows, cols, generator=gen).to(dtype)
    _, rstd, q, s = ops.rmsnorm_fwd(x, w, 1e-6, True, E4, e8m0, unit_offset=True)
    assert torch.equal(group_quant(x, e8m0)[2], x.float())  # the premise: a lossless copy
    dx, dw = ops.rmsnorm_bwd(q, s, rstd, w, dy, unit_offset=True)
    xr = x.double().requires_grad_()
    wr = w.double().requires_grad_()
    hr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6)
    (hr * (1.0 + wr)).backward(dy.double())
    assert rel(dx, xr.grad) < (4e-3 if dtype == torch.bfloat16 else 1e-5)
    assert rel(dw, wr.grad) < 1e-5


def test_unit_offset_autograd_vs_bf16_gemma(gen):
    """The FP8-saved op pair against autograd of the BF16 Gemma norm on arbitrary inputs: the
    forward within one rounding, the gradients within the E4M3 error of the saved input."""
    x = (torch.randn(2, 9, 96, generator=gen) * 4).bfloat16()
    w = (0.1 * torch.randn(96, generator=gen)).bfloat16()
    dy = torch.randn(2, 9, 96, generator=gen).bfloat16()
    y, rstd, q, s = ops.rmsnorm_fwd(x.view(-1, 96), w, 1e-6, True, E4, False, unit_offset=True)
    dx, dw = ops.rmsnorm_bwd(q, s, rstd, w, dy.view(-1, 96), unit_offset=True)
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    y2 = gemma_rmsnorm(x2, w2, 1e-6)
    y2.backward(dy)
    torch.testing.assert_close(y.view_as(y2), y2, rtol=2**-7, atol=0)
    assert rel(dx.view_as(x2), x2.grad) < 0.05  # E4M3: ~2-3 % norm-wise, as the Llama norm
    assert rel(dw, w2.grad) < 0.05


def test_unit_offset_nan_propagates(gen):
    x = torch.randn(3, 32, generator=gen).bfloat16()
    x[1, 5] = float("nan")
    w = torch.zeros(32, dtype=torch.bfloat16)
    y = ops.rmsnorm_fwd(x, w, 1e-6, True, E4, False, unit_offset=True)[0]
    ref = gemma_rmsnorm(x, w, 1e-6)
    assert torch.equal(y.isnan(), ref.isnan()) and y[1].isnan().all() and not y[0].isnan().any()
    torch.testing.assert_close(y, ref, rtol=2**-7, atol=0, equal_nan=True)


def test_bad_norm_kind():
    from coat import _C

    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="norm_kind must be 0 \\(scaled\\) or 1 \\(unit_offset\\), got 2"):
        _C.rmsnorm_fwd(x, torch.ones(32), 1e-6, True, 0, False, 2, 0)


# test_schema compares FP8 tensors with ops torch lacks for float8 on CPU; the rest applies.
OPCHECK = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def test_opcheck(gen):
    x = torch.randn(3, 32, generator=gen).bfloat16()
    w = torch.ones(32, dtype=torch.bfloat16)
    torch.library.opcheck(ops.rmsnorm_fwd, (x, w, 1e-6, True, E4, False), test_utils=OPCHECK)
    _, rstd, q, s = ops.rmsnorm_fwd(x, w, 1e-6, True, E4, False)
    torch.library.opcheck(ops.rmsnorm_fwd_fp8, (q, s, rstd, w, torch.bfloat16), test_utils=OPCHECK)
    torch.library.opcheck(ops.rmsnorm_bwd, (q, s, rstd, w, torch.randn(3, 32).bfloat16()), test_utils=OPCHECK)


def test_opcheck_unit_offset(gen):
    x = torch.randn(3, 32, generator=gen).bfloat16()
    w = (0.1 * torch.randn(32, generator=gen)).bfloat16()
    kw = {"unit_offset": True}
    torch.library.opcheck(ops.rmsnorm_fwd, (x, w, 1e-6, True, E4, True), kw, test_utils=OPCHECK)
    _, rstd, q, s = ops.rmsnorm_fwd(x, w, 1e-6, True, E4, True, unit_offset=True)
    torch.library.opcheck(ops.rmsnorm_fwd_fp8, (q, s, rstd, w, torch.float32), kw, test_utils=OPCHECK)
    torch.library.opcheck(ops.rmsnorm_bwd, (q, s, rstd, w, torch.randn(3, 32).bfloat16()), kw, test_utils=OPCHECK)


def test_compiled_unit_offset_matches_eager(gen):
    """The schemas and fakes carry the kind through torch.compile."""
    x = torch.randn(5, 48, generator=gen).bfloat16()
    w = (0.1 * torch.randn(48, generator=gen)).bfloat16()
    dy = torch.randn(5, 48, generator=gen).bfloat16()

    def step(x, w, dy):
        y, rstd, q, s = ops.rmsnorm_fwd(x, w, 1e-6, True, E4, False, unit_offset=True)
        dx, dw = ops.rmsnorm_bwd(q, s, rstd, w, dy, unit_offset=True)
        return y, ops.rmsnorm_fwd_fp8(q, s, rstd, w, torch.bfloat16, unit_offset=True), dx, dw

    for a, b in zip(torch.compile(step, fullgraph=True, backend="aot_eager")(x, w, dy), step(x, w, dy)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols", [(1, 16), (37, 80), (300, 4096), (5, 13312), (3, 20480)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_gpu_matches_cpu(gen, rows, cols, dtype, unit_offset):
    x = (torch.randn(rows, cols, generator=gen) * 2).to(dtype)
    w = ((0 if unit_offset else 1) + 0.1 * torch.randn(cols, generator=gen)).to(dtype)
    dy = torch.randn(rows, cols, generator=gen).to(dtype)
    uo = unit_offset
    c = ops.rmsnorm_fwd(x, w, 1e-5, True, E4, False, uo)
    g = ops.rmsnorm_fwd(x.cuda(), w.cuda(), 1e-5, True, E4, False, uo)
    assert torch.equal(g[2].cpu().view(torch.uint8), c[2].view(torch.uint8))
    assert torch.equal(g[3].cpu(), c[3])
    # rstd: the GPU sums squares as a tree, the CPU in order: ~sqrt(cols) ulp apart.
    torch.testing.assert_close(g[1].cpu(), c[1], rtol=2e-5, atol=0)
    # y = x * rstd * w: rstd's tree-vs-sequential difference can tip a bf16 rounding by one ulp.
    torch.testing.assert_close(g[0].cpu(), c[0], rtol=2**-6, atol=0)
    # recompute and backward from the same saved tensors
    # given the kernel's own rstd, y is elementwise: bit-exact
    assert torch.equal(g[0], y_given_rstd(x.cuda(), w.cuda(), g[1], uo, dtype))
    y_c = ops.rmsnorm_fwd_fp8(c[2], c[3], c[1], w, dtype, uo)
    y_g = ops.rmsnorm_fwd_fp8(c[2].cuda(), c[3].cuda(), c[1].cuda(), w.cuda(), dtype, uo)
    assert torch.equal(y_g.cpu(), y_c)
    dx_c, dw_c = ops.rmsnorm_bwd(c[2], c[3], c[1], w, dy, uo)
    dx_g, dw_g = ops.rmsnorm_bwd(c[2].cuda(), c[3].cuda(), c[1].cuda(), w.cuda(), dy.cuda(), uo)
    assert rel(dx_g.cpu(), dx_c) < 4e-3 if dtype == torch.bfloat16 else rel(dx_g.cpu(), dx_c) < 1e-5
    assert rel(dw_g.cpu(), dw_c) < 1e-5
    dx_g2, dw_g2 = ops.rmsnorm_bwd(c[2].cuda(), c[3].cuda(), c[1].cuda(), w.cuda(), dy.cuda(), uo)
    assert torch.equal(dw_g2, dw_g) and torch.equal(dx_g2, dx_g)  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("unit_offset", [False, True])
def test_gpu_unaligned(gen, unit_offset):
    buf = torch.randn(3 * 48 + 1, generator=gen).bfloat16().cuda()
    x = buf[1:].view(3, 48)  # 2-byte offset: scalar path
    w = torch.ones(48, dtype=torch.bfloat16, device="cuda")
    g = ops.rmsnorm_fwd(x, w, 1e-6, True, E4, True, unit_offset)
    c = ops.rmsnorm_fwd(x.cpu(), w.cpu(), 1e-6, True, E4, True, unit_offset)
    assert torch.equal(g[2].cpu().view(torch.uint8), c[2].view(torch.uint8))
    # y = x * rstd * w: rstd's tree-vs-sequential difference can tip a bf16 rounding by one ulp.
    torch.testing.assert_close(g[0].cpu(), c[0], rtol=2**-6, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_unit_offset_bwd_is_autograd_of_gemma(gen, dtype):
    """The CUDA backward on inputs the FP8 copy holds exactly, against fp64 autograd."""
    rows, cols = 37, 4096
    x = e4m3_exact(gen, rows, cols, dtype).cuda()
    w = (0.1 * torch.randn(cols, generator=gen)).to(dtype).cuda()
    dy = torch.randn(rows, cols, generator=gen).to(dtype).cuda()
    _, rstd, q, s = ops.rmsnorm_fwd(x, w, 1e-6, True, E4, False, True)
    dx, dw = ops.rmsnorm_bwd(q, s, rstd, w, dy, True)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + wr)).backward(dy.double())
    assert rel(dx, xr.grad) < (4e-3 if dtype == torch.bfloat16 else 1e-5)
    assert rel(dw, wr.grad) < 1e-5
