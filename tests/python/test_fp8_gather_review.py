"""FP8 all-gather under FSDP2, cases found by review: writes through any view of a gathered weight
are refused (not lost in a dequantized copy), lists of gathered weights dequantize; on CPU gloo ranks,
load_state_dict(assign=True) after install keeps gathering FP8 bit for bit as bf16 gathers do,
FP8-frozen groups are left to FSDP2's own gather, and what cannot work is refused at install
(CPU offloading, resharding to a smaller mesh, units that are not one FSDP2 unit)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _dist import end_worker, free_port

import coat
from coat._ops import quantize as qops
from coat._ops._util import fmt_id
from coat.integrations import fp8_gather
from coat.nn.gathered import Fp8Gathered

E4M3 = torch.float8_e4m3fn
V, T = 64, 7


def _gathered() -> Fp8Gathered:
    w = torch.randn(6, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    q, s = qops.quantize_stacked_from_amax([w], qops.amax_stacked([w]), fmt_id(E4M3))
    return torch.nn.Parameter(Fp8Gathered(q, s, w.dtype, E4M3), requires_grad=True)


@pytest.mark.parametrize("write", [lambda g: g.data[0].zero_(), lambda g: g.detach().t().mul_(2),
                                   lambda g: g.data[1:3].fill_(0), lambda g: g.detach().unbind(0)[2].add_(1)])
def test_writes_through_views_of_a_gathered_weight_are_refused(write):
    g = _gathered()
    before = g.dequantize().clone()
    with pytest.raises(RuntimeError, match="gathered as FP8 codes"):
        write(g)
    assert torch.equal(before, g.dequantize())


def test_views_and_lists_of_gathered_weights_read_as_their_dequantization():
    g = _gathered()
    d = g.dequantize()
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    assert torch.equal(x @ g.t(), x @ d.t()) and torch.equal(g[2] * 1, d[2]) and torch.equal(g.t()[3:7] * 1, d.t()[3:7])
    assert all(isinstance(p, Fp8Gathered) and torch.equal(p.dequantize(), q) for p, q in zip(g.detach().split(2), d.split(2)))
    assert torch.equal(torch.cat([g, d]), torch.cat([d, d])) and torch.equal(torch.stack([g, g]), torch.stack([d, d]))


def _model(layers=2, frozen=False):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=layers,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64)
    m = tf.LlamaForCausalLM(cfg)
    if frozen:  # the attention projections frozen in FP8, the MLP trained
        for n, p in m.named_parameters():
            if "self_attn" in n:
                p.requires_grad_(False)
    return coat.convert(m, frozen_weights="fp8" if frozen else "keep")


def _train(model, g, steps):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, V, (2, T), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _run(case: str, rank: int, world: int, fp8: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from coat.integrations import fsdp

    mesh = init_device_mesh("cpu", (world,))
    model = fsdp.shard(_model(frozen=case == "frozen"), mesh, "cpu", fp8_all_gather=fp8)
    g = torch.Generator().manual_seed(1 + rank)
    losses = _train(model, g, 2)
    if case == "assign":  # FSDP2 swaps in new local shards: the hooks must follow them
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(sd, assign=True)
        losses += _train(model, g, 2)
    params = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    units = fp8_gather.installed_units(model)
    return {"losses": torch.stack(losses), "params": params, "units": len(units),
            "weights": sum(len(grp) for u in units for grp in u.groups)}


def _refusals(world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh, found = init_device_mesh("cpu", (world,)), []
    for case in ("offload", "two_units"):
        model = _model()
        kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if case == "offload" else {}
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        try:
            fp8_gather.install([list(model.model.layers)] if case == "two_units" else [[layer] for layer in model.model.layers])
            found.append(f"{case}: not refused")
        except ValueError as e:
            found.append(f"{case}: {e}")
    return found


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = {case: {fp8: _run(case, rank, world, fp8) for fp8 in (False, True)} for case in ("assign", "frozen")}
        res["refusals"] = _refusals(world)
        if rank == 0:
            torch.save(res, out)
        end_worker()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fsdp2_fp8_gather_after_assign_load_and_with_frozen_groups(tmp_path):
    out = str(tmp_path / "res.pt")
    mp.spawn(_worker, args=(2, free_port(), out), nprocs=2, join=True)
    res = torch.load(out)
    for case, weights in (("assign", 2 * 7), ("frozen", 2 * 3)):  # frozen: q/k/v and o left to FSDP2
        plain, fp8 = res[case][False], res[case][True]
        assert plain["units"] == 0 and fp8["units"] == 2 and fp8["weights"] == weights, (case, fp8["weights"])
        assert torch.equal(plain["losses"], fp8["losses"]), case
        for n, p in plain["params"].items():
            assert torch.equal(p, fp8["params"][n]), (case, n)
    offload, two = res["refusals"]
    assert "CPUOffloadPolicy" in offload, offload
    assert "one FSDP2 unit" in two, two


def _reshard_worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, mesh = _model(), init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=2)
        fully_shard(model, mesh=mesh)
        try:
            fp8_gather.install([[layer] for layer in model.model.layers])
            msg = "not refused"
        except ValueError as e:
            msg = str(e)
        if rank == 0:
            torch.save(msg, out)
        end_worker()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fp8_gather_refuses_resharding_to_a_smaller_mesh(tmp_path):
    # FSDP2 would narrow the uint8 codes into a Parameter that requires grad after forward and fail.
    out = str(tmp_path / "msg.pt")
    mp.spawn(_reshard_worker, args=(4, free_port(), out), nprocs=4, join=True)
    assert "reshard_after_forward given as a group size" in torch.load(out)
