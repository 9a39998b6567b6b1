"""coat train --optim snsm (coat.optim.SubsetNormSM): the optimizer it builds and how it describes it,
a run resumed from its checkpoint continues bit for bit, and the flags it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_train_checkpoint import records, train_and_resume

from coat.cli.config import ConfigError, TrainConfig, resolve_config, setup_name, validate
from coat.cli.model import build_model, build_optimizer, describe_precision


def test_builds_snsm_and_describes_its_states() -> None:
    import coat.optim as co
    import torch

    cfg = resolve_config(TrainConfig(model="tiny", activations="bf16", optim="snsm", compare=False, lr=1e-2,
                                     device="cpu"))
    assert setup_name(cfg) == "bf16-activations+snsm"
    model = build_model(cfg)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, co.SubsetNormSM)
    # the paper's beta2 and weight decay, not AdamW's (which a flag still sets)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.0, 0.0]
    assert all(g["betas"] == (0.9, 0.999) for g in opt.param_groups)
    given = resolve_config(TrainConfig(model="tiny", activations="bf16", optim="snsm", compare=False, lr=1e-2,
                                       device="cpu", weight_decay=0.1, beta2=0.95))
    assert [g["weight_decay"] for g in build_optimizer(model, given).param_groups] == [0.1, 0.1, 0.0]
    adamw = resolve_config(TrainConfig(model="tiny", optim="coat", compare=False, device="cpu"))
    assert (adamw.weight_decay, adamw.beta2) == (0.1, 0.95)
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    assert embedded and embedded <= {id(p) for p in opt.param_groups[1]["params"]}
    assert all(p.ndim == 2 and id(p) not in embedded for p in opt.param_groups[0]["params"])
    assert any("Subset-Norm" in line for line in describe_precision(model, opt, cfg)["not_fp8"])
    assert opt.param_groups[0]["proj_type"] == "svd"
    rand = build_optimizer(model, resolve_config(TrainConfig(model="tiny", activations="bf16", optim="snsm",
                                                             compare=False, device="cpu", snsm_proj="randomized")))
    assert all(g["proj_type"] == "randomized" for g in rand.param_groups)


def test_the_refresh_is_part_of_a_runs_identity() -> None:
    """A checkpoint of a randomized-refresh run is not resumed with the SVD refresh (nor the reverse);
    runs from before the flag existed are SVD runs."""
    from coat.cli.checkpoint import run_identity

    train = {"recipe": None, "optim": "snsm", "master_weights": "fp32"}
    old = run_identity({"run_id": "r", "train": train, "model": {}})
    assert run_identity({"run_id": "r", "train": {**train, "snsm_proj": "svd"}, "model": {}}) == old
    assert run_identity({"run_id": "r", "train": {**train, "snsm_proj": "randomized"}, "model": {}}) != old


def test_n_steps_resume_n_steps_equals_2n_steps(tmp_path: Path) -> None:
    train_and_resume(tmp_path, recipe=None, activations="bf16", optim="snsm", lr=1e-2, compare=False)
    losses = [r["loss"] for r in records(tmp_path / "straight") if "loss" in r]
    assert losses[-1] < losses[0]


def test_lean_release_run_resumes_bit_for_bit(tmp_path: Path) -> None:
    """--recipe snsm-lean+release: bf16 matrices with stochastic rounding, stepped inside backward
    (clipping by the running norm estimate), FP8 layers; a resumed run continues bit for bit."""
    import torch

    run = dict(recipe="snsm-lean+release", lr=1e-2, compare=False)
    cfg = resolve_config(TrainConfig(model="tiny", device="cpu", **run))
    assert (cfg.optim, cfg.master_weights, cfg.release_grads, cfg.activations) == ("snsm", "bf16_sr", True, "fp8")
    assert setup_name(cfg) == "snsm-lean+release"
    train_and_resume(tmp_path, **run)
    saved = torch.load(tmp_path / "straight" / "checkpoints" / "step_00000012" / "model_optim.pt", weights_only=True)
    assert saved["model"]["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    states = [st for st in saved["optim"]["state"].values() if "subset_norm" in st]
    assert states and not any("master" in st for st in states)  # bf16_sr: no fp32 master copies


@pytest.mark.parametrize("flags,flag", [({"cuda_graph": True}, "--cuda-graph"),
                                        ({"optim": "coat", "snsm_proj": "randomized"}, "--snsm-proj"),
                                        ({"snsm_proj": "qr"}, "--snsm-proj")])
def test_refused_flags(flags: dict, flag: str) -> None:
    cfg = resolve_config(TrainConfig(model="tiny", **{"activations": "bf16", "optim": "snsm", "compare": False,
                                                      "device": "cpu", **flags}))
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert flag in str(e.value)


def test_a_comparison_trains_each_arm_at_its_optimizers_defaults(tmp_path: Path) -> None:
    """--recipe snsm with --compare: the BF16 arm keeps AdamW's weight decay and beta2, the SN-SM
    arm takes its paper's; a flag given sets both arms."""
    from coat.cli.compare import _arm_flags, arms

    for given, want in (({}, {"bf16": (0.1, 0.95), "snsm": (0.0, 0.999)}),
                        ({"weight_decay": 0.05}, {"bf16": (0.05, 0.95), "snsm": (0.05, 0.999)})):
        flags = TrainConfig(model="tiny", recipe="snsm", compare=True, device="cpu", lr=1e-2, **given)
        cfg = resolve_config(flags)
        got = {}
        for arm in arms(cfg):
            sub = resolve_config(_arm_flags(flags, cfg, arm, tmp_path / arm))
            got[sub.optim if sub.optim == "snsm" else "bf16"] = (sub.weight_decay, sub.beta2)
        assert got == want
