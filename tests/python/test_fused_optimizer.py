"""The optimizer seam (coat.optim.FusedOptimizer): a new optimizer implements the protocol's hooks
and gets bucketing, descriptor tables, the step skeleton, state dicts, pickling and gradient release.
Here plain SGD, its "kernel" torch ops on the CPU, proves the seam usable without a new kernel."""

from __future__ import annotations

import copy

import pytest
import torch

import coat.optim as co


class _SGD(co.FusedOptimizer):
    """Plain SGD through the protocol: one row (parameter and gradient pointers) per tensor."""

    display_name = "test SGD"
    _desc_words = 2

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr, maximize=False))
        self.kernel_calls = []

    def _check_group(self, group):
        if not isinstance(group["lr"], (int, float)) or group["lr"] < 0:
            raise ValueError(f"Invalid learning rate: {group['lr']}")

    def _launch_key(self, local, grad, group):
        return (grad.dtype,)

    def _new_state(self, p, local, group, index):
        return {"step": torch.zeros((), dtype=torch.float32)}

    def _check_state(self, state, local):
        pass

    def _descriptor_row(self, p, local, grad, state, begin):
        return [local.data_ptr(), grad.data_ptr()]

    def _row_groups(self, local):
        return 1

    def _load_state(self, saved, p, local, group, what):
        return {"step": saved["step"].detach().float().clone()}

    def _run_kernel(self, key, items, table, n_groups, group, lr, grads, found_inf):
        kept = [it for it in items if it[1].numel()]
        assert n_groups == len(kept) and table.tolist() == [[t.data_ptr(), g.data_ptr()] for _, t, g, _ in kept]
        self.kernel_calls.append((key, len(items)))
        if found_inf is not None and bool(found_inf.item()):
            return
        scale = -1.0 if grads.maximize else 1.0
        for s in (grads.amp_scale, grads.clip_scale):
            scale *= 1.0 if s is None else float(1.0 / s.item())
        for _, local, grad, _ in kept:
            local.add_(grad, alpha=-group["lr"] * scale)


def _model(seed=0):
    torch.manual_seed(seed)
    return _Net(torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3)))


class _Net(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.layers = layers
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x).square().mean()


def _train(model, opt, steps=3):
    torch.manual_seed(1)
    for _ in range(steps):
        model(torch.randn(5, 4)).backward()
        opt.step()
        opt.zero_grad()


def test_a_minimal_subclass_steps_as_torch_sgd():
    model, ref = _model(), _model()
    opt = _SGD(model.parameters(), lr=0.05)
    _train(model, opt)
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.05))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert all(float(opt.state[p]["step"]) == 3 for p in model.parameters())
    assert len(opt.kernel_calls) == 3 and opt.kernel_calls[0][1] == len(list(model.parameters()))
    assert opt.state_bytes() == 4 * len(list(model.parameters()))


def test_state_dict_round_trip_and_copies():
    model = _model()
    opt = _SGD(model.parameters())
    _train(model, opt, steps=2)
    sd = opt.state_dict()
    assert sorted(sd["state"]) == list(range(len(list(model.parameters()))))
    fresh = _SGD(model.parameters())
    fresh.load_state_dict(sd)
    assert all(float(fresh.state[p]["step"]) == 2 for p in model.parameters())
    c = copy.deepcopy(opt)
    assert c.nonfinite == "propagate" and c._desc_cache == {} and c.release_handle is None
    with pytest.raises(ValueError, match="Invalid learning rate"):
        fresh.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "lr": -1.0})


def test_gradient_release_drives_a_new_optimizer():
    plain, released = _model(), _model()
    _train(plain, _SGD(plain.parameters()))
    opt = _SGD(released.parameters())
    with co.step_in_backward(opt, released) as release:
        assert opt.release_handle is release and len(release.buckets) == 5
        _train(released, opt)
        assert release.stats["launches"] >= 5 * 3
        assert all(p.grad is None for p in released.parameters())
    assert opt.release_handle is None
    for p, q in zip(plain.parameters(), released.parameters()):
        assert torch.equal(p, q)
    # The launches under release carry its tag after the subclass's key.
    assert any(key[-2] == "release" for key, _ in opt.kernel_calls)


def test_release_refuses_other_optimizers():
    model = _model()
    with pytest.raises(TypeError, match="needs a coat optimizer whose step is planned"):
        co.step_in_backward(torch.optim.SGD(model.parameters(), lr=0.1), model)
