"""What coat.optim cannot do right it refuses by name: torch state dicts whose settings the conversion
would drop (torch.optim.Adam's L2 weight decay), conversions of optimizers other than coat.optim.AdamW,
and torch.optim.AdamW's keywords that coat.optim.SubsetNormSM does not implement. Each with the case
next to it that works. Tiny tensors on the CPU."""

from __future__ import annotations

import pytest
import torch

import coat.optim as co

LR = 1e-2


def _torch_state(cls, steps: int = 1, **kw) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(256))
    opt = cls([p], lr=LR, **kw)
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        opt.step()
    return p, opt


def _pair() -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    torch.manual_seed(0)
    return torch.nn.Parameter(torch.randn(32, 16)), torch.nn.Parameter(torch.randn(16))


# ---- from_torch_adamw_state: torch.optim.Adam's L2 weight decay ------------------------------------

def test_adam_l2_decay_refused():
    p, ta = _torch_state(torch.optim.Adam, weight_decay=0.1)
    sd = ta.state_dict()
    assert sd["param_groups"][0]["decoupled_weight_decay"] is False
    oc = co.AdamW([torch.nn.Parameter(p.detach().clone())], lr=LR)
    with pytest.raises(ValueError, match=r"decoupled_weight_decay=False with weight_decay=0.1.*torch.optim.Adam"):
        co.from_torch_adamw_state(sd, oc)


@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.1, "decoupled_weight_decay": True}])
def test_adam_without_l2_converts(kw):
    """Adam without weight decay (or with decoupled decay: AdamW) is AdamW's step: converted, it
    continues as torch does (constant gradients: the FP8 moments are exact)."""
    p, ta = _torch_state(torch.optim.Adam, **kw)
    q = torch.nn.Parameter(p.detach().clone())
    oc = co.AdamW([q], lr=LR)
    oc.load_state_dict(co.from_torch_adamw_state(ta.state_dict(), oc))
    assert oc.param_groups[0]["weight_decay"] == kw.get("weight_decay", 0)
    for _ in range(2):
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
        ta.step()
        oc.step()
    assert ((p - q).abs().max() / LR).item() < 1e-3


