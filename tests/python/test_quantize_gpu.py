"""CUDA kernels of the quantize family against the CPU reference: bit-identical codes, scales and
dequantized values, on odd shapes, misaligned views (scalar paths) and large tensors."""

import pytest
import torch

import coat.functional as F
from test_quantize import DTYPES, nasty

pytestmark = pytest.mark.gpu

SHAPES = [(0,), (1,), (3, 7), (17, 129), (5, 3, 1000), (4099, 40), (1 << 20, 3)]


def same(a, b):
    a, b = a.cpu(), b.cpu()
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.is_floating_point():
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    assert torch.equal(a, b), f"{int((a != b).sum())} of {a.numel()} differ"


def misaligned(x):
    """A contiguous view whose data pointer is off the 16-byte grid: forces the scalar paths."""
    flat = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    flat[1:] = x.flatten()
    return flat[1:].view(x.shape)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("transpose", [False, True])
def test_per_tensor_amax_gpu_equals_cpu(fmt, dtype, shape, transpose, gen):
    if transpose and len(shape) < 2:
        shape = (*shape, 1)
    x = nasty(shape, dtype, gen, fmt)
    ref = F.quantize_per_tensor(x, fmt, transpose=transpose)
    for xg in (x.cuda(), misaligned(x.cuda())):
        got = F.quantize_per_tensor(xg, fmt, transpose=transpose)
        same(got.amax, ref.amax)
        same(got.scale, ref.scale)
        same(got.data, ref.data)
        if transpose:
            same(got.data_t, ref.data_t)
        given = F.quantize_per_tensor(xg, fmt, scale=ref.scale.cuda(), transpose=transpose)
        same(given.data, ref.data)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [16, 32, 64, 128])
@pytest.mark.parametrize("scale_kind", ["fp32", "e8m0"])
def test_per_group_gpu_equals_cpu(fmt, dtype, group, scale_kind, gen):
    for shape in [(1, group), (7, 3 * group), (1031, 2 * group)]:
        x = nasty(shape, dtype, gen, fmt)
        ref = F.quantize_per_group(x, group, fmt, scale_kind=scale_kind)
        for xg in (x.cuda(), misaligned(x.cuda())):
            got = F.quantize_per_group(xg, group, fmt, scale_kind=scale_kind)
            same(got.scale, ref.scale)
            same(got.data, ref.data)
            for out in DTYPES:
                same(got.dequantize(out), ref.dequantize(out))


@pytest.mark.parametrize("out", DTYPES)
def test_dequantize_per_tensor_gpu_equals_cpu(out, gen):
    for n in (0, 1, 9, 1000, 123457):
        x = torch.randn(n, generator=gen)
        ref = F.quantize_per_tensor(x, "e5m2")
        got = F.quantize_per_tensor(x.cuda(), "e5m2")
        same(got.dequantize(out), ref.dequantize(out))
        got.data = misaligned(got.data)
        same(got.dequantize(out), ref.dequantize(out))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 4096 + 77, 3_000_001])
def test_dre_gpu_equals_cpu(fmt, n, gen):
    x = torch.randn(n, generator=gen) * torch.logspace(-8, 2, max(n, 1))[:n]
    if n > 300:
        x[:128] = 0.25  # a constant group
        x[128:256:3] = 0.0
        x[200] = float("nan")
    ref = F.dre_quantize(x, fmt)
    for xg in (x.cuda(), misaligned(x.cuda())):
        got = F.dre_quantize(xg, fmt)
        same(got.gmax, ref.gmax)
        same(got.k16, ref.k16)
        same(got.data, ref.data)
        same(got.dequantize(), ref.dequantize())


def test_runs_on_the_current_stream_without_sync(gen):
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = F.quantize_per_tensor(x, "e4m3")
        y = t.dequantize(torch.bfloat16)
    s.synchronize()
    assert ((y.float() - x.float()).norm() / x.float().norm()) < 0.05


def test_cuda_graph_capture(gen):
    x = torch.randn(1000, 256, device="cuda")
    F.quantize_per_tensor(x)  # warm-up outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        t = F.quantize_per_tensor(x, "e4m3", transpose=True)
    x.copy_(torch.randn(1000, 256, generator=gen).cuda() * 7)
    g.replay()
    ref = F.quantize_per_tensor(x.cpu(), "e4m3", transpose=True)
    same(t.scale, ref.scale)
    same(t.data, ref.data)
    same(t.data_t, ref.data_t)


def test_device_mismatch_is_a_value_error():
    x = torch.randn(4, 32, device="cuda")
    with pytest.raises(ValueError, match="scale is on"):
        F.quantize_per_tensor(x, scale=torch.ones(1))
