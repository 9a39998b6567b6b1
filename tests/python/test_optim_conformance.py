"""coat.optim.AdamW driven by the conformance material torch ships for torch.optim.AdamW
(torch.testing._internal.common_optimizers: optim_db's AdamW OptimizerInfo, its CPU optimizer
inputs, error inputs and scheduler inputs), compared with torch.optim.AdamW on the CPU.

coat differs from torch by design in one respect: m and v are stored in FP8 (E4M3 m, E5M2 v, with
Dynamic Range Expansion) between steps. The comparisons and their tolerances:
- Lockstep: before every step torch gets coat's parameters and coat's moments decoded
  (coat.optim.to_torch_adamw_state), so both step from the same numbers. The parameters then agree
  to fp32 rounding: rtol 2.4e-7 (2 ulp of the parameter) plus atol 4e-6 * lr (the update's own
  rounding: the kernel decodes FP8 with its fast log2/exp2, to_torch_adamw_state with the exact
  decoder; measured <= 1e-6 * lr).
- The moments after such a step: coat's re-encoded ones against torch's fp32 ones, per tensor
  rel. L2 <= 2^-4 for m (E4M3 has 3 mantissa bits: rounding moves a value by at most half an ulp,
  2^-4 of it) and <= 2^-3 for v (E5M2, 2 mantissa bits); measured <= 2.1% and 3.7%.
- Free running (nothing synced): after 40 steps each parameter's displacement agrees with torch's
  to 5% (rel. L2), measured <= 2.6%: the FP8 error of each step's moments, partly averaging out.

The parameters cover what the kernel must handle: a 300 x 37 weight (last quantization group
partial), a bias, a channels_last convolution weight, a transposed (dense, non-contiguous) weight
and a one-element parameter.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch.testing._internal import common_optimizers as co_tests
from torch.testing._internal.common_optimizers import OptimizerErrorEnum

import coat.optim as co

INFO = next(info for info in co_tests.optim_db if info.optim_cls is torch.optim.AdamW)
INPUTS = INFO.optim_inputs_func("cpu")
ERROR_INPUTS = INFO.optim_error_inputs_func("cpu", torch.float32)
SCHEDULERS = INFO.scheduler_inputs  # a tuple of lists of scheduler constructors, used together

PARAM_RTOL = 2.4e-7
UPDATE_ATOL = 4e-6  # times lr
M_TOL, V_TOL = 2.0**-4, 2.0**-3
DRIFT_TOL = 0.05


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add contention on a shared CI machine
    yield
    torch.set_num_threads(n)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(300, 37, generator=g) * 0.1),
            torch.nn.Parameter(torch.randn(300, generator=g) * 0.1),
            torch.nn.Parameter((torch.randn(7, 5, 3, 3, generator=g) * 0.1).contiguous(memory_format=torch.channels_last)),
            torch.nn.Parameter((torch.randn(130, 3, generator=g) * 0.1).t()),
            torch.nn.Parameter(torch.randn(1, generator=g))]


def _loss(params, step: int) -> torch.Tensor:
    """A quadratic bowl per parameter (fixed targets) plus a random linear term that changes every
    step: the same gradients for both optimizers given the same parameters."""
    targets, noise = torch.Generator().manual_seed(7), torch.Generator().manual_seed(1000 + step)
    loss = torch.zeros(())
    for p in params:
        target = 0.5 * torch.randn(p.shape, generator=targets)
        loss = loss + 0.5 * (p - target).pow(2).sum() + 0.3 * (torch.randn(p.shape, generator=noise) * p).sum()
    return loss


def _bowl(params) -> float:
    """The noiseless part of the loss, to see which way the parameters went."""
    targets = torch.Generator().manual_seed(7)
    return sum(0.5 * (p.detach() - 0.5 * torch.randn(p.shape, generator=targets)).pow(2).sum().item() for p in params)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _sync(coat_opt, coat_params, torch_opt, torch_params) -> None:
    """Give torch coat's parameters and decoded moments (the lockstep's starting point)."""
    if coat_opt.state:
        torch_opt.load_state_dict(co.to_torch_adamw_state(coat_opt))
    with torch.no_grad():
        for c, t in zip(coat_params, torch_params):
            t.copy_(c)


def _step_both(step, pairs, schedulers=(), metric=None) -> list[float]:
    losses = []
    for params, opt in pairs:
        opt.zero_grad()
        loss = _loss(params, step)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for s in schedulers:
        if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau):
            s.step(losses[0] if metric is None else metric)  # the same metric for both: same decisions
        else:
            s.step()
    return losses


def _check_lockstep(coat_opt, coat_params, torch_opt, torch_params, lr: float) -> None:
    """After a step from the same parameters and moments (lr: the largest the step used)."""
    coat_state = co.to_torch_adamw_state(coat_opt)["state"]
    for i, (c, t) in enumerate(zip(coat_params, torch_params)):
        assert c.stride() == t.stride()
        torch.testing.assert_close(c, t, rtol=PARAM_RTOL, atol=UPDATE_ATOL * lr)
        st = torch_opt.state[t]
        assert _rel(coat_state[i]["exp_avg"], st["exp_avg"]) <= M_TOL
        assert _rel(coat_state[i]["exp_avg_sq"], st["exp_avg_sq"]) <= V_TOL
        assert coat_state[i]["exp_avg"].stride() == st["exp_avg"].stride()  # laid out like torch's


def _ids(inputs):
    return [i.desc.replace(" ", "_") for i in inputs]


@pytest.mark.parametrize("optim_input", INPUTS, ids=_ids(INPUTS))
def test_optimizer_inputs_lockstep(optim_input):
    """Every CPU configuration torch's own tests construct. amsgrad is refused by design (it needs a
    running-max state the fused kernel does not keep): the error must say so."""
    kwargs = optim_input.kwargs
    if kwargs.get("amsgrad"):
        with pytest.raises(ValueError, match="amsgrad=True is not supported"):
            co.AdamW(_params(), **kwargs)
        torch.optim.AdamW(_params(), **kwargs)  # torch does accept it: the refusal is coat's own
        return
    cp, tp = _params(), _params()
    copt, topt = co.AdamW(cp, **kwargs), torch.optim.AdamW(tp, **kwargs)
    for step in range(12):
        _sync(copt, cp, topt, tp)
        _step_both(step, [(cp, copt), (tp, topt)])
        _check_lockstep(copt, cp, topt, tp, kwargs.get("lr", 1e-3))


@pytest.mark.parametrize("optim_input", [i for i in INPUTS if not i.kwargs.get("amsgrad")],
                         ids=_ids([i for i in INPUTS if not i.kwargs.get("amsgrad")]))
def test_optimizer_inputs_free_running(optim_input):
    """40 steps with nothing synced: the parameters move as torch's do (displacement within
    DRIFT_TOL) and in the right direction: the bowl's loss falls, or rises with maximize=True."""
    kwargs = optim_input.kwargs
    cp, tp, start = _params(), _params(), _params()
    copt, topt = co.AdamW(cp, **kwargs), torch.optim.AdamW(tp, **kwargs)
    for step in range(40):
        _step_both(step, [(cp, copt), (tp, topt)])
    for c, t, s in zip(cp, tp, start):
        assert _rel(c.detach() - s, t.detach() - s) <= DRIFT_TOL
    before, after = _bowl(start), _bowl(cp)
    assert (after > before) if kwargs.get("maximize") else (after < before)


