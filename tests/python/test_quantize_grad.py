"""dequantize(quantize(x)) under autograd: differentiable as a cast is (the gradient passes
straight through the rounding, the scale is a constant), with a zero gradient where a caller-given
scale saturated x, as through a clamp; the values are those of the non-differentiable call, bit
for bit."""

from __future__ import annotations

import pytest
import torch

import coat.functional as F

QUANTIZERS = {
    "per_tensor": lambda x: F.quantize_per_tensor(x),
    "per_tensor_t": lambda x: F.quantize_per_tensor(x, "e5m2", transpose=True),
    "per_group": lambda x: F.quantize_per_group(x, 16),
    "per_group_e8m0": lambda x: F.quantize_per_group(x, 128, scale_kind="e8m0"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_round_trip_passes_the_gradient_straight_through(name, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 384, generator=g).to(dtype).requires_grad_()
    w = torch.randn(5, 384, generator=g)
    t = QUANTIZERS[name](x)
    y = F.dequantize(t)
    with torch.no_grad():
        assert torch.equal(y, F.dequantize(QUANTIZERS[name](x)))  # the same values as without autograd
    (gx,) = torch.autograd.grad((y * w).sum(), x)
    # Straight through: the upstream gradient itself, in x's dtype (torch's own cast round trip
    # also passes it through, though rounded to FP8 on the way back).
    assert gx.dtype == dtype and torch.equal(gx, w.to(dtype))


def test_dre_round_trip_passes_the_gradient_straight_through():
    x = torch.randn(3, 200).requires_grad_()
    w = torch.randn(3, 200)
    y = F.dre_dequantize(F.dre_quantize(x))
    (gx,) = torch.autograd.grad((y * w).sum(), x)
    assert torch.equal(gx, w)
    assert F.dequantize(F.dre_quantize(x), torch.bfloat16).requires_grad


@pytest.mark.parametrize("fmt,fmax", [("e4m3", 448.0), ("e5m2", 57344.0)])
def test_saturated_elements_get_no_gradient(fmt, fmax):
    # A given scale saturates |x| > fmt_max * scale: the gradient of torch's clamp-then-cast reference.
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 256, generator=g) * 4).requires_grad_()
    w = torch.randn(4, 256, generator=g)
    scale = torch.tensor([2.0 / fmax])
    y = F.dequantize(F.quantize_per_tensor(x, fmt, scale=scale), torch.bfloat16)
    (gx,) = torch.autograd.grad((y.float() * w).sum(), x)
    # The clamp's gradient: w where |x| <= fmt_max * scale, else 0 (w itself passes unrounded)
    ref = torch.where(x.detach().abs() <= fmax * scale, w.bfloat16().float(), 0.0)
    assert 0 < int((gx == 0).sum()) < x.numel()  # some saturated, some not
    assert torch.equal(gx, ref)


def test_no_graph_without_grad():
    x = torch.randn(2, 128)
    assert not F.dequantize(F.quantize_per_tensor(x)).requires_grad
    xg = x.clone().requires_grad_()
    with torch.no_grad():
        t = F.quantize_per_tensor(xg)
    assert t.source is None and not F.dequantize(t).requires_grad
    t = F.quantize_per_group(xg, 128)
    with torch.no_grad():
        assert not F.dequantize(t).requires_grad
    assert "source" not in repr(t)
