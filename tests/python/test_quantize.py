"""coat.functional quantization on the CPU path: bit-exactness against torch's casts, layouts,
Dynamic Range Expansion and argument errors. The GPU path is checked against this one in
test_quantize_gpu.py."""

import math

import pytest
import torch

import coat.functional as F
from coat._ops import quantize as qops

FMTS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def codes(t):
    return t.view(torch.uint8)


def torch_cast(x32, fmt):
    """torch's cast after clamping: torch does not saturate, coat does."""
    dt, mx = FMTS[fmt]
    return x32.clamp(-mx, mx).to(dt)


def assert_same_codes(ours, ref):
    """Equal codes, with NaN compared as NaN (coat writes the canonical 0x7F for every NaN)."""
    a, b = codes(ours).flatten(), codes(ref).flatten()
    nan_ref = torch.isnan(ref.float()).flatten()
    assert torch.isnan(ours.float()).flatten().eq(nan_ref).all()
    mismatch = (a != b) & ~nan_ref
    assert not mismatch.any(), f"{int(mismatch.sum())} codes differ, first at {mismatch.nonzero()[:5].flatten().tolist()}"


def nasty(shape, dtype, gen, fmt="e4m3"):
    """Random data with NaN, infinities, subnormals, exact ties and zeros mixed in."""
    x = torch.randn(shape, generator=gen) * 3
    flat = x.view(-1)
    n = flat.numel()
    if n >= 8:
        idx = torch.randperm(n, generator=gen)
        k = max(1, n // 16)
        flat[idx[:k]] = float("nan")
        flat[idx[k : 2 * k]] = torch.randn(k, generator=gen) * 1e-40  # fp32 subnormals
        flat[idx[2 * k : 3 * k]] = 0.0
        flat[idx[3 * k]] = float("inf")
        # Midpoints between neighbouring FP8 values (ties) once scaled: pick codes, average.
        dt, _ = FMTS[fmt]
        c = torch.randint(0, 0x7D, (k,), generator=gen, dtype=torch.uint8)
        lo = c.view(dt).float()
        hi = (c + 1).view(dt).float()
        flat[idx[4 * k : 5 * k]] = (lo + hi) / 2
    return x.to(dtype)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_code_round_trips(fmt):
    dt, mx = FMTS[fmt]
    all_codes = torch.arange(256, dtype=torch.uint8).view(dt)
    one = torch.ones(1)
    y = F.dequantize(F.Fp8Tensor(all_codes, one), torch.float32)
    q = F.quantize_per_tensor(y, fmt, scale=one).data
    finite = torch.isfinite(y)
    assert torch.equal(codes(q)[finite], torch.arange(256, dtype=torch.uint8)[finite])
    assert (codes(q)[torch.isnan(y)] == 0x7F).all()
    if fmt == "e5m2":  # infinities saturate to the largest finite value
        assert torch.equal(q.float()[torch.isinf(y)], torch.sign(y[torch.isinf(y)]) * mx)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (7, 33), (3, 5, 129), (1000,)])
def test_per_tensor_matches_torch_cast(fmt, dtype, shape, gen):
    x = nasty(shape, dtype, gen, fmt)
    t = F.quantize_per_tensor(x, fmt)
    finite = x.float()[torch.isfinite(x.float())]
    amax = finite.abs().max() if finite.numel() else torch.tensor(0.0)
    assert t.amax.item() == amax.item()
    expect_scale = (amax / FMTS[fmt][1]).clamp_min(2.0**-126) if amax > 0 else torch.tensor(1.0)
    assert t.scale.item() == expect_scale.item()
    ref = torch_cast(x.float() * (1.0 / t.scale), fmt)
    assert_same_codes(t.data, ref)
    # A given scale gives the same codes.
    t2 = F.quantize_per_tensor(x, fmt, scale=t.scale.clone())
    assert torch.equal(codes(t2.data), codes(t.data))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (65, 130), (2, 3, 70)])