def test_torch_flags_carried_or_refused():
    p, ta = _torch_state(torch.optim.AdamW, maximize=True)
    oc = co.AdamW([torch.nn.Parameter(p.detach().clone())], lr=LR)
    oc.load_state_dict(co.from_torch_adamw_state(ta.state_dict(), oc))
    assert oc.param_groups[0]["maximize"] is True
    _, ta = _torch_state(torch.optim.AdamW, amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        co.from_torch_adamw_state(ta.state_dict(), oc)
    _, tx = _torch_state(torch.optim.Adamax)  # exp_inf, not exp_avg_sq: not AdamW's state
    with pytest.raises(ValueError, match=r"not a torch.optim.AdamW state \(keys \['exp_avg', 'exp_inf', 'step'\]\)"):
        co.from_torch_adamw_state(tx.state_dict(), oc)


# ---- conversions of coat's other optimizers --------------------------------------------------------

def _stepped(opt: torch.optim.Optimizer, params) -> torch.optim.Optimizer:
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def test_adamw4bit_conversions_refused():
    W, b = _pair()
    opt = _stepped(co.AdamW4bit([W, b], lr=LR), (W, b))
    with pytest.raises(TypeError, match=r"got a coat.optim.adamw4bit.AdamW4bit.*coat.optim.AdamW \(FP8 states\) only"):
        co.to_torch_adamw_state(opt)
    with pytest.raises(ValueError, match=r"state\[0\] is not a coat.optim.AdamW state"):
        co.to_torch_adamw_state(opt.state_dict())
    _, ta = _torch_state(torch.optim.AdamW)
    with pytest.raises(TypeError, match=r"from_torch_adamw_state got a coat.optim.adamw4bit.AdamW4bit"):
        co.from_torch_adamw_state(ta.state_dict(), opt)


def test_snsm_conversions_refused_but_its_adamw_part_converts():
    W, b = _pair()
    opt = _stepped(co.SubsetNormSM([W, b], lr=LR, rank=4), (W, b))
    with pytest.raises(TypeError, match=r"got a coat.optim.subset_norm.SubsetNormSM.*pass opt.adamw"):
        co.to_torch_adamw_state(opt)
    with pytest.raises(ValueError, match=r"param_groups\[0\] is a coat.optim.SubsetNormSM group"):
        co.to_torch_adamw_state(opt.state_dict())
    tsd = co.to_torch_adamw_state(opt.adamw)  # b, the AdamW part's only parameter
    assert list(tsd["state"]) == [0] and tsd["state"][0]["exp_avg"].shape == b.shape
    with pytest.raises(TypeError, match=r"from_torch_adamw_state got a coat.optim.subset_norm.SubsetNormSM"):
        co.from_torch_adamw_state(tsd, opt)
    opt.adamw.load_state_dict(co.from_torch_adamw_state(tsd, opt.adamw))
    torch.testing.assert_close(co.to_torch_adamw_state(opt.adamw)["state"][0]["exp_avg"], tsd["state"][0]["exp_avg"])


# ---- SubsetNormSM: torch.optim.AdamW's keywords it does not implement -------------------------------

_FLAGS = [("maximize", True), ("amsgrad", True), ("foreach", True), ("fused", True), ("capturable", True),
          ("differentiable", True)]


@pytest.mark.parametrize("key,val", _FLAGS)
def test_snsm_refuses_torch_flags(key, val):
    W, b = _pair()
    with pytest.raises(ValueError, match=rf"^{key}=True is not supported by coat.optim.SubsetNormSM"):
        co.SubsetNormSM([{"params": [W, b], key: val}], lr=LR, rank=4)
    with pytest.raises(ValueError, match=rf"adamw_options: {key}=True is not supported"):
        co.SubsetNormSM([W, b], lr=LR, rank=4, adamw_options={key: val})
    opt = co.SubsetNormSM([W], lr=LR, rank=4)
    with pytest.raises(ValueError, match=rf"^{key}=True"):
        opt.add_param_group({"params": [b], key: val})
    assert len(opt.param_groups) == 1 and len(opt.adamw.param_groups) == 1  # refused: not added
    _stepped(opt, (W,))  # and the optimizer still steps
    sd = opt.state_dict()
    sd["param_groups"][0][key] = val
    before = opt.state_dict()
    with pytest.raises(ValueError, match=rf"^{key}=True"):
        opt.load_state_dict(sd)
    assert key not in opt.param_groups[0]
    torch.testing.assert_close(opt.state_dict()["state"], before["state"])


def test_snsm_refuses_flags_as_keywords_and_l2_decay():
    W, b = _pair()
    with pytest.raises(TypeError, match="maximize"):
        co.SubsetNormSM([W, b], lr=LR, maximize=True)
    with pytest.raises(ValueError, match="decoupled_weight_decay=False with weight_decay=0.1"):
        co.SubsetNormSM([{"params": [W, b], "decoupled_weight_decay": False, "weight_decay": 0.1}], lr=LR)


def test_snsm_harmless_flag_values_accepted():
    """False (or None for foreach / fused), as torch.optim.AdamW's groups hold them, steps exactly as
    without them: downhill for a positive gradient."""
    harmless = dict(maximize=False, amsgrad=False, foreach=None, fused=False, capturable=False,
                    differentiable=False, decoupled_weight_decay=False)  # without weight decay: no L2 term
    results = []
    for extra in ({}, harmless):
        W, b = _pair()
        W0, b0 = W.detach().clone(), b.detach().clone()
        _stepped(co.SubsetNormSM([{"params": [W, b], **extra}], lr=LR, rank=4), (W, b))
        assert (W < W0).all() and (b < b0).all()
        results.append((W.detach().clone(), b.detach().clone()))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


@pytest.mark.parametrize("cls", [co.AdamW, co.AdamW4bit])
@pytest.mark.parametrize("flag", ["amsgrad", "differentiable"])
def test_refusals_name_the_optimizer_they_come_from(cls, flag):
    with pytest.raises(ValueError, match=f"not supported by {cls.display_name}:"):
        cls([torch.nn.Parameter(torch.randn(4))], **{flag: True})


def test_subset_norm_sm_refuses_fp16_matrices_under_bf16_sr():
    """bf16_sr keeps no master: an fp16 matrix would be rounded to nearest without one (updates
    below its ulp lost), where every other fp16 parameter is refused."""
    with pytest.raises(ValueError, match="bfloat16"):
        co.SubsetNormSM([torch.nn.Parameter(torch.randn(32, 16, dtype=torch.float16))], lr=1e-3, rank=4,
                        master_weights="bf16_sr")
