"""A parameter changed in place between steps keeps the change under an fp32 master (as with
torch.optim.AdamW: the master is read from the parameter again; SubsetNormSM's matrices too), and a
parameter shrunk in place at the same address is checked again rather than stepped with its old
size."""

from __future__ import annotations

import pytest
import torch

import coat.optim as co

OPTIMIZERS = [co.AdamW, co.AdamW4bit]
# the CUDA kernels take the re-read master through their own path: both devices
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _params(n: int = 4096, device: str = "cpu") -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    w = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device) * 0.05
    return (torch.nn.Parameter(w.to(torch.bfloat16)), torch.nn.Parameter(w.clone()))


def _grad(step: int, n: int = 4096, device: str = "cpu") -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + step)).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_an_in_place_edit_between_steps_stands(cls, device):
    p, ref = _params(device=device)
    opt = cls([p], lr=1e-2, weight_decay=0.0, master_weights="fp32")
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.0)
    for step in range(6):
        g = _grad(step, device=device).to(torch.bfloat16)
        p.grad, ref.grad = g, g.float()
        opt.step()
        torch_opt.step()
        if step == 2:  # a rollback, a clamp: what users do to weights between steps
            with torch.no_grad():
                p.fill_(0.5)
                ref.fill_(0.5)
    # both continue from 0.5: within a few lr of it after 3 more steps (the old master is ~0.05 away)
    assert (p.float() - 0.5).abs().max() < 0.04 and (ref - 0.5).abs().max() < 0.04
    torch.testing.assert_close(p.float(), ref.to(torch.bfloat16).float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_loaded_master_is_kept_when_the_model_was_loaded_first(cls, device):
    """coat train's resume order: model.load_state_dict (an in-place copy), then the optimizer's:
    the saved fp32 master, not the bf16 parameter, continues (exact resume)."""
    p, _ = _params(device=device)
    opt = cls([p], lr=1e-2, master_weights="fp32")
    for step in range(3):
        p.grad = _grad(step, device=device).to(torch.bfloat16)
        opt.step()
    saved_p, saved_opt = p.detach().clone(), opt.state_dict()
    master = opt.state[p]["master"].clone()
    q, _ = _params(device=device)
    again = cls([q], lr=1e-2, master_weights="fp32")
    with torch.no_grad():
        q.copy_(saved_p)
    again.load_state_dict(saved_opt)
    q.grad = p.grad = _grad(3, device=device).to(torch.bfloat16)
    opt.step()
    again.step()
    assert torch.equal(q, p) and not torch.equal(master, opt.state[p]["master"])
    torch.testing.assert_close(again.state[q]["master"], opt.state[p]["master"], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_parameter_shrunk_at_the_same_address_is_refused(cls, device):
    p = torch.nn.Parameter(torch.randn(4096, device=device))
    opt = cls([p], lr=1e-2)
    p.grad = torch.randn(4096, device=device)
    opt.step()
    p.data = p.data[:128]  # same address, fewer elements: the cached table must not be reused
    p.grad = torch.randn(128, device=device)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="shape"):
        opt.step()
    assert torch.equal(p, before)


@pytest.mark.parametrize("device", DEVICES)
def test_subset_norm_sm_matrices_keep_an_edit(device):
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)).to(device) * 0.05
    p = torch.nn.Parameter(w.to(torch.bfloat16))
    opt = co.SubsetNormSM([p], lr=1e-3, rank=8, master_weights="fp32")
    for step in range(6):
        p.grad = torch.randn(64, 48, generator=torch.Generator().manual_seed(step)).to(device, torch.bfloat16)
        opt.step()
        if step == 2:
            with torch.no_grad():
                p.fill_(0.5)
    assert (p.float() - 0.5).abs().max() < 0.02  # three small steps from 0.5, not back to ~0.05
    torch.testing.assert_close(opt.state[p]["master"].to(torch.bfloat16), p.detach(), rtol=0, atol=0)


def _views_of_one_buffer(device: str) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    """Two bf16 matrices that are views of one flat buffer: they share autograd's version counter,
    so a step's write to either moves both versions."""
    flat = (torch.randn(2 * 64 * 48, generator=torch.Generator().manual_seed(0)) * 0.05).to(device, torch.bfloat16)
    return (torch.nn.Parameter(flat[: 64 * 48].view(64, 48)), torch.nn.Parameter(flat[64 * 48:].view(64, 48)))


def _steps(opt, params, n: int = 20, device: str = "cpu") -> None:
    for step in range(n):
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, 1.0) if i == 0 else torch.full_like(p, -1.0)
        opt.step()


