"""FP8 GEMM and Fp8Linear on CUDA, against the CPU reference, torch._scaled_mm and nn.Linear.

Tolerances: the CPU reference and cuBLASLt both sum exact FP8 products in fp32 and differ only in
summation order, so an fp32 output agrees to (K + 8) * 2^-23 * sum_k |a_k b_k| * sa * sb per
element ("bound" below); a bf16 output adds one bf16 rounding (2^-8 |y|, doubled for the case where
the two fp32 values straddle a rounding boundary); an e4m3 output adds one e4m3 step (2^-3 |y|).
"""

import pytest
import torch
import torch.nn as nn

from coat import functional as F
from coat._ops import gemm as G
from coat.nn import Fp8Linear

pytestmark = pytest.mark.gpu

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
DEV = "cuda"


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def quant(x, fmt):
    q = F.quantize_per_tensor(x.contiguous(), fmt)
    return q.data, q.scale


def operands(m, n, k, fa, fb, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    a, sa = quant(torch.randn(m, k, device=DEV, generator=g) * 3, fa)
    b, sb = quant(torch.randn(n, k, device=DEV, generator=g), fb)
    return a, b, sa, sb


def bound(a, b, sa, sb):
    """Per-element bound, computed in float64 on the CPU: Hopper's FP8 tensor cores keep only about
    14 bits of the running sum between cuBLASLt's fp32 promotions (DeepSeek-V3 reports the same),
    so the GPU differs from the fp32 CPU sum by up to ~2^-13 of sum |a||b|, not ~K ulp."""
    mag = a.cpu().double().abs() @ b.cpu().double().abs().t() * (sa.item() * sb.item())
    return (a.shape[1] + 8) * 2.0**-23 * mag + 2.0**-12 * mag + 1e-30


def cpu(t):
    return None if t is None else t.cpu()


SHAPES = [(1, 16, 16), (37, 48, 160), (129, 272, 528), (600, 1040, 2048), (8, 4096, 1024)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("fa,fb", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")])
@pytest.mark.parametrize("bf16_path", [False, True])
def test_matches_cpu_reference(m, n, k, fa, fb, bf16_path):
    a, b, sa, sb = operands(m, n, k, fa, fb, seed=m + n + k)
    with G.force_bf16(bf16_path):
        y = G.fp8_gemm(a, b, sa, sb, None, torch.float32)
    want = G.fp8_gemm(cpu(a), cpu(b), cpu(sa), cpu(sb), None, torch.float32)
    assert ((y.cpu().double() - want.double()).abs() <= bound(a, b, sa, sb)).all()


@pytest.mark.parametrize("m,n,k", SHAPES[1:])
@pytest.mark.parametrize("fa", ["e4m3", "e5m2"])
def test_matches_scaled_mm(m, n, k, fa):
    a, b, sa, sb = operands(m, n, k, fa, "e4m3", seed=7)
    y = G.fp8_gemm(a, b, sa, sb, None, torch.float32)
    ref = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    tol = bound(a, b, sa, sb).to(DEV)
    assert ((y.double() - ref.double()).abs() <= tol).all()
    y16 = G.fp8_gemm(a, b, sa, sb, None, torch.bfloat16)
    ref16 = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    assert ((y16.double() - ref16.double()).abs() <= ref16.double().abs() * 2**-7 + tol).all()


@pytest.mark.parametrize("bf16_path", [False, True])
def test_bias_and_amax_epilogues(bf16_path):
    m, n, k = 77, 96, 336
    a, b, sa, sb = operands(m, n, k, "e4m3", "e4m3", seed=3)
    bias = (torch.randn(n, device=DEV) * 10).bfloat16()
    tol = bound(a, b, sa, sb) + bias.cpu().double().abs() * 2**-23
    with G.force_bf16(bf16_path):
        y, amax = G.fp8_gemm_amax(a, b, sa, sb, bias, torch.bfloat16, None)
        y_plain = G.fp8_gemm(a, b, sa, sb, bias, torch.bfloat16)
    want = G.fp8_gemm(cpu(a), cpu(b), cpu(sa), cpu(sb), cpu(bias), torch.bfloat16).double()
    assert torch.equal(y, y_plain)
    assert ((y.cpu().double() - want).abs() <= want.abs() * 2**-7 + tol).all()
    # bf16 output: amax is read back from the stored output.
    assert amax.item() == y.float().abs().max().item()

    # e4m3 output: cuBLASLt's fused amax (before the D scale) and the quantized codes.
    ref32 = G.fp8_gemm(cpu(a), cpu(b), cpu(sa), cpu(sb), None, torch.float32)
    ref_y = ref32.double() + bias.cpu().double()
    out_scale = (ref_y.abs().max() / 448).float().reshape(1).to(DEV)
    with G.force_bf16(bf16_path):
        q, amax8 = G.fp8_gemm_amax(a, b, sa, sb, bias, E4, out_scale)
    assert q.dtype == E4
    # FP8 tensor-core accumulation (see bound()) moves the max by up to ~2^-13 relative.
    assert abs(amax8.item() - ref_y.abs().max().item()) <= 2.0**-11 * ref_y.abs().max().item()
    got = q.cpu().double() * out_scale.item()
    assert ((got - ref_y).abs() <= ref_y.abs() * 2**-3 + tol + out_scale.item() * 2**-9).all()


def test_zero_sizes():
    a, b, sa, sb = operands(3, 16, 0, "e4m3", "e4m3")
    bias = torch.randn(16, device=DEV).bfloat16()
    y, amax = G.fp8_gemm_amax(a, b, sa, sb, bias, torch.bfloat16, None)
    assert torch.equal(y, bias.expand(3, 16))
    assert amax.item() == bias.float().abs().max().item()
    a, b, sa, sb = operands(0, 32, 64, "e4m3", "e4m3")
    y, amax = G.fp8_gemm_amax(a, b, sa, sb, None, torch.float32, None)
    assert y.shape == (0, 32) and amax.item() == 0.0


def test_unaligned_and_bad_inputs():
    a, b, sa, sb = operands(8, 32, 24, "e4m3", "e4m3")
    with pytest.raises(ValueError, match="multiple of 16"):
        G.fp8_gemm(a, b, sa, sb, None, torch.float32)
    a, b, sa, sb = operands(8, 24, 32, "e4m3", "e4m3")
    with pytest.raises(ValueError, match="multiple of 16"):
        G.fp8_gemm(a, b, sa, sb, None, torch.float32)
    a, b, sa, sb = operands(8, 32, 32, "e5m2", "e5m2")
    with pytest.raises(ValueError, match="both e5m2"):
        G.fp8_gemm(a, b, sa, sb, None, torch.float32)
    a, b, sa, sb = operands(8, 32, 32, "e4m3", "e4m3")
    with pytest.raises(ValueError, match="scale_a is on cpu"):
        G.fp8_gemm(a, b, sa.cpu(), sb, None, torch.float32)


def test_misaligned_views_are_copied():
    a, b, sa, sb = operands(9, 32, 32, "e4m3", "e4m3")
    a_off = torch.empty(9 * 32 + 1, dtype=E4, device=DEV)[1:].view(9, 32)
    a_off.copy_(a)
    assert a_off.data_ptr() % 16 != 0
    assert torch.equal(G.fp8_gemm(a_off, b, sa, sb, None, torch.float32), G.fp8_gemm(a, b, sa, sb, None, torch.float32))


# ---- Fp8Linear ------------------------------------------------------------------------------


def _pair(k, n, dtype, device=DEV, seed=0):
    torch.manual_seed(seed)
    ref = nn.Linear(k, n).to(device=device, dtype=dtype)
    f8 = Fp8Linear(k, n).to(device=device, dtype=dtype)
    f8.load_state_dict(ref.state_dict())
    return ref, f8


@pytest.mark.parametrize("tokens", [(2, 300), (4, 64)])  # 600 % 16 != 0: dW takes the bf16 route
def test_linear_vs_nn_linear_bf16(tokens):
    ref, f8 = _pair(256, 384, torch.bfloat16)
    x = torch.randn(*tokens, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y8 = ref(x), f8(x2)
    dy = torch.randn_like(y)
    y.backward(dy)
    y8.backward(dy)
    # FP8 per-tensor levels: E4M3 forward (~4% on Gaussian data), E5M2 gradients (~6%).
    assert rel(y8, y) < 0.1
    assert rel(x2.grad, x.grad) < 0.1
    assert rel(f8.weight.grad, ref.weight.grad) < 0.1
    assert rel(f8.bias.grad, ref.bias.grad) < 1e-2


def test_linear_cuda_matches_cpu_path():
    # Quantization is bit-identical on CPU and GPU, so with fp32 parameters the two paths differ by
    # GEMM summation order only (and the bias-gradient sum order).
    _, f_gpu = _pair(128, 96, torch.float32)
    _, f_cpu = _pair(128, 96, torch.float32, device="cpu")
    x = torch.randn(64, 128, requires_grad=True)
    xg = x.detach().to(DEV).requires_grad_()
    dy = torch.randn(64, 96)
    y_c, y_g = f_cpu(x), f_gpu(xg)
    y_c.backward(dy)
    y_g.backward(dy.to(DEV))
    # FP8 tensor-core accumulation keeps ~14 bits between promotions (see bound()).
    assert rel(y_g.cpu(), y_c) < 1e-3
    assert rel(xg.grad.cpu(), x.grad) < 1e-3
    assert rel(f_gpu.weight.grad.cpu(), f_cpu.weight.grad) < 1e-3
    assert rel(f_gpu.bias.grad.cpu(), f_cpu.bias.grad) < 1e-5


def test_unaligned_layer_is_zero_padded():
    # cuBLASLt FP8 needs K and N to be multiples of 16: the codes are zero-padded (zeros add
    # nothing to the products), so the layer keeps FP8 numerics and matches the CPU path.
    _, f8 = _pair(40, 24, torch.float32)
    _, f_cpu = _pair(40, 24, torch.float32, device="cpu")
    x = torch.randn(5, 40)
    assert rel(f8(x.to(DEV)).cpu(), f_cpu(x)) < 1e-3


def test_torch_compile_inductor():
    torch.manual_seed(0)
    model = nn.Sequential(Fp8Linear(256, 512), nn.ReLU(), Fp8Linear(512, 256)).to(DEV, torch.bfloat16)
    x = torch.randn(8, 64, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    y = model(x)
    y.float().square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    compiled = torch.compile(model, fullgraph=True)
    yc = compiled(x)
    yc.float().square().sum().backward()
    grads_c = [p.grad for p in model.parameters()] + [x.grad]
    # Same custom ops on the same values (ReLU is exact): only the bias-gradient sums and the
    # inductor-generated casts may be ordered differently.
    assert rel(yc, y) < 1e-3
    for gc, ge in zip(grads_c, grads):
        assert rel(gc, ge) < 1e-2