@pytest.mark.parametrize("error_input", ERROR_INPUTS, ids=[e.optimizer_error_input.desc for e in ERROR_INPUTS])
def test_error_inputs_raise_as_torch(error_input):
    """Each error input raises (or warns) with torch's exception type and message, as torch's
    test_errors checks them; torch itself is run on the same input to confirm what it expects."""
    inp = error_input.optimizer_error_input
    assert error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR  # all of AdamW's CPU inputs
    for cls in (torch.optim.AdamW, co.AdamW):
        if issubclass(error_input.error_type, Warning):
            with pytest.warns(error_input.error_type, match=error_input.error_regex):
                cls(inp.params, **inp.kwargs)
        else:
            with pytest.raises(error_input.error_type, match=error_input.error_regex):
                cls(inp.params, **inp.kwargs)


@pytest.mark.parametrize("constructors", SCHEDULERS, ids=lambda cs: "+".join(type(c(
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]))).__name__ for c in cs))
def test_scheduler_inputs(constructors):
    """torch's scheduler inputs (StepLR and ReduceLROnPlateau together) drive coat's learning rate
    exactly as torch's: the same lr at every step (ReduceLROnPlateau fed the same metric), the
    parameters in lockstep, and the loss falling."""
    cp, tp = _params(), _params()
    copt, topt = co.AdamW(cp, lr=1e-2), torch.optim.AdamW(tp, lr=1e-2)
    cs = [make(copt) for make in constructors]
    ts = [make(topt) for make in constructors]
    losses, lrs = [], []
    for step in range(30):
        _sync(copt, cp, topt, tp)
        metric = _loss(cp, step).item() * (1.0 if step < 12 else 1e3)  # a plateau after 12 steps
        lr = copt.param_groups[0]["lr"]
        losses.append(_step_both(step, [(cp, copt), (tp, topt)], cs + ts, metric=metric)[0])
        _check_lockstep(copt, cp, topt, tp, lr)
        assert copt.param_groups[0]["lr"] == topt.param_groups[0]["lr"]
        lrs.append(copt.param_groups[0]["lr"])
    assert lrs[-1] < lrs[0] and len(set(lrs)) >= 3  # both schedulers acted
    assert losses[-1] < losses[0]


