"""Review of coat.optim.AdamW4bit: combinations that must either step right or be refused before
anything is written (CPU path)."""

from __future__ import annotations

import pytest
import torch

import coat.optim as co


@pytest.mark.parametrize("cls", [co.AdamW4bit, co.AdamW])
def test_master_mismatch_after_dtype_change_is_refused_before_any_write(cls):
    """A parameter cast after its state exists (fp32 -> bf16: the state has no fp32 master) is
    refused while planning, before another group's launch has written its parameter or counted
    a step."""
    a = torch.nn.Parameter(torch.randn(600, 700))
    b = torch.nn.Parameter(torch.randn(10))
    opt = cls([{"params": [a]}, {"params": [b]}])
    a.grad, b.grad = torch.randn(600, 700), torch.randn(10)
    opt.step()
    b.data = b.data.bfloat16()
    b.grad = torch.randn(10, dtype=torch.bfloat16)
    a.grad = torch.randn(600, 700)
    before = a.detach().clone()
    with pytest.raises(ValueError, match="master"):
        opt.step()
    assert torch.equal(a, before)
    assert [s["step"].item() for s in opt.state.values()] == [1.0, 1.0]


def test_bf16_master_state_on_fp32_parameter_is_refused_before_any_write():
    a = torch.nn.Parameter(torch.randn(600, 700))
    b = torch.nn.Parameter(torch.randn(10, dtype=torch.bfloat16))
    opt = co.AdamW4bit([{"params": [a]}, {"params": [b]}])
    a.grad, b.grad = torch.randn(600, 700), torch.randn(10, dtype=torch.bfloat16)
    opt.step()
    b.data = b.data.float()
    b.grad = torch.randn(10)
    a.grad = torch.randn(600, 700)
    before = a.detach().clone()
    with pytest.raises(ValueError, match="master"):
        opt.step()
    assert torch.equal(a, before)


def test_coupled_weight_decay_of_torch_adam_is_refused():
    """torch.optim.Adam's weight_decay is an L2 term added to the gradient, not AdamW's decoupled
    decay: its state dict (decoupled_weight_decay=False) must not load as if it were AdamW's."""
    p = torch.nn.Parameter(torch.randn(10))
    adam = torch.optim.Adam([p], weight_decay=0.1)
    p.grad = torch.randn(10)
    adam.step()
    sd = adam.state_dict()
    if "decoupled_weight_decay" not in sd["param_groups"][0]:
        pytest.skip("this torch's Adam does not record decoupled_weight_decay")
    opt = co.AdamW4bit([torch.nn.Parameter(p.detach().clone())])
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["weight_decay"] == 1e-2 and not opt.state
    # without weight decay Adam and AdamW are the same step: that loads
    q = torch.nn.Parameter(torch.randn(10))
    adam0 = torch.optim.Adam([q])
    q.grad = torch.randn(10)
    adam0.step()
    co.AdamW4bit([torch.nn.Parameter(q.detach().clone())]).load_state_dict(adam0.state_dict())
    # a torch.optim.AdamW state dict (decoupled) loads for fp32 states of small tensors
    r = torch.nn.Parameter(torch.randn(10))
    adamw = torch.optim.AdamW([r], weight_decay=0.1)
    r.grad = torch.randn(10)
    adamw.step()
    co.AdamW4bit([torch.nn.Parameter(r.detach().clone())]).load_state_dict(adamw.state_dict())


def test_matches_torch_adamw_on_small_tensors_across_groups():
    """fp32 states (<= 4096 elements): the step is torch.optim.AdamW's for groups with their own lr
    and weight decay, a group added later, 0-d, empty and non-contiguous parameters, maximize, lr as
    a tensor and a parameter without a gradient in one step."""
    torch.manual_seed(0)
    shapes = [(10,), (3, 4), (), (0,), (7, 5)]
    ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ps[4] = torch.nn.Parameter(torch.randn(5, 7).t())  # non-contiguous
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    hyper = [dict(lr=0.1, weight_decay=0.5), dict(lr=1e-3, weight_decay=0.0), dict(lr=0.3),
             dict(), dict(lr=torch.tensor(0.02), maximize=True)]
    a = co.AdamW4bit([{"params": [p], **h} for p, h in zip(ps[:4], hyper)], lr=1e-2)
    b = torch.optim.AdamW([{"params": [q], **h} for q, h in zip(qs[:4], hyper)], lr=1e-2)
    for t in range(4):
        if t == 2:
            a.add_param_group({"params": [ps[4]], **hyper[4]})
            b.add_param_group({"params": [qs[4]], **hyper[4]})
        for i, (p, q) in enumerate(zip(ps, qs)):
            g = torch.randn(q.shape)
            p.grad, q.grad = (None, None) if (t == 1 and i == 0) else (g.clone(), g.clone())
        a.step()
        b.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


