"""coat train --optim coat4bit (coat.optim.AdamW4bit): a run resumed from its checkpoint continues
bit for bit, with fp32 masters and with bf16 weights under gradient release; the flags it refuses."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_cli_train_checkpoint import assert_same_state, records, tiny

from coat.cli import checkpoint as ckpt
from coat.cli.config import ConfigError, TrainConfig, resolve_config, validate
from coat.cli.model import build_model, build_optimizer, describe_precision
from coat.cli.train import train


@pytest.mark.parametrize("extra", [{}, {"master_weights": "bf16_sr", "release_grads": True}],
                         ids=["fp32-master", "bf16_sr-release"])
def test_n_steps_resume_n_steps_equals_2n_steps(tmp_path: Path, extra: dict) -> None:
    run = dict(recipe=None, activations="fp8", optim="coat4bit", compare=False, **extra)
    straight = train(tiny(tmp_path, "straight", **run))
    assert straight["finished"] and [s for s, _ in ckpt.checkpoints(tmp_path / "straight")] == [6, 12]
    half = tmp_path / "half"
    shutil.copytree(tmp_path / "straight", half, ignore=shutil.ignore_patterns("step_00000012", ".lock"))
    (half / "summary.json").unlink()
    resumed = train(TrainConfig(resume=str(half), quiet=True, cache_dir=str(tmp_path / "cache")))
    assert resumed["finished"] and resumed["steps"] == 12
    assert records(half) == records(tmp_path / "straight")
    assert_same_state(half / "checkpoints" / "step_00000012", tmp_path / "straight" / "checkpoints" / "step_00000012")


def test_builds_adamw4bit_and_describes_its_states() -> None:
    import coat.optim as co

    cfg = resolve_config(TrainConfig(model="tiny", activations="bf16", optim="coat4bit", compare=False,
                                     master_weights="bf16_sr", lr=1e-3, device="cpu"))
    model = build_model(cfg).bfloat16()
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, co.AdamW4bit) and opt.master_weights == "bf16_sr"
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert any("4 bits" in line for line in describe_precision(model, opt, cfg)["not_fp8"])


def test_release_needs_a_coat_optimizer() -> None:
    cfg = resolve_config(TrainConfig(model="tiny", activations="bf16", optim="torch", compare=False,
                                     release_grads=True, device="cpu"))
    with pytest.raises(ConfigError, match="coat or coat4bit"):
        validate(cfg)
