"""coat.optim.AdamW on the CPU path: against torch.optim.AdamW, edge cases, stochastic rounding,
state dicts and conversions, GradScaler, schedulers and bad input."""

from __future__ import annotations

import io
import math

import pytest
import torch

import coat.optim as co
from coat.fp8.tensor import DreTensor


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These models are tiny: extra intra-op threads only add contention on a shared CI machine.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _mlp(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8)).to(dtype)


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 8, generator=g)
    for _ in range(n):
        x = torch.randn(128, 64, generator=g)
        yield x, torch.tanh(x @ w)


def _train(model, opt, batches, sched=None):
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = ((model(x.to(next(model.parameters()).dtype)).float() - y) ** 2).mean()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_trajectory_close_to_torch_adamw():
    """300 steps on an MLP regression: parameters within 3% (relative L2) of torch.optim.AdamW and
    the final loss within 0.5%; FP8 state noise (~1% here) is the only difference. Expansion
    must track torch more closely than plain per-group E4M3 (~2%)."""
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    ref = _mlp()
    ref_losses = _train(ref, torch.optim.AdamW(ref.parameters(), **kw), _batches(300))
    errs = {}
    for expansion in (True, False):
        m = _mlp()
        losses = _train(m, co.AdamW(m.parameters(), expansion=expansion, **kw), _batches(300))
        errs[expansion] = _rel(_flat(m), _flat(ref))
        assert abs(losses[-1] - ref_losses[-1]) / ref_losses[-1] < 5e-3
    print(f"param rel. diff after 300 steps: DRE {errs[True]:.4f}, plain E4M3 {errs[False]:.4f}")
    assert errs[True] < 0.03
    assert errs[True] < errs[False]


def test_zero_constant_tiny_gradients():
    p = torch.nn.Parameter(torch.full((300,), 2.0))
    opt = co.AdamW([p], lr=1e-2, weight_decay=0.1)
    p.grad = torch.zeros(300)
    opt.step()
    assert torch.equal(p.detach(), torch.full((300,), 2.0 * (1 - 1e-3), dtype=torch.float32))
    st = opt.state[p]
    assert st["exp_avg_q"].view(torch.uint8).eq(0).all() and st["exp_avg_sq_gmax"].eq(0).all()
    # constant gradients: each group is constant and decodes exactly; the step matches torch's
    q = torch.nn.Parameter(torch.full((300,), 2.0))
    tq = torch.nn.Parameter(torch.full((300,), 2.0))
    o1, o2 = co.AdamW([q], lr=1e-2), torch.optim.AdamW([tq], lr=1e-2)
    for scale in (3e-3, 1e-30):  # 1e-30: g^2 underflows in fp32 for both optimizers
        for _ in range(5):
            q.grad = torch.full((300,), scale)
            tq.grad = q.grad.clone()
            o1.step()
            o2.step()
        m = co.to_torch_adamw_state(o1)["state"][0]["exp_avg"]
        torch.testing.assert_close(m, o2.state[tq]["exp_avg"], rtol=1e-6, atol=0)
        torch.testing.assert_close(q.detach(), tq.detach(), rtol=1e-5, atol=0)
        assert torch.isfinite(q).all()


def test_nonfinite_gradients():
    p = torch.nn.Parameter(torch.ones(256))
    opt = co.AdamW([p])
    g = torch.full((256,), 1e-3)
    g[7] = float("nan")
    p.grad = g
    opt.step()  # propagate (default): that element only, like torch.optim.AdamW
    assert math.isnan(p[7].item()) and torch.isfinite(torch.cat([p[:7], p[8:]])).all()
    assert co.to_torch_adamw_state(opt)["state"][0]["exp_avg"][7].isnan()
    r = torch.nn.Parameter(torch.ones(256))
    strict = co.AdamW([r], nonfinite="raise")
    r.grad = g
    with pytest.raises(FloatingPointError):
        strict.step()
    assert torch.equal(r.detach(), torch.ones(256))
    r.grad = torch.full((256,), 1e-3)
    strict.step()
    assert strict.state[r]["step"].item() == 1.0


def test_bf16_stochastic_rounding_is_unbiased():
    """Updates far below half a bf16 ulp: round-to-nearest would never move the weights; with
    stochastic rounding their mean follows the fp32-master trajectory."""
    n = 1 << 14
    w = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    ref = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    o_sr = co.AdamW([w], lr=2e-4, weight_decay=0.0, master_weights="bf16_sr", seed=3)
    o_m = co.AdamW([ref], lr=2e-4, weight_decay=0.0, master_weights="fp32")
    for _ in range(60):
        w.grad = torch.full((n,), 1e-2, dtype=torch.bfloat16)
        ref.grad = w.grad.clone()
        o_sr.step()
        o_m.step()
    expect = o_m.state[ref]["master"].mean().item()  # ~ 1 - 60 * 2e-4
    got = w.float().mean().item()
    assert abs(expect - (1 - 60 * 2e-4)) < 1e-4
    assert abs(got - expect) < 2e-4, (got, expect)
    # each step moves a weight by ~2e-4, under a tenth of the bf16 spacing below 1 (2^-8): round
    # to nearest without a master would never move it; stochastic rounding moves some of them
    assert w.float().unique().numel() >= 2