def test_transposed_output(dtype, shape, gen):
    x = nasty(shape, dtype, gen)
    t = F.quantize_per_tensor(x, "e4m3", transpose=True)
    k = shape[-1]
    assert t.data_t.shape == (k, x.numel() // k)
    assert torch.equal(codes(t.data_t), codes(t.data).reshape(-1, k).t())
    t2 = F.quantize_per_tensor(x, "e5m2", scale=torch.tensor([0.25]), transpose=True)
    assert torch.equal(codes(t2.data_t), codes(t2.data).reshape(-1, k).t())


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [16, 32, 64, 128])
@pytest.mark.parametrize("e8m0", [False, True])
def test_per_group_matches_emulation(fmt, dtype, group, e8m0, gen):
    x = nasty((5, 3 * group), dtype, gen, fmt)
    t = F.quantize_per_group(x, group, fmt, scale_kind="e8m0" if e8m0 else "fp32")
    g = x.float().reshape(5, 3, group)
    a = torch.where(torch.isfinite(g), g.abs(), torch.zeros_like(g)).amax(-1)
    mx = FMTS[fmt][1]
    if e8m0:
        assert t.scale.dtype == torch.uint8
        s = t.scale_float()
        ok = a > 0
        assert (s[ok] * mx >= a[ok]).all() and (s[ok] * mx / 2 < a[ok]).all()
        assert (s[~ok] == 1).all()
    else:
        s = torch.where(a > 0, (a / mx).clamp_min(2.0**-126), torch.ones_like(a))
        assert torch.equal(t.scale, s)
    ref = torch_cast(g * (1.0 / s).unsqueeze(-1), fmt).reshape(x.shape)
    assert_same_codes(t.data, ref)
    y = t.dequantize(torch.float32)
    expect = t.data.float().reshape(5, 3, group) * s.unsqueeze(-1)
    assert torch.equal(y.reshape(5, 3, group).nan_to_num(7.0), expect.nan_to_num(7.0))


@pytest.mark.parametrize("out", DTYPES)
def test_dequantize_per_tensor(out, gen):
    x = torch.randn(9, 31, generator=gen)
    t = F.quantize_per_tensor(x, "e4m3")
    y = F.dequantize(t, out)
    assert y.dtype == out
    assert torch.equal(y, (t.data.float() * t.scale).to(out))
    assert ((y.float() - x).norm() / x.norm()) < 0.05


def _moments():
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "fixtures" / "adamw_moments.pt"
    return torch.load(path)["tensors"]


def test_dre_beats_plain_e4m3_on_real_moments():
    """Adam moments of a real run of the built-in model (tests/fixtures/make_moments.py): the
    relative error of DRE-E4M3 against plain per-group (1x128) E4M3."""
    tensors = _moments()
    ratios = {}
    for name in ("exp_avg", "exp_avg_sq"):
        num_dre = num_plain = den = 0.0
        for st in tensors.values():
            x = st[name].float().flatten()
            y_dre = F.dre_quantize(x, "e4m3").dequantize()
            pad = (-x.numel()) % 128
            xp = torch.cat([x, x.new_zeros(pad)]).reshape(-1, 128)
            y_plain = F.quantize_per_group(xp, 128, "e4m3").dequantize().flatten()[: x.numel()]
            num_dre += (y_dre - x).pow(2).sum().item()
            num_plain += (y_plain - x).pow(2).sum().item()
            den += x.pow(2).sum().item()
        ratios[name] = math.sqrt(num_plain / den) / math.sqrt(num_dre / den)
        print(f"{name}: relative error plain E4M3 {math.sqrt(num_plain/den):.4f}, "
              f"DRE {math.sqrt(num_dre/den):.4f}, ratio {ratios[name]:.2f}x")
    assert ratios["exp_avg"] > 1.2
    assert ratios["exp_avg_sq"] > 1.0


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000])
def test_dre_properties(fmt, n, gen):
    x = torch.randn(n, generator=gen) * torch.logspace(-6, 1, max(n, 1))[:n]
    if n > 3:
        x[0] = 0.0
        x[2] = -x[1]
    d = F.dre_quantize(x, fmt)
    groups = (n + 127) // 128
    assert d.gmax.shape == (groups,) and d.k16.shape == (groups,)
    assert ((d.k16 >= 1) & (d.k16 <= 255)).all()  # k < 1 compresses groups wider than the format
    y = d.dequantize()
    assert torch.isfinite(y).all()
    assert (y[x == 0] == 0).all()
    assert (y[x != 0] != 0).all()
    for g in range(groups):
        xs = x[g * 128 : (g + 1) * 128]
        assert d.gmax[g].item() == xs.abs().max().item()
    at_max = x.abs() == d.gmax.repeat_interleave(128)[:n]
    assert torch.equal(y[at_max], x[at_max])
    if n:
        assert ((y - x).norm() / x.norm().clamp_min(1e-30)) < 0.1


def test_dre_constant_groups_are_exact():
    x = torch.full((300,), -0.3)
    x[::7] = 0.0
    x[5] = 0.3
    y = F.dre_quantize(x).dequantize()
    assert torch.equal(y, x)


