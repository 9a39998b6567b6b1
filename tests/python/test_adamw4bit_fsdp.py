"""coat.optim.AdamW4bit on FSDP2 shards (two CPU gloo ranks): sharded parameters step with blocks of
128 for v (each shard's own, as rank-1 column maxima would span ranks), which for shards of whole
blocks is the unsharded parameter's block layout: the sharded run equals a single-process run whose
matrices take blocks too. Their states save as DTensors: a torch.distributed.checkpoint resumes bit
for bit, and a load at another shard layout is refused."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _dist import end_worker, free_port

import coat.optim as co

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _model():
    torch.manual_seed(0)  # 256 x 128 and 64 x 256 weights: blocks unsharded too (too thin for rank-1)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 128, generator=g), torch.randn(16, 64, generator=g)) for _ in range(3)]


def _run(model, opt, batches=None, dtype=torch.float32):
    for x, y in _batches() if batches is None else batches:
        ((model(x.to(dtype)) - y.to(dtype)) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def _sharded(world: int, dtype: torch.dtype = torch.float32, master: str = "fp32"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model().to(dtype)
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, co.AdamW4bit(model.parameters(), lr=1e-2, master_weights=master)


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    _init(rank, world, port)
    try:
        model, opt = _sharded(world)
        _run(model, opt)  # every rank the same batches: the averaged gradients are the unsharded ones
        kinds = [co.adamw4bit._state4.state_kind(opt.state[p]) for p in model.parameters()]
        sd = opt.state_dict()
        dtensors = sorted(k for st in sd["state"].values() for k, v in st.items() if type(v).__name__ == "DTensor")
        # no key a distributed checkpoint written before it would lack (DCP loads into these keys)
        keys = sorted({k for st in sd["state"].values() for k in st})
        full = [p.full_tensor().detach() for p in model.parameters()]
        if rank == 0:
            torch.save({"params": full, "kinds": kinds, "dtensors": dtensors, "keys": keys}, out)
        end_worker()
    finally:
        dist.destroy_process_group()


def test_sharded_step_equals_unsharded_blocks(tmp_path):
    out = str(tmp_path / "fsdp.pt")
    mp.spawn(_worker, args=(2, free_port(), out), nprocs=2, join=True)
    got = torch.load(out)
    assert got["kinds"] == ["block", "full", "block", "full"]
    assert "exp_avg_q4" in got["dtensors"] and "exp_avg_sq_absmax" in got["dtensors"] and "exp_avg" in got["dtensors"]
    assert "shape" not in got["keys"]
    model = _model()
    opt = co.AdamW4bit(model.parameters(), lr=1e-2)
    _run(model, opt)
    assert [co.adamw4bit._state4.state_kind(s) for s in opt.state.values()] == ["block", "full", "block", "full"]
    for a, b in zip(got["params"], model.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


def _dcp(model, opt, ckpt: str, save: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    if save:
        dcp.save(sd, checkpoint_id=ckpt)
        return
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])


def _dcp_worker(rank: int, world: int, port: int, ckpt: str, out: str, dtype: torch.dtype, master: str) -> None:
    _init(rank, world, port)
    try:
        batches = _batches() * 2
        model, opt = _sharded(world, dtype, master)
        _run(model, opt, batches[:3], dtype)
        _dcp(model, opt, ckpt, save=True)
        _run(model, opt, batches[3:], dtype)
        straight = [p.full_tensor().detach() for p in model.parameters()]
        model, opt = _sharded(world, dtype, master)
        _dcp(model, opt, ckpt, save=False)
        _run(model, opt, batches[3:], dtype)
        resumed = [p.full_tensor().detach() for p in model.parameters()]
        if rank == 0:
            torch.save({"straight": straight, "resumed": resumed}, out)
        end_worker()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype,master", [(torch.float32, "fp32"), (torch.bfloat16, "fp32"),
                                          (torch.bfloat16, "bf16_sr")])
def test_distributed_checkpoint_resumes_bit_for_bit(tmp_path, dtype, master):
    out = str(tmp_path / "dcp.pt")
    mp.spawn(_dcp_worker, args=(2, free_port(), str(tmp_path / "ckpt"), out, dtype, master), nprocs=2, join=True)
    got = torch.load(out)
    for a, b in zip(got["straight"], got["resumed"]):
        assert torch.equal(a, b)


def test_states_saved_at_another_shard_layout_are_refused():
    """A sharded state (its blocks are the shard's) does not load into an unsharded parameter, nor an
    unsharded one into a shard: a ValueError naming the layouts, before anything is replaced."""
    from coat.optim import _state4

    local = torch.zeros(64, 128)
    st = _state4.new_state(local, "block", "none", 0)
    sharded = dict(st, shard_layout=torch.tensor([2, 64 * 128]))
    with pytest.raises(ValueError, match="2 shard.*unsharded parameter.*same number of GPUs"):
        _state4.load_param_state(sharded, local, "block", "none", 0, "state[0]")
    with pytest.raises(ValueError, match="2 shard.*into 4 shard"):
        _state4.load_param_state(sharded, local, "block", "none", 0, "state[0]", layout=(4, 32 * 128))
    loaded = _state4.load_param_state(sharded, local, "block", "none", 0, "state[0]", layout=(2, 64 * 128))
    assert "shard_layout" not in loaded and torch.equal(loaded["exp_avg_q4"], st["exp_avg_q4"])
