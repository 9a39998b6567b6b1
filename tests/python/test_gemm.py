"""FP8 GEMM custom ops and the FP8 Linear layer on the CPU path (the C++ reference GEMM)."""

import pytest
import torch
import torch.nn as nn

from coat import functional as F
from coat._ops import gemm as G
from coat.nn import Fp8Linear, fp8_linear

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def quant(x, fmt):
    q = F.quantize_per_tensor(x.contiguous(), fmt)
    return q.data, q.scale


def emulate(a, b, sa, sb, bias=None):
    """Dequantize + matmul in float64: the exact value the fp32 GEMM approximates."""
    y = (a.double() @ b.double().t()) * (sa.double() * sb.double())
    return y if bias is None else y + bias.double()


SHAPES = [(1, 16, 16), (3, 5, 7), (33, 17, 130), (70, 67, 300), (0, 8, 16), (5, 0, 16)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("fa,fb", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")])
def test_fp32_matches_emulation(m, n, k, fa, fb, gen):
    a, sa = quant(torch.randn(m, k, generator=gen) * 3, fa)
    b, sb = quant(torch.randn(n, k, generator=gen), fb)
    y = G.fp8_gemm(a, b, sa, sb, None, torch.float32)
    assert y.shape == (m, n) and y.dtype == torch.float32
    if y.numel():
        # fp32 accumulation of exact products, K <= 300 terms: relative error well under 1e-5.
        assert rel(y, emulate(a, b, sa, sb)) < 1e-5


def test_bf16_output_with_bias(gen):
    m, n, k = 37, 48, 96
    a, sa = quant(torch.randn(m, k, generator=gen), "e4m3")
    b, sb = quant(torch.randn(n, k, generator=gen), "e4m3")
    bias = torch.randn(n, generator=gen).bfloat16()
    y = G.fp8_gemm(a, b, sa, sb, bias, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    want = emulate(a, b, sa, sb, bias.float())
    # One bf16 rounding of the fp32 result: |err| <= 2^-8 |y| elementwise.
    assert ((y.double() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()
    # Exactly the bf16 rounding of the fp32 output plus bias (same fp32 value, one rounding).
    y32 = G.fp8_gemm(a, b, sa, sb, None, torch.float32)
    assert torch.equal(y, (y32 + bias.float()).bfloat16())


def test_close_to_bf16_matmul(gen):
    # Per-tensor E4M3 on Gaussian data: ~2^-4 relative error per element, averaged by the sum.
    x = torch.randn(64, 256, generator=gen)
    w = torch.randn(96, 256, generator=gen) * 0.05
    a, sa = quant(x, "e4m3")
    b, sb = quant(w, "e4m3")
    y = G.fp8_gemm(a, b, sa, sb, None, torch.bfloat16)
    assert rel(y, x.bfloat16().float() @ w.bfloat16().float().t()) < 0.06


def test_amax_and_fp8_output(gen):
    a, sa = quant(torch.randn(20, 64, generator=gen), "e5m2")
    b, sb = quant(torch.randn(32, 64, generator=gen), "e4m3")
    y32 = G.fp8_gemm(a, b, sa, sb, None, torch.float32)
    y, amax = G.fp8_gemm_amax(a, b, sa, sb, None, torch.float32, None)
    assert torch.equal(y, y32) and amax.item() == y32.abs().max().item()
    out_scale = (y32.abs().max() / 448).reshape(1)
    q, amax8 = G.fp8_gemm_amax(a, b, sa, sb, None, E4, out_scale)
    assert q.dtype == E4 and amax8.item() == amax.item()
    want = F.quantize_per_tensor(y32, "e4m3", scale=out_scale).data
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))


# opcheck's test_schema multiplies the inputs, which torch cannot do for float8 on the CPU; the
# other four utilities run, and the no-mutation half of the schema check is done by hand.
OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")


def test_opcheck(gen):
    a, sa = quant(torch.randn(9, 32, generator=gen), "e4m3")
    b, sb = quant(torch.randn(16, 32, generator=gen), "e4m3")
    bias = torch.randn(16, generator=gen).bfloat16()
    cases = [
        (torch.ops.coat.fp8_gemm, (a, b, sa, sb, None, torch.float32)),
        (torch.ops.coat.fp8_gemm, (a, b, sa, sb, bias, torch.bfloat16)),
        (torch.ops.coat.fp8_gemm_amax, (a, b, sa, sb, bias, E4, sa.clone())),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=OPCHECK_UTILS)
        before = [t.view(torch.uint8).clone() if t.dtype in (E4, E5) else t.clone() for t in args if isinstance(t, torch.Tensor)]
        op(*args)
        after = [t.view(torch.uint8) if t.dtype in (E4, E5) else t for t in args if isinstance(t, torch.Tensor)]
        assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_bad_inputs(gen):
    a, sa = quant(torch.randn(8, 32, generator=gen), "e5m2")
    b5, sb = quant(torch.randn(16, 32, generator=gen), "e5m2")
    b4, _ = quant(torch.randn(16, 32, generator=gen), "e4m3")
    with pytest.raises(ValueError, match="both e5m2"):
        G.fp8_gemm(a, b5, sa, sb, None, torch.float32)
    with pytest.raises(ValueError, match="b must have the K of a"):
        G.fp8_gemm(a, b4[:, :16].contiguous(), sa, sb, None, torch.float32)
    with pytest.raises(ValueError, match="a must be contiguous"):
        G.fp8_gemm(a.t(), b4, sa, sb, None, torch.float32)
    with pytest.raises(ValueError, match="a must be float8"):
        G.fp8_gemm(a.float(), b4, sa, sb, None, torch.float32)
    with pytest.raises(ValueError, match="scale_b must be a float32"):
        G.fp8_gemm(a, b4, sa, sb.double(), None, torch.float32)
    with pytest.raises(ValueError, match="scale_a is on meta"):
        G.fp8_gemm(a, b4, sa.to("meta"), sb, None, torch.float32)
    with pytest.raises(ValueError, match="bias needs a bfloat16"):
        G.fp8_gemm(a, b4, sa, sb, torch.zeros(16, dtype=torch.bfloat16), torch.float32)
    with pytest.raises(ValueError, match="bias must be bfloat16 of shape"):
        G.fp8_gemm(a, b4, sa, sb, torch.zeros(15, dtype=torch.bfloat16), torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype must be"):
        G.fp8_gemm(a, b4, sa, sb, None, torch.float16)
    with pytest.raises(ValueError, match="out_scale is required"):
        G.fp8_gemm_amax(a, b4, sa, sb, None, E4, None)


# ---- Fp8Linear ------------------------------------------------------------------------------


def _pair(k, n, dtype, bias=True, seed=0):
    torch.manual_seed(seed)
    ref = nn.Linear(k, n, bias=bias).to(dtype)
    f8 = Fp8Linear(k, n, bias=bias).to(dtype)
    f8.load_state_dict(ref.state_dict())
    return ref, f8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,k,n", [((4, 7), 64, 48), ((50,), 40, 24), ((1, 1), 16, 16)])
def test_linear_matches_nn_linear(dtype, shape, k, n, gen):
    ref, f8 = _pair(k, n, dtype)
    x = torch.randn(*shape, k, generator=gen).to(dtype).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y, y8 = ref(x), f8(x2)
    assert y8.shape == y.shape and y8.dtype == y.dtype
    dy = torch.randn(y.shape, generator=gen).to(dtype)
    y.backward(dy)
    y8.backward(dy)
    assert x2.grad.dtype == dtype and f8.weight.grad.dtype == dtype
    # FP8 per-tensor levels: E4M3 forward (~4% on Gaussian data), E5M2 gradients (~6%).
    assert rel(y8, y) < 0.1
    assert rel(x2.grad, x.grad) < 0.1
    assert rel(f8.weight.grad, ref.weight.grad) < 0.1
    # dBias is a plain sum of dY (fp32 accumulation), no FP8 involved.
    assert rel(f8.bias.grad, ref.bias.grad) < 1e-2


def test_state_dict_and_from_linear():
    lin = nn.Linear(32, 16)
    w = lin.weight
    keys = set(lin.state_dict())
    f8 = Fp8Linear.from_linear(lin)
    assert f8 is lin and isinstance(f8, Fp8Linear) and f8.weight is w
    assert set(f8.state_dict()) == keys == {"weight", "bias"}
    with pytest.raises(ValueError, match="nn.Linear"):
        Fp8Linear.from_linear(nn.ReLU())


def test_saves_only_fp8_for_backward(gen):
    _, f8 = _pair(64, 32, torch.bfloat16)
    x = torch.randn(16, 64, generator=gen).bfloat16().requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        f8(x)
    # The parameters themselves are saved too (so that an in-place edit before backward is caught);
    # they cost nothing. Everything else of any size must be FP8.
    params = {p.data_ptr() for p in f8.parameters()}
    big = [t for t in saved if t.numel() > 1 and t.data_ptr() not in params]
    assert big and all(t.dtype in (E4, E5) for t in big), [(t.dtype, t.shape) for t in big]


def test_bad_linear_inputs():
    w = torch.randn(16, 32)
    with pytest.raises(ValueError, match="last dimension"):
        fp8_linear(torch.randn(4, 31), w)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        fp8_linear(torch.randn(4, 32).double(), w)


def test_compile_traces(gen):
    # aot_eager exercises dynamo + the fake implementations + autograd tracing without a C++
    # toolchain; tests/python/test_gemm_gpu.py compiles with inductor on CUDA.
    _, f8 = _pair(32, 16, torch.float32)
    model = nn.Sequential(f8, nn.ReLU())
    x = torch.randn(6, 32, generator=gen, requires_grad=True)
    eager = model(x)
    eager.sum().backward()
    gx, gw = x.grad.clone(), f8.weight.grad.clone()
    x.grad = None
    f8.weight.grad = None
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    assert torch.equal(out, eager)
    assert torch.equal(x.grad, gx) and torch.equal(f8.weight.grad, gw)


def test_no_grad_and_autocast(gen):
    _, f8 = _pair(32, 16, torch.float32)
    x = torch.randn(5, 32, generator=gen)
    y = f8(x)
    with torch.no_grad():
        assert torch.equal(f8(x), y)  # no transpose written, same result
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya = f8(x)
    assert ya.dtype == torch.bfloat16  # like nn.Linear under autocast
    assert rel(ya, y) < 1e-2  # bf16 rounding of the same fp32 GEMM result (+ bias added in bf16)
