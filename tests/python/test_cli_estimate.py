"""coat estimate: the plan of coat/memory.py as a command (text and --json), presets, config.json
files and checkpoint folders, FSDP2 per-GPU figures, the fit, the roofline, bad flags, speed."""

from __future__ import annotations

import json
import time

import pytest
import torch

from coat import memory as M
from coat.cli import estimate as E
from coat.cli.main import main


def _run(capsys, *argv: str) -> str:
    assert main(["estimate", *argv]) == 0
    return capsys.readouterr().out


def test_json_has_peak_max_batch_and_parts(capsys):
    r = json.loads(_run(capsys, "--model", "llama2-7b", "--recipe", "amp", "--batch", "2", "--gpu", "h200", "--json"))
    p = M.plan(M.PRESETS["llama2-7b"], "amp", 2, 2048)
    assert r["peak_gib"] == round(p.peak_gib, 3)
    assert r["max_batch"] == M.max_batch(M.PRESETS["llama2-7b"], "amp", 2048, 139.8) == 2
    assert r["gpu_memory_gib"] == 139.8 and r["phase"] == "backward start"
    assert sum(r["parts_gib"].values()) == pytest.approx(r["peak_gib"], abs=0.01)
    assert r["parts_gib"]["autocast bf16 weight copies"] > 12  # 2 B per linear weight
    assert set(r["saved_per_layer_gib"]) == {op for op, _ in M.layer_saved(M.PRESETS["llama2-7b"], "hf-amp")}
    t = r["time"]
    assert 0 < t["gemm_ms"] < t["step_ms"] and t["tokens_per_s"] == pytest.approx(2 * 2048 / t["step_ms"] * 1e3)


def test_text_names_every_part_and_the_fit(capsys):
    out = _run(capsys, "--model", "llama2-13b", "--recipe", "coat-lean", "--batch", "2", "--gpu", "h100")
    for words in ("13.02 B parameters", "weights", "optimizer states", "saved activations per layer, by op",
                  "attention (SDPA)", "largest batch that fits in 79.2 GiB (--gpu h100):",
                  "time per step >="):
        assert words in out, (words, out)
    out = _run(capsys, "--model", "llama2-7b", "--recipe", "amp", "--gpu-memory", "80")
    assert "largest batch that fits in 80.0 GiB (--gpu-memory): none" in out


def test_config_file_folder_and_fsdp(tmp_path, capsys):
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    by_file = json.loads(_run(capsys, "--model", str(tmp_path / "config.json"), "--recipe", "coat", "--json"))
    by_dir = json.loads(_run(capsys, "--model", str(tmp_path), "--recipe", "coat", "--json"))
    preset = json.loads(_run(capsys, "--model", "llama3-8b", "--recipe", "coat", "--json"))
    assert by_file["peak_gib"] == by_dir["peak_gib"] == preset["peak_gib"]
    assert by_file["n_params"] == M.PRESETS["llama3-8b"].n_params
    two = json.loads(_run(capsys, "--model", "llama3-8b", "--recipe", "coat", "--gpus", "2", "--fsdp-unit", "1",
                          "--json"))
    assert two["gpus"] == 2 and two["peak_gib"] < preset["peak_gib"]
    assert two["parts_gib"]["weights"] == pytest.approx(preset["parts_gib"]["weights"] / 2, abs=0.01)
    assert "FSDP2" in _run(capsys, "--model", "llama3-8b", "--gpus", "2")
    assert "note" not in json.loads(_run(capsys, "--model", "llama3-8b", "--recipe", "coat-lean+release", "--gpus",
                                         "2", "--json"))
    # K layers per fully_shard unit: 2K layers gathered and K layers' gradients at the backward start
    s = M.PRESETS["llama3-8b"]
    four = json.loads(_run(capsys, "--model", "llama3-8b", "--recipe", "coat", "--gpus", "2", "--fsdp-unit", "4",
                           "--json"))
    assert four["fsdp_unit"] == 4 and "4 layers per unit" in _run(capsys, "--model", "llama3-8b", "--gpus", "2",
                                                                  "--fsdp-unit", "4")
    assert two["phase"] == "backward end" and four["phase"] == "backward start"
    assert four["peak"] - two["other_phase"] == pytest.approx(3 * (2 + 2 + 2) * s.layer_params, rel=1e-6)
    # the default, auto: coat.memory's rule for this GPU's memory, said in the text
    auto = json.loads(_run(capsys, "--model", "llama3-8b", "--recipe", "coat", "--gpus", "2", "--gpu", "h200",
                           "--json"))
    assert auto["fsdp_unit_auto"] and auto["fsdp_unit"] == M.auto_fsdp_unit(s, "coat", 1, 2048, 2, auto["gpu_memory_gib"])
    assert auto["peak_gib"] == json.loads(_run(capsys, "--model", "llama3-8b", "--recipe", "coat", "--gpus", "2",
                                               "--fsdp-unit", str(auto["fsdp_unit"]), "--json"))["peak_gib"]
    assert f"{auto['fsdp_unit']} layers per unit, chosen by --fsdp-unit auto" in _run(
        capsys, "--model", "llama3-8b", "--recipe", "coat", "--gpus", "2", "--gpu", "h200")