@pytest.mark.parametrize("dtype,master", [(torch.float32, "fp32"), (torch.bfloat16, "fp32"),
                                          (torch.bfloat16, "bf16_sr"), (torch.float16, "fp32")])
def test_state_dict_resume_is_bit_identical(dtype, master):
    batches = list(_batches(30))
    a = _mlp(dtype=dtype)
    oa = co.AdamW(a.parameters(), lr=3e-3, master_weights=master, v_format="e5m2")
    _train(a, oa, batches[:20])
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optim": oa.state_dict()}, buf)
    _train(a, oa, batches[20:])

    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    b = _mlp(seed=5, dtype=dtype)
    b.load_state_dict(ck["model"])
    ob = co.AdamW(b.parameters(), lr=3e-3, master_weights=master, v_format="e5m2")
    ob.load_state_dict(ck["optim"])
    assert ob.state_dict()["state"][0]["exp_avg_q"].dtype == torch.float8_e4m3fn
    _train(b, ob, batches[20:])
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    for sa, sb in zip(oa.state.values(), ob.state.values()):
        for k in sa:
            assert torch.equal(sa[k].view(torch.uint8) if sa[k].dtype.itemsize == 1 else sa[k],
                               sb[k].view(torch.uint8) if sb[k].dtype.itemsize == 1 else sb[k]), k


def test_step_under_torch_compile_matches_eager():
    # A compiled opt.step runs coat's step as is: Dynamo does not trace into it, and the result
    # is the eager one, bit for bit.
    batches = list(_batches(4))
    a, b = _mlp(), _mlp()
    oa = co.AdamW(a.parameters(), lr=3e-3)
    ob = co.AdamW(b.parameters(), lr=3e-3)
    compiled = torch.compile(ob.step)
    for x, y in batches:
        for model, step in ((a, oa.step), (b, compiled)):
            model.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert ob.state[next(b.parameters())]["step"].item() == len(batches)


def test_state_dict_is_compact_and_checked():
    m = _mlp()
    opt = co.AdamW(m.parameters())
    _train(m, opt, _batches(2))
    n = sum(p.numel() for p in m.parameters())
    moments = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if "exp_avg" in k)
    assert moments / n < 2.2
    sd = opt.state_dict()
    sd["state"][0]["exp_avg_gmax"] = sd["state"][0]["exp_avg_gmax"][:-1]
    with pytest.raises(ValueError, match="does not fit"):
        co.AdamW(_mlp().parameters()).load_state_dict(sd)
    with pytest.raises(ValueError, match="from_torch_adamw_state"):
        t = torch.optim.AdamW(m.parameters())
        _train(m, t, _batches(1))
        co.AdamW(m.parameters()).load_state_dict(t.state_dict())


