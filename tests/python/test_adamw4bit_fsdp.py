"""coat.optim.AdamW4bit on FSDP2 shards (two CPU gloo ranks): sharded parameters step with blocks of
128 for v (each shard's own, as rank-1 column maxima would span ranks), which for shards of whole
blocks is the unsharded parameter's block layout: the sharded run equals a single-process run whose
matrices take blocks too; their state_dict() is refused with a clear error."""

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


def _run(model, opt):
    for x, y in _batches():
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def _worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _model()
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = co.AdamW4bit(model.parameters(), lr=1e-2)
        _run(model, opt)  # every rank the same batches: the averaged gradients are the unsharded ones
        kinds = [co.adamw4bit._state4.state_kind(opt.state[p]) for p in model.parameters()]
        try:
            opt.state_dict()
            refused = ""
        except NotImplementedError as e:
            refused = str(e)
        full = [p.full_tensor().detach() for p in model.parameters()]
        if rank == 0:
            torch.save({"params": full, "kinds": kinds, "refused": refused}, out)
        end_worker()
    finally:
        dist.destroy_process_group()


def test_sharded_step_equals_unsharded_blocks_and_state_dict_is_refused(tmp_path):
    out = str(tmp_path / "fsdp.pt")
    mp.spawn(_worker, args=(2, free_port(), out), nprocs=2, join=True)
    got = torch.load(out)
    assert got["kinds"] == ["block", "full", "block", "full"]
    assert "sharded" in got["refused"] and "coat.optim.AdamW" in got["refused"]
    model = _model()
    opt = co.AdamW4bit(model.parameters(), lr=1e-2)
    _run(model, opt)
    assert [co.adamw4bit._state4.state_kind(s) for s in opt.state.values()] == ["block", "full", "block", "full"]
    for a, b in zip(got["params"], model.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