# ---- torch's generic optimizer tests, for the configurations above --------------------------


def test_printable_and_keeps_torch_group_keys():
    opt = co.AdamW(_params(), maximize=True, foreach=False)
    text = repr(opt)
    assert "maximize: True" in text and "m_format: e4m3" in text
    keys = set(torch.optim.AdamW(_params()).param_groups[0]) - {"decoupled_weight_decay"}
    assert keys <= set(opt.param_groups[0])  # schedulers and tools reading torch's keys find them


@pytest.mark.parametrize("optim_input", [i for i in INPUTS if not i.kwargs.get("amsgrad")],
                         ids=_ids([i for i in INPUTS if not i.kwargs.get("amsgrad")]))
def test_state_dict_round_trip(optim_input):
    """torch's _test_state_dict: a state dict loaded into an optimizer over equal parameters continues
    bit-identically, loading leaves the state dict as it was, and two such optimizers return equal
    state dicts."""
    kwargs = optim_input.kwargs
    a = _params()
    oa = co.AdamW(a, **kwargs)
    for step in range(5):
        _step_both(step, [(a, oa)])
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    ob = co.AdamW(b, **kwargs)
    sd = copy.deepcopy(oa.state_dict())
    sd_c = copy.deepcopy(oa.state_dict())
    ob.load_state_dict(sd_c)
    for step in range(5, 10):
        _step_both(step, [(a, oa), (b, ob)])
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    _assert_equal_state_dicts(sd, sd_c)
    _assert_equal_state_dicts(oa.state_dict(), ob.state_dict())


def _assert_equal_state_dicts(x, y) -> None:
    assert x["param_groups"] == y["param_groups"]
    assert x["state"].keys() == y["state"].keys()
    for i in x["state"]:
        for k, t in x["state"][i].items():
            u = y["state"][i][k]
            assert t.dtype == u.dtype and t.stride() == u.stride(), k
            assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t,
                               u.view(torch.uint8) if u.element_size() == 1 else u), k