@pytest.mark.parametrize("argv,flag", [
    (["--model", "gpt-5"], "--model"),
    (["--model", "llama2-7b", "--recipe", "fp4"], "--recipe"),
    (["--model", "llama2-7b", "--batch", "0"], "--batch"),
    (["--model", "llama2-7b", "--gpus", "-1"], "--gpus"),
    (["--model", "llama2-7b", "--gpu-memory", "0"], "--gpu-memory"),
    (["--model", "llama2-7b", "--gpu", "tpu"], "--gpu"),
    (["--model", "llama2-7b", "--gpus", "2", "--fsdp-unit", "some"], "--fsdp-unit: must be auto or a positive integer"),
    (["--model", "llama2-7b", "--gpus", "2", "--fsdp-unit", "0"], "--fsdp-unit: must be auto or a positive integer"),
    (["--model", "llama2-7b", "--gpu-memory", "nan"], "--gpu-memory: must be a positive number of GiB, got nan"),
    (["--model", "llama2-7b", "--gpu-memory", "inf"], "--gpu-memory: must be a positive number of GiB, got inf"),
    (["--model", "llama2-7b", "--recipe", "amp+release"], "gradient release steps coat.optim.AdamW inside backward"),
    (["--model", "llama2-7b", "--batch", str(2**80)], "--batch: must be a positive integer up to"),
    (["--model", "llama2-7b", "--fsdp-unit", "2"], "--fsdp-unit applies to FSDP2 plans: give --gpus 2"),
    (["--model", "llama2-7b", "--gpus", "2", "--fsdp-unit", "33"], "--fsdp-unit: 33 is more than llama2-7b's 32 decoder layers"),
])
def test_bad_flags_are_named(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        main(["estimate", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


_LLAMA = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 4, "intermediate_size": 688, "vocab_size": 1000}


@pytest.mark.parametrize("cfg, recipe, why", [
    ({"model_type": "llava", "text_config": None}, "coat", "text_config is null, not the language model's config"),
    (_LLAMA | {"vocab_size": 10**400}, "coat", "vocab_size must be an integer in [1, 2147483647], got 1000"),
    (_LLAMA | {"num_hidden_layers": 10**12}, "amp", "num_hidden_layers must be an integer in [1, 2147483647]"),
    (_LLAMA | {"num_hidden_layers": True}, "coat", "num_hidden_layers must be an integer in [1, 2147483647], got true"),
    (_LLAMA | {"num_key_value_heads": 0}, "coat", "num_key_value_heads must be an integer in [1, 2147483647], got 0"),
    (_LLAMA | {"hidden_act": "gelu"}, "coat-lean", "recipe coat-lean converts the decoder layers with coat.convert"),
])
def test_bad_model_configs_are_named(tmp_path, capsys, cfg, recipe, why):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--model", str(tmp_path), "--recipe", recipe])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and f"argument --model '{tmp_path}' ({tmp_path}/config.json" in err and why in err, err


def test_a_gelu_model_is_estimated_for_recipes_that_keep_its_layers(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(_LLAMA | {"hidden_act": "gelu"}))
    assert json.loads(_run(capsys, "--model", str(tmp_path), "--recipe", "amp", "--json"))["peak_gib"] > 0


def test_every_preset_and_recipe_well_under_a_second():
    t0 = time.perf_counter()
    for shape in M.PRESETS.values():
        for rec in M.RECIPES:
            M.plan(shape, rec, 4, 4096, 1)
            M.max_batch(shape, rec, 4096, 79.2)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default is the GPU's memory when one is present")
def test_default_memory_without_gpu(capsys):
    r = json.loads(_run(capsys, "--model", "mistral-7b", "--recipe", "coat-lean", "--json"))
    assert r["gpu_memory_gib"] == E.DEFAULT_MEMORY_GIB and "time" not in r


@pytest.mark.gpu
def test_measured_rates_on_this_gpu(capsys):
    r = json.loads(_run(capsys, "--model", "llama2-7b", "--measure-rates", "--json"))
    assert r["time"]["rates_source"].startswith("measured now") and r["time"]["step_ms"] > 0
    assert r["gpu_memory_gib"] == pytest.approx(torch.cuda.get_device_properties(0).total_memory / M.GiB)


def test_small_models_count_in_millions_and_no_missing_files_are_cited(capsys):
    out = _run(capsys, "--model", "tiny", "--gpu", "h100")
    assert out.startswith(f"tiny: {M.PRESETS['tiny'].n_params / 1e6:.2f} M parameters"), out.splitlines()[0]
    assert "0.00 B" not in out
    # Every file the output cites is in the repository (DESIGN.md was cited, and is not).
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for cited in set(re.findall(r"[\w/.-]+\.md", out)):
        assert (root / cited).is_file(), cited


@pytest.mark.skipif(torch.cuda.is_available(), reason="names the GPU present")
def test_json_claims_no_device_without_a_gpu(capsys):
    r = json.loads(_run(capsys, "--model", "tiny", "--json"))
    assert "device" not in r and r["gpu"] is None and r["gpu_memory_source"] == "default (no GPU here)"
    assert json.loads(_run(capsys, "--model", "tiny", "--gpu", "h200", "--json"))["gpu"] == "h200"


def test_a_largest_batch_at_the_search_limit_says_so(capsys):
    out = _run(capsys, "--model", "tiny", "--seq", "1", "--gpu-memory", "1000")
    assert "65536 x 1 tokens (the search's limit: larger ones fit too)" in out


def test_fp8_all_gather_plans_the_gathered_layers_in_fp8(capsys):
    s = M.PRESETS["llama2-70b"]
    args = ["--model", "llama2-70b", "--recipe", "coat4bit-lean+release", "--gpus", "2", "--gpu", "h200", "--json"]
    bf16 = json.loads(_run(capsys, *args, "--fsdp-unit", "1"))
    fp8 = json.loads(_run(capsys, *args, "--fsdp-unit", "1", "--fp8-all-gather"))
    # two gathered layers (the running one and the prefetched one), their linear weights at 1 byte, not 2
    assert (bf16["peak"] - fp8["peak"]) == pytest.approx(2 * s.layer_linear_params, rel=1e-9)
    assert fp8["fp8_all_gather"] and not bf16["fp8_all_gather"]
    # auto: two layers per unit fit an H200 with FP8 gathers, one without (issue 30's 70B run)
    assert json.loads(_run(capsys, *args))["fsdp_unit"] == 1
    assert json.loads(_run(capsys, *args, "--fp8-all-gather"))["fsdp_unit"] == 2
    assert "FP8 all-gather" in _run(capsys, *args[:-1], "--fp8-all-gather")
    for bad in (["--model", "llama2-7b", "--fp8-all-gather"],
                ["--model", "llama2-7b", "--gpus", "2", "--recipe", "amp", "--fp8-all-gather"]):
        with pytest.raises(SystemExit):
            _run(capsys, *bad)
        assert "--fp8-all-gather applies to FSDP2 plans of FP8 layers" in capsys.readouterr().err