MAKERS = [lambda g: co.AdamW(g, lr=1e-4, weight_decay=0.0, master_weights="fp32"),
          lambda g: co.AdamW4bit(g, lr=1e-4, weight_decay=0.0, master_weights="fp32"),
          lambda g: co.SubsetNormSM(g, lr=1e-4, rank=4, weight_decay=0.0, master_weights="fp32")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", MAKERS, ids=["AdamW", "AdamW4bit", "SubsetNormSM"])
def test_views_of_one_buffer_keep_their_masters(make, device):
    """Stepped in two launches (two groups), each view's write moved the other's version: the
    master must still carry the sub-ulp progress (it was read back from the bf16 weights before)."""
    views = _views_of_one_buffer(device)
    apart = tuple(torch.nn.Parameter(v.detach().clone()) for v in views)
    opt_views = make([{"params": [views[0]]}, {"params": [views[1]]}])
    opt_apart = make([{"params": [apart[0]]}, {"params": [apart[1]]}])
    _steps(opt_views, views, device=device)
    _steps(opt_apart, apart, device=device)
    for v, a in zip(views, apart):
        torch.testing.assert_close(opt_views.state[v]["master"], opt_apart.state[a]["master"], rtol=0, atol=0)
        assert torch.equal(v, a)
    # the masters moved by ~20 lr; the bf16 weights alone would have lost most of it (a bf16 ulp at
    # 0.05 is ~2.4e-4, over twice the lr)
    moved = (opt_views.state[views[0]]["master"] - views[0].detach().float()).abs().max()
    assert moved > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", MAKERS, ids=["AdamW", "AdamW4bit", "SubsetNormSM"])
def test_an_edit_of_some_elements_keeps_the_others_masters(make, device):
    """Only the edited elements take the new value; the rest keep their master's precision."""
    p = torch.nn.Parameter((torch.randn(64, 48, generator=torch.Generator().manual_seed(1)) * 0.05).to(device, torch.bfloat16))
    opt = make([p])
    _steps(opt, [p], n=5, device=device)
    master = opt.state[p]["master"].clone()
    with torch.no_grad():
        p[0].fill_(0.5)
    p.grad = torch.zeros_like(p)
    opt.step()  # a zero gradient: only weight decay (0) and the moments move the weights
    new = opt.state[p]["master"]
    assert (new[0] - 0.5).abs().max() < 1e-3
    assert ((new[1:] - master[1:]).abs() <= 5e-4).all() and not torch.equal(new[1:].to(torch.bfloat16).float(), new[1:])


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_the_optimizer_loaded_before_the_model_keeps_its_masters(cls):
    """The other resume order: optimizer state first, then model.load_state_dict (which moves the
    versions): the loaded masters continue, as in the model-first order."""
    p, _ = _params()
    opt = cls([p], lr=1e-2, master_weights="fp32")
    for step in range(3):
        p.grad = _grad(step).to(torch.bfloat16)
        opt.step()
    saved_p, saved_opt = p.detach().clone(), opt.state_dict()
    q, _ = _params()
    again = cls([q], lr=1e-2, master_weights="fp32")
    again.load_state_dict(saved_opt)
    with torch.no_grad():
        q.copy_(saved_p)
    q.grad = p.grad = _grad(3).to(torch.bfloat16)
    opt.step()
    again.step()
    assert torch.equal(q, p)
    torch.testing.assert_close(again.state[q]["master"], opt.state[p]["master"], rtol=0, atol=0)


@pytest.mark.parametrize("perm", [None, (2, 0, 1)], ids=["contiguous", "permuted"])
def test_adopting_edits_in_slices_equals_one_pass(perm):
    from coat.optim._state import adopt_edits

    local = (torch.randn(8, 6, 5, generator=torch.Generator().manual_seed(2))).to(torch.bfloat16)
    local = local.permute(*perm) if perm else local
    master = torch.empty_like(local, dtype=torch.float32).copy_(local.float() + 1e-4)
    with torch.no_grad():
        local[0] = 0.5
    expect = torch.where(local == master.to(local.dtype), master, local.float())
    adopt_edits(master, local, chunk=17)  # slices that split rows of every dimension
    assert torch.equal(master, expect) and master.stride() == local.stride()


@pytest.mark.parametrize("make", MAKERS[:2], ids=["AdamW", "AdamW4bit"])
def test_views_stepped_by_several_launches_are_in_sync_after_the_step(make, monkeypatch):
    """The launches of one step move each other's shared versions: that is not an edit, so no
    step re-reads the masters (an extra pass over them every step), and a CUDA graph's capture
    (which refuses edits) is not refused; a replay's version bump marked synced is not one either."""
    import coat.optim._compat as compat
    import coat.optim._state as st

    calls = []
    real = st.adopt_edits
    monkeypatch.setattr(st, "adopt_edits", lambda *a, **k: (calls.append(1), real(*a, **k)))
    views = _views_of_one_buffer("cpu")
    opt = make([{"params": [views[0]]}, {"params": [views[1]]}])
    _steps(opt, views, n=5)
    assert not calls
    compat.bump_versions(list(views))  # what CudaGraphStep's replay does after writing the weights
    opt.mark_synced(views)
    _steps(opt, views, n=1)
    assert not calls
