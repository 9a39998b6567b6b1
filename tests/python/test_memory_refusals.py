"""Refusals of the memory plan's setups name the setup the user gave, every mode of it, and suggest
setups that the plan does model."""

from __future__ import annotations

import pytest

from coat import memory as M


@pytest.mark.parametrize("given, why", [
    ("coat+lora+release", "LoRA is modeled for bf16+lora and coat+lora"),
    ("coat+lora+hf-loss", "LoRA is modeled for bf16+lora and coat+lora"),
    ("bf16+lora+fused-loss", "LoRA is modeled for bf16+lora and coat+lora"),
    ("coat4bit+lora+graph", "LoRA is modeled for bf16+lora and coat+lora"),
    ("coat-lean+side+release", "side tuning is modeled for"),
    ("coat+side+hf-loss", "side tuning is modeled for"),
])
def test_a_refused_setup_is_named_as_given(given, why):
    with pytest.raises(ValueError) as e:
        M.recipe(given)
    assert str(e.value).startswith(f"--recipe {given}: {why}"), str(e.value)


@pytest.mark.parametrize("suggested", ["bf16+lora", "coat+lora", "bf16+lora+graph", "coat+lora+graph"])
def test_the_suggested_lora_setups_are_modeled(suggested):
    assert M.recipe(suggested).name == suggested
    M.plan(M.PRESETS["tiny"], suggested, 1, 128)


def test_the_estimate_command_names_the_setup_given(capsys):
    from coat.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["estimate", "--model", "tiny", "--recipe", "coat+lora+release"])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and "argument --recipe coat+lora+release: LoRA is modeled" in err, err
