"""One vocabulary of setup names (coat/recipes.py) for coat train, coat estimate and coat bench
(issue 26 item 4): what coat train ran is recorded under a name the other two take as is, older
names still work, and a name a command cannot use is refused naming --recipe."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
from test_cli_train_checkpoint import STDLIB_JSON

from coat import memory, recipes
from coat.cli import bench
from coat.cli.bench_worker import SETUPS
from coat.cli.config import ConfigError, TrainConfig, resolve_config, setup_name, validate
from coat.cli.main import build_parser, main


#: coat bench's setups that coat.memory has no plan of (coat bench shows no estimate beside them).
UNMODELED = {"torchao", "qlora"}


def test_names_parse_to_one_form_and_older_names_are_aliases():
    assert recipes.parse("coat-lean+graph+release").name == "coat-lean+release+graph"  # one order
    for old, new in recipes.ALIASES.items():
        assert recipes.canonical(old) == new
        if new not in UNMODELED:  # the plan of the old name is the new name's
            assert memory.recipe(old).name == new
    for bad, why in (("coat+bar", "unknown mode 'bar'"), ("foo", "unknown recipe 'foo'"),
                     ("coat+release+release", "given twice"), ("torchao+release", "takes no modes"),
                     ("coat+fused-loss+hf-loss", "exclude each other")):
        with pytest.raises(ValueError, match=re.escape(f"--recipe {bad!r}: ") + f".*{why}"):
            recipes.parse(bad)


def test_every_bench_setup_is_named_in_the_vocabulary_and_estimated_where_modeled():
    for name, setup in SETUPS.items():
        assert recipes.canonical(name) == name, name
        assert setup.recipe == (None if name in UNMODELED else name), name
    # Older names on the command line run the same setups, written in the new form.
    args = build_parser().parse_args(["bench", "--setups", "coat-release", "lora-coat", "coat+release",
                                      "--setup-batches", "coat-lean-hfloss=2", "--setups", "coat-lean-hfloss",
                                      "--device", "cpu"])
    opts = bench.resolve(args)
    assert opts["setups"] == ["coat-lean+hf-loss"] and opts["per_setup"] == {"coat-lean+hf-loss": [2]}
    args = build_parser().parse_args(["bench", "--setups", "coat-release", "lora-coat", "coat+release",
                                      "--device", "cpu"])
    assert bench.resolve(args)["setups"] == ["coat+release", "coat+lora"]
    rec = dict(device="cpu", model="tiny", setup="coat-release", batch=1, seq=128, world=1, status="ok")
    assert bench.record_key(rec) == bench.record_key(dict(rec, setup="coat+release"))


def _train_config(**kw) -> TrainConfig:
    return resolve_config(TrainConfig(device="cpu", **kw))


@pytest.mark.parametrize("recipe,dtype,master,release", itertools.product(
    ["bf16", "fp8", "coat"], ["fp32", "bf16"], ["fp32", "bf16_sr"], [False, True]))
def test_every_train_setup_is_a_name_estimate_takes_or_refuses_by_name(recipe, dtype, master, release):
    if (recipe != "coat" and (master != "fp32" or release)):
        return  # refused by coat train itself
    cfg = _train_config(recipe=recipe, dtype=dtype, master_weights=master, release_grads=release)
    validate(cfg)
    name = setup_name(cfg)
    want = {"bf16": "amp" if dtype == "bf16" else "fp32", "fp8": "fp8",
            "coat": "coat-lean" if master == "bf16_sr" else "coat"}[recipe] + ("+release" if release else "")
    assert name == want
    if recipe == "coat" or (recipe, dtype) == ("bf16", "bf16"):
        assert memory.recipe(name).name == name
    else:  # fp32 compute, fp8 with torch.optim.AdamW: named, and refused as not modeled
        with pytest.raises(ValueError, match=re.escape(f"--recipe {name!r}: recipe {name} (") + ".* has no memory"):
            memory.recipe(name)
    # The name given back to coat train runs the same thing.
    again = _train_config(recipe=name)
    assert setup_name(again) == name and (again.recipe, again.master_weights, again.release_grads) == (
        cfg.recipe, cfg.master_weights, cfg.release_grads)


def test_train_refuses_names_it_cannot_run_naming_recipe():
    for name, why in (("torchao", "coat train does not run torchao"), ("coat+hf-loss", r"coat train has no \+hf-loss"),
                      ("coat+lora", r"\+lora needs the adapters' rank: add --lora RANK"),
                      ("coat+bar", "unknown mode 'bar'")):
        with pytest.raises(ConfigError, match=f"argument --recipe: .*{why}"):
            _train_config(recipe=name)
    with pytest.raises(ConfigError, match="argument --dtype: 'fp32' contradicts --recipe amp"):
        _train_config(recipe="amp", dtype="fp32")
    with pytest.raises(ConfigError, match="argument --activations: 'bf16' contradicts --recipe coat"):
        _train_config(recipe="coat-lean", activations="bf16")


def test_v_block_names_adamw4bit_v_in_blocks_in_every_command():
    """+v-block (coat.optim.AdamW4bit(v_scaling="block")): coat train's --v-scaling block is named by it,
    the plan counts its 1/32 B/param of v scales and its step without the statistics pass, and it
    combines only with the 4-bit recipes."""
    cfg = _train_config(recipe="coat4bit-lean", v_scaling="block", release_grads=True)
    assert setup_name(cfg) == "coat4bit-lean+v-block+release"
    again = _train_config(recipe="coat4bit-lean+release+v-block")
    assert (again.v_scaling, again.master_weights, again.release_grads) == ("block", "bf16_sr", True)
    for bad in ("coat+v-block", "snsm-lean+v-block"):
        with pytest.raises(ValueError, match=re.escape(f"--recipe {bad!r}: +v-block is coat.optim.AdamW4bit's")):
            recipes.parse(bad)
    rank1, block = memory.recipe("coat4bit-lean+release"), memory.recipe("coat4bit-lean+v-block+release")
    assert (block.name, block.v_scaling, block.grad_release) == ("coat4bit-lean+v-block+release", "block", True)
    assert block.state_bytes == 1 + 8 / 128 > rank1.state_bytes
    shape = memory.PRESETS["llama2-7b"]
    rates = memory.GPU_RATES["h100"]
    opt = [memory.step_time_floor(shape, r, 1, 2048, rates)["optimizer_ms"] for r in (rank1, block)]
    assert opt[1] < opt[0]  # no statistics pass: 2.5 B/param less to move
    assert "coat4bit-lean+v-block+release" in SETUPS


@pytest.mark.parametrize("argv,setup", [(["--recipe", "coat-lean+release"], "coat-lean+release"),
                                        (["--recipe", "bf16", "--dtype", "bf16"], "amp"),
                                        (["--recipe", "coat4bit-lean+release", "--v-scaling", "block"],
                                         "coat4bit-lean+v-block+release")])
def test_what_train_ran_is_handed_to_estimate_and_bench_as_is(tmp_path: Path, capsys, argv, setup):
    out = tmp_path / "run"
    assert main(["train", *argv, "--model", "tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                 "--eval-batches", "1", "--data", str(STDLIB_JSON), "--cache-dir", str(tmp_path / "cache"),
                 "--device", "cpu", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["setup"] == json.loads((out / "config.json").read_text())["setup"] == setup
    capsys.readouterr()
    assert main(["estimate", "--model", "llama2-7b", "--recipe", summary["setup"]]) == 0
    assert f"recipe {setup}: " in capsys.readouterr().out
    args = build_parser().parse_args(["bench", "--setups", summary["setup"], "--device", "cpu"])
    assert bench.resolve(args)["setups"] == [setup]


def test_lora_names_run_and_estimate_the_setup_they_name():
    # coat+lora is LoRA on the FP8 layers with the frozen base kept only in FP8 (coat bench's
    # setup, the one coat estimate plans): given to coat train, it sets --frozen-fp8.
    cfg = _train_config(recipe="coat+lora", lora=8, init="unused")
    assert (cfg.recipe, cfg.frozen_fp8, cfg.lora) == ("coat", True, 8) and setup_name(cfg) == "coat+lora"
    assert memory.recipe(setup_name(cfg)).name == "coat+lora"
    assert setup_name(_train_config(recipe="coat-lean+release", lora=4, init="unused")) == "coat-lean+lora+release"