def test_dre_extreme_finite_inputs_stay_finite(gen):
    bits = torch.randint(0, 0x7F7FFFFF, (128 * 32,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32) * torch.where(torch.rand(bits.shape, generator=gen) < 0.5, -1.0, 1.0)
    for fmt in ("e4m3", "e5m2"):
        y = F.dre_quantize(x, fmt).dequantize()
        assert torch.isfinite(y).all()


def test_opcheck_every_op(gen):
    x = torch.randn(4, 64, generator=gen, dtype=torch.bfloat16)
    s = torch.tensor([0.01])
    q = F.quantize_per_tensor(x).data.view(torch.uint8)
    qg, sg = qops.quantize_per_group(x, 32, 0, False)
    xd = torch.randn(300, generator=gen)
    dq, dg, dk = qops.dre_quantize(xd, 0, 16.6)
    cases = [
        (qops.quantize_per_tensor, (x, s, 0)),
        (qops.quantize_per_tensor_t, (x, s, 1)),
        (qops.quantize_per_tensor_amax, (x, 0, True)),
        (qops.quantize_per_tensor_amax, (x.float(), 1, False)),
        (qops.dequantize_per_tensor, (q, s, 0, torch.bfloat16)),
        (qops.quantize_per_group, (x, 32, 0, True)),
        (qops.dequantize_per_group, (qg, sg, 32, 0, torch.float32)),
        (qops.dre_quantize, (xd, 0, 16.6)),
        (qops.dre_dequantize, (dq, dg, dk, 0)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_bad_inputs_name_the_argument():
    x = torch.randn(4, 48)
    with pytest.raises(ValueError, match="x must be float32, bfloat16, float16"):
        F.quantize_per_tensor(x.to(torch.int32))
    with pytest.raises(ValueError, match="x must be contiguous"):
        F.quantize_per_tensor(x.t())
    with pytest.raises(ValueError, match="group_size 32 does not divide the last dimension of x"):
        F.quantize_per_group(x, 32)
    with pytest.raises(ValueError, match="group_size must be one of"):
        F.quantize_per_group(x, 24)
    with pytest.raises(ValueError, match="fmt must be"):
        F.quantize_per_tensor(x, "e3m4")
    with pytest.raises(ValueError, match="scale must be a float32 tensor with one element"):
        F.quantize_per_tensor(x, scale=torch.ones(2))
    with pytest.raises(ValueError, match="scale_kind"):
        F.quantize_per_group(x, 16, scale_kind="int8")
    with pytest.raises(ValueError, match="x must be float32"):
        F.dre_quantize(x.bfloat16())
    with pytest.raises(ValueError, match="log2_range"):
        F.dre_quantize(x, log2_range=-1)
    # The op layer names arguments too (shape checks in the compiled bindings).
    q = torch.empty(4, 48, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scales must have 12 elements"):
        qops.dequantize_per_group(q, torch.ones(5), 16, 0, torch.float32)
    with pytest.raises(ValueError, match="scale must have 1 elements"):
        qops.dequantize_per_tensor(q, torch.ones(3), 0, torch.float32)
    with pytest.raises(ValueError, match="gmax must have 1 elements"):
        qops.dre_dequantize(q.flatten()[:100], torch.ones(3), torch.ones(1, dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match="fmt must be 0"):
        qops.dequantize_per_tensor(q, torch.ones(1), 3, torch.float32)
    with pytest.raises(ValueError, match="dtype must be torch.float32, torch.bfloat16 or torch.float16"):
        qops.dequantize_per_tensor(q, torch.ones(1), 0, torch.int32)


def test_nbytes_is_a_property_like_torch_tensor():
    # torch.Tensor.nbytes is a property; coat's FP8 containers follow it, so code written for tensors
    # (t.nbytes) gives a number, not a bound method.
    x = torch.randn(4, 64)
    pt = F.quantize_per_tensor(x)
    assert pt.nbytes == 4 * 64 + 4  # E4M3 codes + one fp32 scale
    pg = F.quantize_per_group(x, group_size=16)
    assert pg.nbytes == 4 * 64 + pg.scale.nbytes
    dre = F.dre_quantize(torch.randn(256))
    assert dre.nbytes == 256 + 2 * 4 + 2 * 1  # codes + per 128: fp32 gmax and uint8 exponent
    assert all(isinstance(t.nbytes, int) for t in (pt, pg, dre))