def _transposed(seed: int = 0) -> torch.nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(5000, 3, generator=g).t())  # (3, 5000), non-contiguous: block states


def test_block_states_follow_the_memory_order_they_were_made_in():
    """Block codes follow the parameter's memory order: a parameter re-laid out after its state
    exists, or a state saved for another layout, is refused rather than stepped with another
    element's moments."""
    p = _transposed()
    opt = co.AdamW4bit([p])
    p.grad = torch.randn(3, 5000)
    opt.step()
    sd = opt.state_dict()
    p.data = p.data.contiguous()  # same shape, other memory order
    p.grad = torch.randn(3, 5000)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="memory"):
        opt.step()
    assert torch.equal(p, before)
    q = torch.nn.Parameter(_transposed().detach().contiguous())
    with pytest.raises(ValueError, match="memory"):
        co.AdamW4bit([q]).load_state_dict(sd)
    # the same layout loads and resumes exactly; a contiguous state refuses a transposed parameter
    a, b = _transposed(), _transposed()
    oa = co.AdamW4bit([a])
    a.grad = torch.randn(3, 5000)
    oa.step()
    ob = co.AdamW4bit([b])
    ob.load_state_dict(oa.state_dict())
    b.data.copy_(a.data)
    g = torch.randn(3, 5000)
    a.grad, b.grad = g.clone(), g.clone()
    oa.step()
    ob.step()
    assert torch.equal(a, b)
    c = torch.nn.Parameter(torch.randn(3, 5000))
    oc = co.AdamW4bit([c])
    c.grad = torch.randn(3, 5000)
    oc.step()
    with pytest.raises(ValueError, match="memory"):
        co.AdamW4bit([_transposed()]).load_state_dict(oc.state_dict())


@pytest.mark.parametrize("cls", [co.AdamW4bit, co.AdamW])
def test_refused_add_param_group_leaves_no_group(cls):
    """A group refused by add_param_group must not stay in param_groups (it would step anyway)."""
    p = torch.nn.Parameter(torch.randn(10, dtype=torch.bfloat16))
    opt = cls([p], master_weights="bf16_sr")
    with pytest.raises(ValueError, match="bfloat16"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(10))]})
    with pytest.raises(ValueError, match="learning rate"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(10, dtype=torch.bfloat16))], "lr": -1.0})
    assert len(opt.param_groups) == 1


def test_corrupt_master_in_a_state_dict_is_refused_with_value_error():
    p = torch.nn.Parameter(torch.randn(600, 700, dtype=torch.bfloat16))
    opt = co.AdamW4bit([p])
    p.grad = torch.randn(600, 700, dtype=torch.bfloat16)
    opt.step()
    sd = opt.state_dict()
    for bad in ([1.0, 2.0], torch.zeros(600 * 700, dtype=torch.int32), torch.zeros(7)):
        st = dict(sd["state"][0], master=bad)
        fresh = co.AdamW4bit([torch.nn.Parameter(p.detach().clone())])
        with pytest.raises(ValueError, match="master"):
            fresh.load_state_dict({"state": {0: st}, "param_groups": sd["param_groups"]})
        assert not fresh.state


def test_corrupt_step_in_a_state_dict_is_refused_with_value_error():
    p = torch.nn.Parameter(torch.randn(600, 700))
    opt = co.AdamW4bit([p])
    p.grad = torch.randn(600, 700)
    opt.step()
    sd = opt.state_dict()
    for bad in (torch.tensor(float("nan")), torch.tensor(-1.0), torch.tensor([1.0, 2.0]), "3", 1.5):
        st = dict(sd["state"][0], step=bad)
        fresh = co.AdamW4bit([torch.nn.Parameter(p.detach().clone())])
        with pytest.raises(ValueError, match="step"):
            fresh.load_state_dict({"state": {0: st}, "param_groups": sd["param_groups"]})
    fresh.load_state_dict({"state": {0: dict(sd["state"][0], step=1)}, "param_groups": sd["param_groups"]})


@pytest.mark.parametrize("cls", [co.AdamW4bit, co.AdamW])
def test_a_kernel_call_refused_takes_its_step_count_back(cls, monkeypatch):
    """The step count is raised before the kernel reads it; a kernel call that raises (its argument
    checks) leaves the count as it was, so a retried step is not counted twice."""
    p = torch.nn.Parameter(torch.randn(600, 700))
    opt = cls([p])
    p.grad = torch.randn(600, 700)
    opt.step()

    def refuse(*args, **kwargs):
        raise ValueError("refused by the kernel's checks")

    monkeypatch.setattr(opt, "_run_kernel", refuse)
    with pytest.raises(ValueError, match="refused"):
        opt.step()
    assert opt.state[p]["step"].item() == 1.0