def test_loads_older_state_dicts():
    """torch's test_can_load_older_state_dict and test_load_nontensor_step: groups without torch's
    newer keys and steps saved as Python floats load and step as the current format does."""
    a = _params()
    oa = co.AdamW(a, lr=1e-2)
    for step in range(3):
        _step_both(step, [(a, oa)])
    sd = copy.deepcopy(oa.state_dict())
    for g in sd["param_groups"]:
        for k in ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused"):
            del g[k]
    for st in sd["state"].values():
        st["step"] = st["step"].item()
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    ob = co.AdamW(b, lr=1e-2)
    ob.load_state_dict(sd)
    assert ob.param_groups[0]["maximize"] is False and ob.param_groups[0]["foreach"] is None
    for step in range(3, 6):
        _step_both(step, [(a, oa), (b, ob)])
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_save_load_with_weights_only(tmp_path):
    a = _params()
    oa = co.AdamW(a, weight_decay=0.1, maximize=True)
    _step_both(0, [(a, oa)])
    torch.save(oa.state_dict(), tmp_path / "optim.pt")
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    ob = co.AdamW(b, weight_decay=0.1, maximize=True)
    ob.load_state_dict(torch.load(tmp_path / "optim.pt", weights_only=True))
    _step_both(1, [(a, oa), (b, ob)])
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_step_is_noop_without_gradients_or_with_zero_gradients():
    """torch's test_step_is_noop_when_params_have_no_grad / _for_zero_grads (weight_decay 0: with
    decay a zero gradient still shrinks the weights, in torch too)."""
    ps = _params()
    before = [p.detach().clone() for p in ps]
    opt = co.AdamW(ps, weight_decay=0.0)
    opt.step()
    assert not opt.state and all(torch.equal(p, b) for p, b in zip(ps, before))
    for p in ps:
        p.grad = torch.zeros_like(p)
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before))
    assert all(opt.state[p]["step"].item() == 1 for p in ps)  # the step counts, as in torch


def test_param_groups_lr_and_weight_decay():
    """torch's test_param_groups_lr / _weight_decay: per-group hyperparameters, in lockstep."""
    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3, "weight_decay": 0.5, "maximize": True}]

    cp, tp = _params(), _params()
    copt, topt = co.AdamW(groups(cp), lr=1e-3), torch.optim.AdamW(groups(tp), lr=1e-3)
    for step in range(6):
        _sync(copt, cp, topt, tp)
        _step_both(step, [(cp, copt), (tp, topt)])
        _check_lockstep(copt, cp, topt, tp, 3e-3)


def test_tensor_lr_matches_float_lr():
    lr = float(torch.tensor(3e-3))  # the fp32 value: both runs then use the same learning rate
    a, b = _params(), _params()
    oa, ob = co.AdamW(a, lr=lr), co.AdamW(b, lr=torch.tensor(lr))
    for step in range(4):
        _step_both(step, [(a, oa), (b, ob)])
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("foreach,fused,capturable", [(f, u, c) for f, u, c in itertools.product(
    (None, False, True), (None, False, True), (False, True)) if not (f and u)])
def test_implementation_flags_change_nothing(foreach, fused, capturable):
    """torch's foreach_matches_forloop / fused_matches_forloop: coat has one implementation, so every
    accepted combination gives the default's result bit for bit."""
    a, b = _params(), _params()
    oa = co.AdamW(a, lr=1e-2, weight_decay=0.1)
    ob = co.AdamW(b, lr=1e-2, weight_decay=0.1, foreach=foreach, fused=fused, capturable=capturable)
    for step in range(3):
        _step_both(step, [(a, oa), (b, ob)])
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_hooks_run_as_torch_runs_them():
    """torch's step, state_dict and load_state_dict hook tests: every hook runs once, in order, and
    the load post-hook sees the states already loaded."""
    ps = _params()
    opt = co.AdamW(ps)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("step_pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("step_post", len(o.state))))
    _step_both(0, [(ps, opt)])
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd_pre"))

    def sd_post(o, sd):
        calls.append("sd_post")
        sd["note"] = "added by a post-hook"
        return sd

    opt.register_state_dict_post_hook(sd_post)
    sd = opt.state_dict()
    assert sd["note"] == "added by a post-hook"
    fresh = co.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ps])

    def load_pre(o, sd):
        calls.append("load_pre")
        sd["param_groups"][0]["lr"] = 5e-4  # a pre-hook may edit what is loaded
        return sd

    fresh.register_load_state_dict_pre_hook(load_pre)
    fresh.register_load_state_dict_post_hook(
        lambda o: calls.append(("load_post", len(o.state), o.param_groups[0]["lr"])))
    fresh.load_state_dict(sd)
    assert calls == ["step_pre", ("step_post", len(ps)), "sd_pre", "sd_post", "load_pre",
                     ("load_post", len(ps), 5e-4)]


def test_complex_parameters_are_refused():
    """INFO.supports_complex is True for torch; coat's kernel has no complex path (by design):
    a clear error before anything is written."""
    assert INFO.supports_complex
    z = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="complex"):
        co.AdamW([z])
