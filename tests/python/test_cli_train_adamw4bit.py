"""coat train --recipe coat4bit / --optim coat4bit (coat.optim.AdamW4bit): a run resumed from its
checkpoint continues bit for bit, with fp32 masters and with bf16 weights under gradient release; its
setup names go to coat estimate as they are; the flags it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_train_checkpoint import train_and_resume

from coat import memory
from coat.cli.config import ConfigError, TrainConfig, resolve_config, setup_name, validate
from coat.cli.model import build_model, build_optimizer, describe_precision


@pytest.mark.parametrize("setup", ["coat4bit", "coat4bit-lean+release"])
def test_n_steps_resume_n_steps_equals_2n_steps(tmp_path: Path, setup: str) -> None:
    straight, _ = train_and_resume(tmp_path, recipe=setup, compare=False)
    assert straight["setup"] == setup


def test_builds_adamw4bit_and_describes_its_states() -> None:
    import coat.optim as co

    cfg = resolve_config(TrainConfig(model="tiny", activations="bf16", optim="coat4bit", compare=False,
                                     master_weights="bf16_sr", lr=1e-3, device="cpu"))
    assert setup_name(cfg) == "bf16-activations+coat4bit-adamw"  # bf16 layers: outside the vocabulary
    model = build_model(cfg).bfloat16()
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, co.AdamW4bit) and opt.master_weights == "bf16_sr"
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert any("4 bits" in line for line in describe_precision(model, opt, cfg)["not_fp8"])


def test_release_needs_a_coat_optimizer() -> None:
    cfg = resolve_config(TrainConfig(model="tiny", activations="bf16", optim="torch", compare=False,
                                     release_grads=True, device="cpu"))
    with pytest.raises(ConfigError, match="coat, coat4bit or snsm"):
        validate(cfg)


def test_setup_names_are_estimated_with_4bit_state_bytes() -> None:
    for flags, name in [({"optim": "coat4bit"}, "coat4bit"),
                        ({"recipe": "coat4bit", "master_weights": "bf16_sr", "release_grads": True},
                         "coat4bit-lean+release")]:
        cfg = resolve_config(TrainConfig(device="cpu", **flags))
        validate(cfg)
        assert setup_name(cfg) == name
        again = resolve_config(TrainConfig(device="cpu", recipe=name))
        assert (again.optim, again.master_weights, again.release_grads) == (cfg.optim, cfg.master_weights,
                                                                           cfg.release_grads)
    shape = memory.load_shape("llama2-7b")
    full, lean = memory.recipe("coat4bit"), memory.recipe("coat4bit-lean+release")
    assert full.state_bytes == lean.state_bytes < 1.1 and (full.master_bytes, lean.master_bytes) == (4, 0)
    # 4-bit states next to FP8 ones: the estimate drops by the difference of their bytes
    fp8 = memory.plan(shape, memory.recipe("coat-lean+release"), batch=1, seq=2048)
    four = memory.plan(shape, lean, batch=1, seq=2048)
    saved = (memory.COAT_STATE_BYTES - lean.state_bytes) * shape.n_params
    assert abs((fp8.peak - four.peak) - saved) < 0.01 * saved
