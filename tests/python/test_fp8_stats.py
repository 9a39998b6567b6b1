"""coat.fp8_stats: per-projection, per-role statistics of the FP8 GEMM operands (underflow,
saturation, amax) on tiny converted Llama models (CPU; GPU tests for the one pass and the blocks)."""

import copy

import pytest
import torch

import coat
import transformers as tf
from coat.nn import _fp8mm as mm
from coat.nn import stats as S

V = 96
_ATTN = ("q_proj+k_proj+v_proj", "o_proj")
_MLP = ("gate_proj+up_proj", "down_proj")


def _llama(hidden=48, heads=3, kv=1, inter=80, layers=2, frozen_fp8=False):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64)
    m = tf.LlamaForCausalLM(cfg)
    if frozen_fp8:
        m.requires_grad_(False)
    return coat.convert(m, recipe="fp8", frozen_weights="fp8" if frozen_fp8 else "keep")


def _step(m, gen):
    ids = torch.randint(0, V, (2, 11), generator=gen)
    m(input_ids=ids, labels=ids).loss.backward()


# (hidden, heads, kv, intermediate): FP8 norm and SwiGLU paths; widths that are not multiples of 16
# (the BF16 norm and SwiGLU fallbacks, which quantize their recomputed GEMM inputs too)
@pytest.mark.parametrize("shape", [(48, 3, 1, 80), (40, 4, 2, 72)], ids=["fp8_norm", "bf16_fallback"])
def test_every_projection_and_role(shape, gen):
    m = _llama(*shape)
    with coat.fp8_stats(m) as st:
        _step(m, gen)
    data = st.read()
    expected = {f"model.layers.{i}.{part}.{p}": roles for i in range(2)
                for part, projs, roles_of in (("self_attn", _ATTN, ({"x", "w", "dy", "x_wgrad"}, {"x", "w", "dy"})),
                                              ("mlp", _MLP, ({"x", "w", "dy", "x_wgrad"},) * 2))
                for p, roles in zip(projs, roles_of)}
    assert {n: set(r) for n, r in data.items()} == expected
    for name, roles in data.items():
        for role, r in roles.items():
            assert r["calls"] == 1 and r["numel"] > 0 and 0 <= r["underflow"] <= r["nonzero"] <= r["numel"], (name, role)
            assert r["saturated"] == 0 and r["amax"] > 0, (name, role)
    qkv = data["model.layers.0.self_attn.q_proj+k_proj+v_proj"]
    h, kv_w = shape[0], shape[2] * shape[0] // shape[1]
    assert qkv["w"]["numel"] == (h + 2 * kv_w) * h and qkv["x"]["numel"] == 22 * h and qkv["dy"]["numel"] == 22 * (h + 2 * kv_w)
    print(st.table(data))


