"""coat.optim.AdamW on the CPU path: against torch.optim.AdamW, edge cases, stochastic rounding,
state dicts and conversions, GradScaler, schedulers and bad input."""

from __future__ import annotations

import copy
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


@pytest.mark.parametrize("dtype,master", [(torch.float32, "fp32"), (torch.bfloat16, "fp32"),
                                          (torch.bfloat16, "bf16_sr")])
def test_step_bumps_version_counters_like_torch(dtype, master):
    # The kernel writes parameters (and fp32 masters) through raw pointers; autograd must still see
    # that a weight saved for a backward changed, as it does after torch.optim.AdamW's step.
    for make in (lambda ps: torch.optim.AdamW(ps), lambda ps: co.AdamW(ps, master_weights=master)):
        model = _mlp(dtype=dtype)
        opt = make(model.parameters())
        x = torch.randn(4, 64, dtype=dtype, requires_grad=True)
        model(x).sum().backward()
        pending = model(x).sum()  # saves the weights (for the gradient of x)
        versions = [p._version for p in model.parameters()]
        opt.step()
        assert all(p._version > v for p, v in zip(model.parameters(), versions))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            pending.backward()
        if isinstance(opt, co.AdamW) and dtype != torch.float32 and master == "fp32":
            masters = [opt.state[p]["master"] for p in model.parameters()]
            before = [m._version for m in masters]
            model(x).sum().backward()
            opt.step()
            assert all(m._version > v for m, v in zip(masters, before))


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


@pytest.mark.parametrize("cls", [co.AdamW, co.AdamW4bit])
def test_grad_scaler_overflow_is_skipped_not_raised_under_nonfinite_raise(cls):
    """GradScaler finds its scale by overflowing: its found_inf skips that step; nonfinite='raise'
    must not turn it into an error (and after any raise, the scaler's attributes must not stay)."""
    w = torch.nn.Parameter(torch.randn(16, generator=torch.Generator().manual_seed(0)))
    opt, scaler = cls([w], lr=1e-2, nonfinite="raise"), torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    for i in range(3):
        opt.zero_grad()
        loss = (w * torch.randn(16, generator=torch.Generator().manual_seed(i))).sum() * (1e35 if i == 1 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0 ** 15 and opt.state[w]["step"].item() == 2
    w.grad = torch.full_like(w, float("nan"))  # without GradScaler the check still raises
    with pytest.raises(FloatingPointError):
        opt.step()
    opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(0.0)  # as GradScaler sets them
    w.grad = torch.ones(16).to_sparse()  # refused: a sparse gradient
    with pytest.raises(ValueError):
        opt.step()
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")


@pytest.mark.parametrize("cls", [co.AdamW, co.AdamW4bit])
def test_found_inf_is_a_flag(cls):
    """GradScaler passes the sum of its devices' found_inf: 2.0 skips one step, not two."""
    w = torch.nn.Parameter(torch.randn(16))
    opt = cls([w], lr=1e-2)
    for fi in (0.0, 2.0, 0.0):
        w.grad = torch.randn(16)
        opt.found_inf = torch.tensor(fi)
        opt.step()
    del opt.found_inf
    assert opt.state[w]["step"].item() == 2


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


def test_new_gradient_tensors_are_followed():
    # zero_grad(set_to_none=True) gives every step new gradient tensors: the table keeps the other
    # pointers and rewrites the gradients' column. The old gradient is kept alive and poisoned, so
    # a stale pointer would step with 1e6. Reference: the same gradients written into one tensor.
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3, 300))
    q = torch.nn.Parameter(torch.randn(200))
    ref = [torch.nn.Parameter(t.detach().clone()) for t in (p, q)]
    opt, opt_ref = co.AdamW([p, q], lr=1e-2), co.AdamW(ref, lr=1e-2)
    for r in ref:
        r.grad = torch.zeros_like(r)
    old = []
    for _ in range(3):
        gs = [torch.randn_like(p), torch.randn_like(q)]
        for t, g in zip((p, q), gs):
            if t.grad is not None:
                old.append(t.grad)
                t.grad.fill_(1e6)
            t.grad = g.clone()
        for r, g in zip(ref, gs):
            r.grad.copy_(g)
        opt.step()
        opt_ref.step()
        for t, r in zip((p, q), ref):
            assert torch.equal(t, r)

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


# ---- torch.optim.AdamW drop-in behaviours (each a regression test) ------------------------------


