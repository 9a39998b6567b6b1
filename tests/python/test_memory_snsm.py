"""The memory plan of the snsm setups (coat.optim.SubsetNormSM): its state bytes against the
optimizer's own, and a whole CPU step's peak against the plan."""

from __future__ import annotations

import pytest
import torch

from coat import memory as M
from coat import memory_recipes as R
from coat.optim import _snsm


@pytest.mark.parametrize("shape,rank", [((4096, 11008), 128), ((11008, 4096), 128), ((32000, 4096), 128),
                                        ((64, 3), 128), ((5, 7), 2), ((128, 128), 128)])
def test_matrix_bytes_are_the_optimizers_layout(shape, rank):
    assert R.snsm_matrix_bytes(*shape, rank) == _snsm.state_bytes(shape, rank)
    assert R.SNSM_CHUNK == _snsm.CHUNK


def test_state_bytes_match_the_optimizer_on_a_model():
    import coat.optim as co
    from coat.cli.bench_worker import build_model

    shape = M.PRESETS["tiny"]
    torch.manual_seed(0)
    model = build_model(shape, torch.bfloat16, torch.device("cpu"))
    opt = co.SubsetNormSM(co.snsm_param_groups(model), lr=1e-3, master_weights="bf16_sr", rank=R.SNSM_RANK)
    ids = torch.randint(0, shape.vocab, (1, 16))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    got = opt.state_bytes() - 4 * sum(1 for p in opt.state if opt.state[p])  # the host step counts aside
    want = R.snsm_state_bytes(shape, R.SNSM_RANK)
    assert abs(got / want - 1) <= 0.03, (got, want)


def test_cpu_step_peak_with_release_matches_plan():
    from coat.cli.bench_worker import SETUPS, Context, build_model, measure

    shape, batch, seq = M.PRESETS["tiny"], 2, 128
    torch.manual_seed(0)
    s = SETUPS["snsm-lean+release"]
    model = build_model(shape, s.param_dtype, torch.device("cpu"))
    step = s.prepare(model, Context(torch.device("cpu"), None))
    got = measure(step, torch.randint(0, shape.vocab, (batch, seq)), warmup=1, steps=1, dev=torch.device("cpu"),
                  model=model)
    p = M.plan(shape, s.recipe, batch, seq, device="cpu")
    assert abs(got["peak_gib"] / p.peak_gib - 1) <= 0.10, (got["peak_gib"] * 1024, p.peak_gib * 1024, p.parts)
    assert abs(got["resident_gib"] * M.GiB - p.extra["resident"]) <= 0.02 * p.extra["resident"], \
        (got["resident_gib"] * M.GiB, p.extra["resident"])


def test_snsm_is_one_gpu_only():
    with pytest.raises(ValueError, match="FSDP2"):
        M.plan(M.PRESETS["tiny"], "snsm-lean+release", 1, 128, gpus=2)