def test_outlier_underflows():
    """One element 1e4 beside values ~1e-3: the per-tensor scale maps them below E4M3's smallest
    subnormal, so nearly all of the activation quantizes to zero; the weight loses nothing."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=g) * 1e-3
    x[3, 5] = 1e4
    w = torch.nn.Parameter(torch.randn(16, 32, generator=g) * 0.1)
    with coat.fp8_stats() as st:
        coat.nn.fp8_linear(x, w).sum().backward()
    (roles,) = st.read().values()
    assert roles["x"]["underflow_frac"] > 0.9 and roles["x"]["amax"] == 1e4
    assert roles["w"]["underflow"] == 0 and roles["dy"]["underflow"] == 0


def _counts(x, scale, fp8_dtype):
    """One operand's ([non-zero, underflow, saturated], amax) as Fp8Stats records it (the core's op)."""
    entry = S._Entry(x.device)
    S._add_counts(entry, x, scale, fp8_dtype)
    return entry.counts, entry.amax


def _torch_counts(x, scale, fp8_dtype):
    """The same statistics written with torch ops: the definition the core's one pass must meet."""
    half_sub, clip = S._LIMITS[fp8_dtype]
    a = x.abs().float() * torch.reciprocal(scale.float().reshape(1))
    nz = x != 0
    counts = [int(nz.sum()), int((nz & (a <= half_sub)).sum()), int((a >= clip).sum())]
    amax = torch.linalg.vector_norm(x.float(), float("inf")) if x.numel() else torch.zeros(())
    return counts, amax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_one_pass_counts_equal_the_torch_definition(dtype, fp8_dtype, gen):
    """Random, odd-sized and adversarial operands (zeros, values on both thresholds, huge and tiny
    magnitudes, infinities, NaN): the core's counts and amax equal the torch formulas, and a
    second operand adds to the first."""
    half_sub, clip = S._LIMITS[fp8_dtype]
    for n in (0, 1, 7, 1000, 4099):
        x = (torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 20, (n,), generator=gen).float()))
        x[::5] = 0
        scale = torch.tensor([0.37])
        if n > 10:
            x[1:5] = torch.tensor([half_sub, -half_sub * 1.01, clip, -clip * 0.999]) * scale
            x[6] = float("inf")
        x = x.to(dtype)
        counts, amax = _counts(x, scale, fp8_dtype)
        want, want_amax = _torch_counts(x, scale, fp8_dtype)
        assert counts.tolist() == want and amax.item() == want_amax.item()
    entry = S._Entry(torch.device("cpu"))
    a, b = torch.randn(300, generator=gen).to(dtype), torch.randn(77, generator=gen).to(dtype) * 1e3
    b[3] = float("nan")
    for part in (a, b):
        S._add_counts(entry, part, torch.tensor([0.01]), fp8_dtype)
    ca, _ = _torch_counts(a, torch.tensor([0.01]), fp8_dtype)
    cb, _ = _torch_counts(b, torch.tensor([0.01]), fp8_dtype)
    assert entry.counts.tolist() == [i + j for i, j in zip(ca, cb)] and entry.amax.isnan()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_one_pass_counts_equal_the_cpu_reference(dtype, gen):
    for n in (1, 4099, 3 * 2**20 + 5):
        x = (torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 20, (n,), generator=gen).float())).to(dtype)
        x[::9] = 0
        x[n // 2] = float("inf")
        scale = torch.tensor([0.37])
        cpu = _counts(x, scale, torch.float8_e4m3fn)
        counts, amax = torch.zeros(3, dtype=torch.int64, device="cuda"), torch.zeros((), device="cuda")
        half_sub, clip = S._LIMITS[torch.float8_e4m3fn]
        S.qops.fp8_operand_stats(x.cuda(), scale.cuda(), half_sub, clip, counts, amax)  # the CUDA kernel
        assert counts.tolist() == cpu[0].tolist() and amax.item() == cpu[1].item()
        assert _counts(x.cuda(), scale.cuda(), torch.float8_e4m3fn)[0].tolist() == cpu[0].tolist()
        assert _torch_counts(x.cuda(), scale.cuda(), torch.float8_e4m3fn)[0] == cpu[0].tolist()  # torch's definition


def _direct_underflow(x, fp8_dtype):
    q, _, scale = mm.quantize(x, fp8_dtype, False)
    zero_code = (q.view(torch.uint8) & 0x7F) == 0
    return int((zero_code & (x != 0)).sum()), scale


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_counts_match_direct_computation(fp8_dtype, gen):
    """Magnitudes spread over 2^-40..1 (so both formats underflow a share), zeros and ties on the
    rounding boundary: the counts equal those of the codes coat's quantizer writes."""
    x = torch.exp2(torch.rand(70, 33, generator=gen) * -40) * torch.randn(70, 33, generator=gen).sign()
    x[::7] = 0
    x = x.to(torch.bfloat16)
    under, scale = _direct_underflow(x, fp8_dtype)
    half_sub = S._LIMITS[fp8_dtype][0]
    x[0, :3] = torch.tensor([half_sub, half_sub * 1.0078125, -half_sub], dtype=torch.float32).mul(scale).to(x.dtype)
    under, scale2 = _direct_underflow(x, fp8_dtype)
    assert scale2 == scale and 0 < under < (x != 0).sum()
    counts, amax = _counts(x, scale, fp8_dtype)
    assert counts.tolist() == [int((x != 0).sum()), under, 0] and amax.item() == x.abs().max().item()

    # The role a layer records is that operand: fp8_linear's input (no norm) and its output gradient.
    w = torch.nn.Parameter(torch.randn(16, 33, generator=gen))
    dy = x[:, :16].contiguous()
    with coat.fp8_stats() as st:
        coat.nn.fp8_linear(x, w).backward(dy)
    (roles,) = st.read().values()
    if fp8_dtype == torch.float8_e4m3fn:
        assert (roles["x"]["nonzero"], roles["x"]["underflow"]) == (int((x != 0).sum()), under)
    else:
        ref = _direct_underflow(dy, fp8_dtype)[0]
        assert ref > 0
        assert (roles["dy"]["numel"], roles["dy"]["underflow"]) == (dy.numel(), ref)


def test_saturation_boundaries():
    """Saturated: |x|/s that would round past the max (E4M3: above 464, the tie rounds to 448;
    E5M2: from 61440, where the tie rounds up) and infinities; NaN counts nowhere, amax shows it."""
    one = torch.ones(1)
    e4 = torch.tensor([448.0, 464.0, 464.0 + 2**-15, 1e6, float("inf"), -float("inf"), 0.0])
    assert _counts(e4, one, torch.float8_e4m3fn)[0].tolist() == [6, 0, 4]
    e5 = torch.tensor([57344.0, 61439.996, 61440.0, -1e6])
    assert _counts(e5, one, torch.float8_e5m2)[0].tolist() == [4, 0, 2]
    # Agrees with torch's (non-saturating) E5M2 cast: exactly the clipped values become infinite.
    assert torch.isinf(e5.to(torch.float8_e5m2).float()).sum() == 2
    counts, amax = _counts(torch.tensor([1.0, float("nan")]), one, torch.float8_e4m3fn)
    assert counts.tolist() == [2, 0, 0] and amax.isnan()


def test_disabled_records_nothing(gen, monkeypatch):
    m = _llama()
    st = coat.fp8_stats(m)
    _step(m, gen)  # never entered
    assert st.read() == {} and S.active is None
    with st:
        _step(m, gen)
    first = st.read()
    calls = []
    monkeypatch.setattr(S.Fp8Stats, "record", lambda *a, **k: calls.append(a))
    _step(m, gen)  # after exit: the layers do not even call into the collector
    assert calls == [] and S.active is None
    monkeypatch.undo()
    assert st.read() == first  # nothing added after exit
    with st:  # entered again: accumulates
        _step(m, gen)
    again = st.read(reset=True)
    qkv = "model.layers.0.self_attn.q_proj+k_proj+v_proj"
    assert again[qkv]["x"]["calls"] == 2 and again[qkv]["x"]["numel"] == 2 * first[qkv]["x"]["numel"]
    assert st.read() == {}


def test_nesting_and_bad_arguments(gen):
    m = _llama(layers=1)
    outer, inner = coat.fp8_stats(m), coat.fp8_stats(m)
    with outer:
        with inner:
            _step(m, gen)
        assert S.active is outer
        with pytest.raises(RuntimeError, match="already recording"):
            outer.__enter__()
    assert S.active is None and outer.read() == {} and len(inner.read()) == 4
    with pytest.raises(ValueError, match="model must be"):
        coat.fp8_stats(3)
    assert "nothing recorded" in S.Fp8Stats.table({})


def test_unnamed_and_frozen(gen):
    """Without a model, projections are numbered; FP8-frozen weights record no weight role."""
    w1, w2 = (torch.nn.Parameter(torch.randn(16, 32, generator=gen)) for _ in range(2))
    x = torch.randn(8, 32, generator=gen)
    with coat.fp8_stats() as st:
        coat.nn.fp8_linear(x, w1).sum().backward()
        coat.nn.fp8_linear(x, w2).sum().backward()
        coat.nn.fp8_linear(x, w1).sum().backward()
    data = st.read()
    assert list(data) == ["linear0", "linear1"] and data["linear0"]["x"]["calls"] == 2
    m = _llama(layers=1, frozen_fp8=True)
    with coat.fp8_stats(m) as st:
        m(input_ids=torch.randint(0, V, (1, 5), generator=gen))
    data = st.read()
    assert len(data) == 4 and all(set(r) == {"x"} for r in data.values()), data  # forward only, no weights


@pytest.mark.gpu
def test_gpu_stats_change_no_result(gen):
    """While stats record, each block op also returns the GEMM inputs it makes; the results are the
    same bits: loss and gradients equal, and every projection and role recorded."""
    m = _llama().cuda()
    m2 = copy.deepcopy(m)
    ids = torch.randint(0, V, (2, 32), generator=gen).cuda()
    with torch.autocast("cuda", torch.bfloat16):
        loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    with coat.fp8_stats(m2) as st, torch.autocast("cuda", torch.bfloat16):
        loss2 = m2(input_ids=ids, labels=ids).loss
        loss2.backward()
    assert torch.equal(loss, loss2)
    for (n, p), p2 in zip(m.named_parameters(), m2.parameters()):
        assert torch.equal(p.grad, p2.grad), n
    data = st.read()
    assert len(data) == 8 and sum(len(r) for r in data.values()) == 2 * (4 + 3 + 4 + 4)