def _random_grads(params, step: int, which=None) -> None:
    """Seeded gradients for the parameters at positions `which` (all when None); None elsewhere."""
    g = torch.Generator().manual_seed(500 + step)
    for i, p in enumerate(params):
        grad = (torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype)
        p.grad = grad if which is None or i in which else None


def _same_states(oa, ob) -> bool:
    def raw(t):
        return t.view(torch.uint8) if t.element_size() == 1 else t

    return all(sa.keys() == sb.keys() and all(torch.equal(raw(sa[k]), raw(sb[k])) for k in sa)
               for sa, sb in zip(oa.state.values(), ob.state.values()))


@pytest.mark.parametrize("master", ["fp32", "bf16_sr"])
def test_deepcopy_and_whole_optimizer_save_step_as_the_original(tmp_path, master):
    """copy.deepcopy(opt) and torch.save(opt) keep coat's own settings (torch's __getstate__ keeps only
    defaults, state and groups), leave the pointer cache behind, and the copy's next step equals the
    original's bit for bit."""
    m = _mlp(dtype=torch.bfloat16)
    opt = co.AdamW(m.parameters(), lr=3e-3, master_weights=master, nonfinite="raise", seed=11)
    _train(m, opt, _batches(3))
    torch.save(opt, tmp_path / "opt.pt")
    copies = [copy.deepcopy(opt), torch.load(tmp_path / "opt.pt", weights_only=False)]
    public = {k for k in vars(opt) if not k.startswith("_")}
    params = list(m.parameters())
    _random_grads(params, 0)
    for c in copies:
        assert {k for k in vars(c) if not k.startswith("_")} == public
        assert (c.master_weights, c.nonfinite, c.seed) == (master, "raise", 11) and c._desc_cache == {}
        cparams = [p for g in c.param_groups for p in g["params"]]
        assert all(torch.equal(p, q) and p is not q for p, q in zip(params, cparams))
        for p, q in zip(params, cparams):
            q.grad = p.grad.clone()
        c.step()
    opt.step()
    for c in copies:
        assert all(torch.equal(p, q) for p, q in zip(params, [p for g in c.param_groups for p in g["params"]]))
        assert _same_states(opt, c)
    # model and optimizer copied together: the copy steps the copied model's parameters
    m2, o2 = copy.deepcopy((m, opt))
    assert all(a is b for a, b in zip(o2.param_groups[0]["params"], m2.parameters()))


def test_bf16_sr_resume_is_exact_whatever_order_parameters_get_gradients():
    """A parameter's rounding seed comes from its position in the groups, so a parameter that first
    gets a gradient after the checkpoint rounds in the resumed run as in the uninterrupted one
    (seeds from the order of state creation differed between the two)."""
    schedule = [[2], [2], [3, 0], [3, 0], [1, 3], None, None]  # positions that get gradients at each step
    a = _mlp(dtype=torch.bfloat16)
    oa = co.AdamW(a.parameters(), lr=3e-3, master_weights="bf16_sr", seed=5)
    params = list(a.parameters())
    ckpt = None
    for step, which in enumerate(schedule):
        if step == 3:  # position 1 has no state yet
            ckpt = io.BytesIO()
            torch.save({"model": a.state_dict(), "optim": oa.state_dict()}, ckpt)
        _random_grads(params, step, which)
        oa.step()
    assert [int(oa.state[p]["sr_seed"]) for p in params] == [co._state.param_seed(5, i) for i in range(4)]
    ckpt.seek(0)
    saved = torch.load(ckpt, weights_only=True)
    assert len(saved["optim"]["state"]) == 3
    b = _mlp(seed=9, dtype=torch.bfloat16)
    b.load_state_dict(saved["model"])
    ob = co.AdamW(b.parameters(), lr=3e-3, master_weights="bf16_sr", seed=5)
    ob.load_state_dict(saved["optim"])
    for step, which in enumerate(schedule[3:], 3):
        _random_grads(list(b.parameters()), step, which)
        ob.step()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert _same_states(oa, ob)


def test_load_state_dict_hooks_see_the_loaded_state():
    m = _mlp()
    opt = co.AdamW(m.parameters())
    _train(m, opt, _batches(2))
    sd = opt.state_dict()
    fresh = co.AdamW(_mlp(seed=3).parameters())
    seen = {}

    def post(o):
        seen["steps"] = [o.state[p]["step"].item() for g in o.param_groups for p in g["params"]]
        seen["codes"] = [o.state[p]["exp_avg_q"].view(torch.uint8).clone() for g in o.param_groups for p in g["params"]]

    def pre(o, s):
        seen["pre_state"] = len(o.state)

    fresh.register_load_state_dict_pre_hook(pre)
    fresh.register_load_state_dict_post_hook(post)
    fresh.load_state_dict(sd)
    assert seen["pre_state"] == 0 and seen["steps"] == [2.0] * 4
    assert all(torch.equal(c, sd["state"][i]["exp_avg_q"].view(torch.uint8)) for i, c in enumerate(seen["codes"]))