def test_torch_state_conversions():
    m = _mlp()
    opt = co.AdamW(m.parameters(), lr=2e-3, weight_decay=0.05)
    _train(m, opt, _batches(10))
    tsd = co.to_torch_adamw_state(opt)
    t = torch.optim.AdamW(m.parameters())
    t.load_state_dict(tsd)  # a torch AdamW continues from the dequantized moments
    assert t.param_groups[0]["lr"] == 2e-3 and t.state[next(m.parameters())]["step"].item() == 10
    for p in m.parameters():
        st = opt.state[p]
        deq = DreTensor(st["exp_avg_q"].flatten(), st["exp_avg_gmax"], st["exp_avg_k16"])
        torch.testing.assert_close(t.state[p]["exp_avg"].flatten(), deq.dequantize(), rtol=0, atol=0)
    # and back: re-quantizing the decoded moments reproduces them to FP8 precision
    back = co.AdamW(m.parameters())
    back.load_state_dict(co.from_torch_adamw_state(t.state_dict(), back))
    again = co.to_torch_adamw_state(back)
    for i, st in tsd["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert _rel(again["state"][i][k], st[k]) < 1e-2
    # from a real torch run: decoded moments within FP8 error of torch's
    ref = _mlp()
    tref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    _train(ref, tref, _batches(10))
    conv = co.AdamW(ref.parameters())
    conv.load_state_dict(co.from_torch_adamw_state(tref.state_dict(), conv))
    dq = co.to_torch_adamw_state(conv)["state"]
    for i, p in enumerate(ref.parameters()):
        assert _rel(dq[i]["exp_avg"], tref.state[p]["exp_avg"]) < 0.05
        assert _rel(dq[i]["exp_avg_sq"], tref.state[p]["exp_avg_sq"]) < 0.05
    _train(ref, conv, _batches(3))  # and it keeps training


def test_grad_scaler_skips_and_unscales():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    a, b = _mlp(), _mlp()
    oa, ob = co.AdamW(a.parameters(), lr=1e-3), co.AdamW(b.parameters(), lr=1e-3)
    (x, y), = list(_batches(1))
    ((a(x) - y) ** 2).mean().backward()
    ob_loss = ((b(x) - y) ** 2).mean()
    scaler.scale(ob_loss).backward()
    before = _flat(b)
    next(b.parameters()).grad[0, 0] = float("inf")
    scaler.step(ob)  # inf found: nothing written, step count unchanged
    scaler.update()
    assert torch.equal(_flat(b), before) and ob.state[next(b.parameters())]["step"].item() == 0
    ob.zero_grad()
    scaler.scale(((b(x) - y) ** 2).mean()).backward()
    scaler.step(ob)
    scaler.update()
    oa.step()
    torch.testing.assert_close(_flat(b), _flat(a), rtol=1e-6, atol=1e-7)


def test_scheduler_tensor_lr_closure_and_groups():
    a, b = _mlp(), _mlp()
    lr = float(torch.tensor(2e-3))  # the fp32 value, so that both runs use the same lr
    oa = co.AdamW(a.parameters(), lr=lr)
    ob = co.AdamW(b.parameters(), lr=torch.tensor(lr))
    sa = torch.optim.lr_scheduler.LambdaLR(oa, lambda s: 1.0 / (1 + s))
    sb = torch.optim.lr_scheduler.LambdaLR(ob, lambda s: 1.0 / (1 + s))
    batches = list(_batches(5))
    _train(a, oa, batches, sa)
    _train(b, ob, batches, sb)
    torch.testing.assert_close(_flat(a), _flat(b), rtol=1e-6, atol=0)
    # closure + a group with its own hyperparameters added later
    c = _mlp()
    opt = co.CoatAdamW(list(c.parameters())[:2], lr=1e-3)
    opt.add_param_group({"params": list(c.parameters())[2:], "lr": 0.0, "weight_decay": 0.0, "v_format": "e5m2"})
    frozen = [p.detach().clone() for p in list(c.parameters())[2:]]
    x, y = batches[0]

    def closure():
        opt.zero_grad()
        loss = ((c(x) - y) ** 2).mean()
        loss.backward()
        return loss

    assert opt.step(closure) > 0
    assert all(torch.equal(f, p) for f, p in zip(frozen, list(c.parameters())[2:]))
    assert opt.state[list(c.parameters())[3]]["exp_avg_sq_q"].dtype == torch.float8_e5m2


def test_bad_inputs():
    p = torch.nn.Parameter(torch.ones(4))
    for kw, msg in [(dict(lr=float("nan")), "learning rate"), (dict(lr=-1.0), "learning rate"),
                    (dict(betas=(1.0, 0.9)), "beta"), (dict(eps=float("inf")), "epsilon"),
                    (dict(weight_decay=-0.1), "weight_decay"), (dict(group_size=64), "group_size"),
                    (dict(m_format="e3m4"), "m_format"), (dict(master_weights="fp16"), "master_weights"),
                    (dict(nonfinite="ignore"), "nonfinite"), (dict(master_weights="bf16_sr"), "bfloat16")]:
        with pytest.raises(ValueError, match=msg):
            co.AdamW([p], **kw)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = co.AdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    z = torch.nn.Parameter(torch.ones(4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="complex"):
        opt = co.AdamW([z])
        z.grad = torch.ones(4, dtype=torch.complex64)
        opt.step()
    opt = co.AdamW([p])
    opt.param_groups[0]["lr"] = float("inf")
    p.grad = torch.ones(4)
    with pytest.raises(ValueError, match="learning rate"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(4))


def test_state_tensor_replaced_in_place_is_followed():
    # The step reuses its table of pointers across steps; a state tensor swapped into opt.state
    # (as offloading code does) must be the one updated, and the old one left alone.
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000))
    opt = co.AdamW([p], lr=1e-2)
    p.grad = torch.randn(1000)
    opt.step()
    st = opt.state[p]
    old = st["exp_avg_q"]
    kept = old.clone()
    st["exp_avg_q"] = old.clone()
    p.grad.copy_(torch.randn(1000))  # the same gradient tensor: no other pointer changed
    opt.step()
    assert torch.equal(old, kept)
    assert not torch.equal(st["exp_avg_q"], kept)


def test_distributed_checkpoint_round_trip(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    m = _mlp()
    opt = co.AdamW(m.parameters(), master_weights="fp32")
    _train(m, opt, _batches(3))
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=str(tmp_path))
    fresh = co.AdamW(m.parameters())
    _train(m, fresh, _batches(1, seed=9))  # allocate states, then load into them in place
    sd = {"optim": fresh.state_dict()}
    dcp.load(sd, checkpoint_id=str(tmp_path))
    fresh.load_state_dict(sd["optim"])
    for s1, s2 in zip(opt.state.values(), fresh.state.values()):
        assert torch.equal(s1["exp_avg_q"].view(torch.uint8), s2["exp_avg_q"].view(torch.uint8))
        assert torch.equal(s1["exp_avg_sq_gmax"], s2["exp_avg_sq_gmax"]) and torch.equal(s1["step"], s2["step"])
