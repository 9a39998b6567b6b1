"""--fp8-granularity across the commands: `coat train` runs the FP8 layers at the granularity and
keeps it as part of the run (a resume cannot change it), refuses it without FP8 layers; `coat
estimate` and the memory plan count block scaling's saved scales. The other recipe flags of `coat
train` (--fp8-grad-format, --fp8-fast-accum, --dre: issue 25's ablations) the same way. CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli_train_checkpoint import tiny
from test_cli_train_resume_safety import usage_error

from coat import memory
from coat.cli.main import main
from coat.cli.train import train


def test_a_block_scaled_run_keeps_its_granularity(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    train(tiny(tmp_path, "run", steps=4, save_every=2, recipe="coat", fp8_granularity="block"))
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["train"]["fp8_granularity"] == "block"
    err = usage_error(capsys, "--resume", str(run), "--steps", "6", "--fp8-granularity", "tensor")
    assert "argument --fp8-granularity: cannot change when resuming (the run in" in err and "used 'block'" in err
    assert main(["train", "--resume", str(run), "--steps", "6", "--quiet"]) == 0


def test_granularity_needs_the_fp8_layers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    err = usage_error(capsys, "--recipe", "bf16", "--fp8-granularity", "row", "--steps", "1", "--out",
                      str(tmp_path / "x"))
    assert "argument --fp8-granularity: only applies to the FP8 layers (this run's activations are bf16)" in err


def test_the_plan_counts_block_scales() -> None:
    shape = memory.load_shape("llama2-7b")
    rec = memory.recipe("coat")
    tensor, block = memory.plan(shape, rec, 1, 2048), memory.plan(shape, rec.with_granularity("block"), 1, 2048)
    # o_proj's transposed input gains one fp32 scale per 128 tokens per channel, in every layer
    gained = block.extra["saved_per_token_layer"] - tensor.extra["saved_per_token_layer"]
    assert gained == shape.q_width / 32
    with pytest.raises(ValueError, match="--recipe bf16 has no FP8 layers"):
        memory.recipe("bf16").with_granularity("block")
    with pytest.raises(ValueError, match="--fp8-granularity must be one of tensor, row, block"):
        rec.with_granularity("channel")


def test_the_setup_vocabulary_names_the_granularity() -> None:
    """coat+block / coat-lean+block+release: one name across coat train, estimate and bench."""
    from coat import recipes
    from coat.cli import bench_worker
    from coat.cli.config import TrainConfig, expand_setup, resolve_config, setup_name

    cfg, given = expand_setup(TrainConfig(recipe="coat-lean+block+release"))
    assert cfg.fp8_granularity == "block" and cfg.release_grads and "fp8_granularity" in given
    assert setup_name(resolve_config(cfg)) == "coat-lean+block+release"
    assert memory.recipe("coat-lean+block+release").fp8_granularity == "block"
    assert memory.recipe("coat").with_granularity("row").name == "coat+row"
    assert {"coat+row", "coat+block", "coat-lean+block+release"} <= set(bench_worker.SETUPS)
    for bad, match in (("bf16+block", r"\+block scales the FP8 layers"), ("coat+row+block", "exclude each other"),
                       ("coat+block+lora", "does not combine with a base frozen in FP8")):
        with pytest.raises(ValueError, match=match):
            recipes.parse(bad)


def test_the_recipe_flags_reach_the_layers_and_the_optimizer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from coat.cli.config import TrainConfig, fp8_recipe, resolve_config
    from coat.cli.model import build_model, build_optimizer

    assert (fp8_recipe(TrainConfig()).grad_format, fp8_recipe(TrainConfig()).fast_accum_fwd) == ("e5m2", True)
    assert fp8_recipe(TrainConfig(fp8_granularity="block")).grad_format == "e4m3"  # the recipe's default there
    rec = fp8_recipe(TrainConfig(fp8_grad_format="e4m3", fp8_fast_accum=False))
    assert (rec.grad_format, rec.fast_accum_fwd) == ("e4m3", False)
    cfg = resolve_config(TrainConfig(recipe="coat", model="tiny", device="cpu", dre=False))
    assert all(g["expansion"] is False for g in build_optimizer(build_model(cfg), cfg).param_groups)

    run = tmp_path / "run"
    train(tiny(tmp_path, "run", steps=4, save_every=2, recipe="coat", fp8_grad_format="e4m3", fp8_fast_accum=False,
               dre=False))
    saved = json.loads((run / "config.json").read_text())
    got = saved["train"]
    assert (got["fp8_grad_format"], got["fp8_fast_accum"], got["dre"]) == ("e4m3", False, False)
    fp8 = " ".join(saved["precision"]["fp8"])  # what the run says it does
    assert "E4M3 gradients" in fp8 and "fast accumulation" not in fp8 and "(no Dynamic Range Expansion)" in fp8
    err = usage_error(capsys, "--resume", str(run), "--steps", "6", "--dre")
    assert "argument --dre: cannot change when resuming (the run in" in err
    assert main(["train", "--resume", str(run), "--steps", "6", "--quiet"]) == 0


def test_v_scaling_reaches_adamw4bit_and_stays_on_resume(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from coat.cli.config import TrainConfig, resolve_config
    from coat.cli.model import build_model, build_optimizer

    cfg = resolve_config(TrainConfig(recipe="coat4bit", model="tiny", device="cpu", v_scaling="block"))
    assert build_optimizer(build_model(cfg), cfg).v_scaling == "block"
    run = tmp_path / "run"
    train(tiny(tmp_path, "run", steps=4, save_every=2, recipe="coat4bit", v_scaling="block"))
    saved = json.loads((run / "config.json").read_text())
    assert saved["train"]["v_scaling"] == "block"
    assert "v: linear map without zero, 128-element scales" in " ".join(saved["precision"]["not_fp8"])
    err = usage_error(capsys, "--resume", str(run), "--steps", "6", "--v-scaling", "rank1")
    assert "argument --v-scaling: cannot change when resuming (the run in" in err
    assert main(["train", "--resume", str(run), "--steps", "6", "--quiet"]) == 0


def test_bad_recipe_flag_values_from_python_are_config_errors() -> None:
    from coat.cli.config import ConfigError, TrainConfig, resolve_config, validate

    for bad, message in (({"fp8_grad_format": "e3m4"}, "argument --fp8-grad-format: invalid choice 'e3m4'"),
                         ({"dre": 0}, "argument --dre: must be True or False"),
                         ({"fp8_fast_accum": 1}, "argument --fp8-fast-accum: must be True or False"),
                         ({"v_scaling": "row"}, "argument --v-scaling: invalid choice 'row'")):
        with pytest.raises(ConfigError, match=message):
            validate(resolve_config(TrainConfig(recipe="coat", model="tiny", device="cpu", **bad)))


@pytest.mark.parametrize("flags, message", [
    (["--recipe", "bf16", "--fp8-grad-format", "e4m3"], "argument --fp8-grad-format: only applies to the FP8 layers"),
    (["--recipe", "bf16", "--no-fp8-fast-accum"], "argument --no-fp8-fast-accum: only applies to the FP8 layers"),
    (["--recipe", "coat+block", "--no-fp8-fast-accum"], "block-scaled GEMMs always accumulate in split fp32"),
    (["--recipe", "fp8", "--no-dre"], "argument --no-dre: Dynamic Range Expansion is coat.optim.AdamW's"),
    (["--recipe", "coat4bit", "--no-dre"], "not --optim coat4bit's"),
    (["--recipe", "coat", "--v-scaling", "block"], "argument --v-scaling: v's scaling is coat.optim.AdamW4bit's"),
])
def test_the_recipe_flags_are_refused_where_they_do_nothing(tmp_path: Path, capsys: pytest.CaptureFixture, flags,
                                                           message) -> None:
    assert message in usage_error(capsys, *flags, "--steps", "1", "--out", str(tmp_path / "x"))


def test_lora_keeps_the_recipe_flags() -> None:
    pytest.importorskip("peft")
    import coat
    from coat.cli.config import TrainConfig, fp8_recipe, resolve_config
    from coat.cli.model import add_lora, build_model

    cfg = resolve_config(TrainConfig(recipe="coat", model="tiny", device="cpu", lora=4, fp8_grad_format="e4m3",
                                     fp8_fast_accum=False))
    model = coat.convert(build_model(cfg), recipe=fp8_recipe(cfg))
    model = add_lora(model, cfg)  # converts again for the adapters: with the run's recipe, not the default
    recipes = {m.coat_recipe for m in model.modules() if hasattr(m, "coat_recipe")}
    assert recipes and all((r.grad_format, r.fast_accum_fwd) == ("e4m3", False) for r in recipes)