def test_torch_keywords_maximize_and_refusals():
    p = torch.nn.Parameter(torch.ones(4))
    # torch's keywords at their no-op values, and the implementation choices coat always satisfies
    co.AdamW([p], 1e-3, (0.9, 0.999), 1e-8, 1e-2, False, maximize=False, foreach=None, capturable=False,
             differentiable=False, fused=None)
    co.AdamW([p], foreach=True, capturable=True)
    co.AdamW([p], fused=True, lr=torch.tensor(1e-3))
    for kw, exc, msg in [(dict(amsgrad=True), ValueError, "amsgrad=True is not supported"),
                         (dict(differentiable=True), ValueError, "differentiable=True is not supported"),
                         (dict(capturable=True, nonfinite="raise"), ValueError, "capturable=True cannot"),
                         (dict(maximize=1), ValueError, "maximize must be a bool"),
                         (dict(foreach=True, fused=True), RuntimeError, "cannot be `True` together"),
                         (dict(fused=True, differentiable=True), RuntimeError, "does not support `differentiable`"),
                         (dict(lr=torch.tensor(1e-3), foreach=True), ValueError, "lr as a Tensor is not supported"),
                         (dict(betas=(0.9, torch.tensor(0.99))), ValueError, "both floats or both Tensors"),
                         (dict(betas=(torch.tensor(0.9), torch.tensor(0.99))), ValueError,
                          "betas as Tensors are not supported by coat"),
                         (dict(lr=torch.tensor([1e-3, 1e-3])), ValueError, "Tensor lr must be 1-element")]:
        with pytest.raises(exc, match=msg):
            co.AdamW([p], **kw)
    opt = co.AdamW([p])
    with pytest.raises(ValueError, match="amsgrad"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "amsgrad": True})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_maximize_is_minimizing_the_negated_gradient(dtype):
    """maximize=True negates the gradients inside the kernel (an argument of its own beside
    GradScaler's scale): bit for bit the step on negated gradients, with and without a GradScaler, and carried
    to and from torch's state dict format."""
    a, b, c = _mlp(dtype=dtype), _mlp(dtype=dtype), _mlp(dtype=dtype)
    oa = co.AdamW(a.parameters(), lr=3e-3, weight_decay=0.1, maximize=True)
    ob = co.AdamW(b.parameters(), lr=3e-3, weight_decay=0.1)
    oc = co.AdamW(c.parameters(), lr=3e-3, weight_decay=0.1, maximize=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # the scaler's lazy start; the gradients below stand for its scaled ones
    for step in range(4):
        _random_grads(list(a.parameters()), step)
        for pa, pb, pc in zip(a.parameters(), b.parameters(), c.parameters()):
            pb.grad = -pa.grad
            pc.grad = pa.grad * 1024  # what scaler.scale(loss).backward() leaves
        oa.step()
        ob.step()
        scaler.step(oc)
        scaler.update()
    for pa, pb, pc in zip(a.parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb) and torch.equal(pa, pc)
    tsd = co.to_torch_adamw_state(oa)
    assert tsd["param_groups"][0]["maximize"] is True
    back = co.AdamW(a.parameters())
    back.load_state_dict(co.from_torch_adamw_state(tsd, back))
    assert back.param_groups[0]["maximize"] is True


def _conv(memory_format) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(5, 24, 3), torch.nn.GELU(), torch.nn.Conv2d(24, 7, 3)).to(
        memory_format=memory_format)


def test_channels_last_parameters_train_in_memory_order():
    """A channels_last weight is updated in its memory order: bit for bit the step of a contiguous
    tensor holding the same memory (its NHWC permutation); the states are laid out like the weight,
    exported to torch's format per element in its logical order, and round-trip through a state
    dict; a gradient in another layout is copied into the weight's."""
    cl = torch.channels_last
    w = torch.nn.Parameter((torch.randn(24, 5, 3, 3) * 0.1).contiguous(memory_format=cl))
    nhwc = torch.nn.Parameter(w.detach().permute(0, 2, 3, 1).contiguous())  # same memory, contiguous
    ow, on = co.AdamW([w], lr=1e-2), co.AdamW([nhwc], lr=1e-2)
    for step in range(4):
        g = torch.randn(24, 5, 3, 3, generator=torch.Generator().manual_seed(step))
        w.grad = g.contiguous(memory_format=cl) if step % 2 else g  # odd steps: a contiguous grad, copied
        nhwc.grad = g.permute(0, 2, 3, 1).contiguous()
        ow.step()
        on.step()
        assert torch.equal(w.detach().permute(0, 2, 3, 1), nhwc.detach())
    st = ow.state[w]
    assert st["exp_avg_q"].stride() == w.stride() and torch.equal(
        st["exp_avg_q"].permute(0, 2, 3, 1).view(torch.uint8), on.state[nhwc]["exp_avg_q"].view(torch.uint8))
    tw, tn = co.to_torch_adamw_state(ow)["state"][0], co.to_torch_adamw_state(on)["state"][0]
    assert tw["exp_avg"].stride() == w.stride()
    assert torch.equal(tw["exp_avg"].permute(0, 2, 3, 1), tn["exp_avg"])
    # through torch's format and back: the codes re-quantized in the weight's memory order
    back = co.AdamW([w], lr=1e-2)
    back.load_state_dict(co.from_torch_adamw_state(co.to_torch_adamw_state(ow), back))
    assert back.state[w]["exp_avg_q"].stride() == w.stride()
    assert _rel(co.to_torch_adamw_state(back)["state"][0]["exp_avg"], tw["exp_avg"]) < 1e-2
    # a state dict saved and loaded continues bit for bit
    buf = io.BytesIO()
    torch.save(ow.state_dict(), buf)
    buf.seek(0)
    w2 = torch.nn.Parameter(w.detach().clone())  # clone keeps channels_last
    o2 = co.AdamW([w2], lr=1e-2)
    o2.load_state_dict(torch.load(buf, weights_only=True))
    w.grad = w2.grad = torch.randn(24, 5, 3, 3).contiguous(memory_format=cl)
    ow.step()
    o2.step()
    assert torch.equal(w, w2)


def test_channels_last_model_tracks_torch_and_layout_changes_are_refused():
    """A channels_last CNN trains with coat as with torch.optim.AdamW (FP8-state noise: parameters
    within 3% relative L2 after 30 steps; ~1% measured). A state laid out for one memory format is
    refused, clearly, for a parameter in another; non-dense parameters are refused at construction."""
    cl = torch.channels_last
    a, ref = _conv(cl), _conv(cl)
    oa, oref = co.AdamW(a.parameters(), lr=3e-3), torch.optim.AdamW(ref.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(3)
    for _ in range(30):
        x = torch.randn(8, 5, 12, 12, generator=g).contiguous(memory_format=cl)
        for model, opt in ((a, oa), (ref, oref)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    assert _rel(_flat(a), _flat(ref)) < 0.03
    sd = oa.state_dict()
    contiguous = _conv(torch.contiguous_format)
    with pytest.raises(ValueError, match="laid out otherwise in memory"):
        co.AdamW(contiguous.parameters()).load_state_dict(sd)
    a.to(memory_format=torch.contiguous_format)  # the states stay channels_last
    x = torch.randn(2, 5, 12, 12)
    a(x).sum().backward()
    before = _flat(a)
    with pytest.raises(ValueError, match="not laid out in memory like its parameter"):
        oa.step()
    assert torch.equal(_flat(a), before)
    with pytest.raises(ValueError, match="dense and non-overlapping"):
        co.AdamW([torch.nn.Parameter(torch.randn(8, 6)[:, ::2])])


def test_duplicate_parameter_is_refused_at_step():
    p = torch.nn.Parameter(torch.ones(300))
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch's warning, as torch gives it
        opt = co.AdamW([p, p])
    p.grad = torch.ones(300)
    with pytest.raises(ValueError, match="appears more than once"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(300)) and opt.state[p]["step"].item() == 0


def test_empty_parameter_state_loads_as_no_state():
    """An empty state entry (a parameter that never got one; torch's state dicts may hold such) loads as
    no state, and the parameter's state is created at its first gradient."""
    m = _mlp()
    opt = co.AdamW(m.parameters())
    _train(m, opt, _batches(1))
    sd = opt.state_dict()
    sd["state"][3] = {}
    fresh = co.AdamW(m.parameters())
    fresh.load_state_dict(sd)
    last = list(m.parameters())[3]
    assert last not in fresh.state and len(fresh.state) == 3
    _train(m, fresh, _batches(1))
    assert fresh.state[last]["step"].item() == 1
