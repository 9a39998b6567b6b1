"""coat estimate takes and refuses a model under a recipe whose layers coat.convert rewrites exactly
as coat.convert does (``Family.check``: the gated activation, the configuration switches it refuses),
on the config transformers makes of the file; and refusals that suggest a way out name one that works."""

from __future__ import annotations

import json

import pytest
import torch

import coat
from coat.cli.main import main

_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128}
_GEMMA = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
          "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 128, "vocab_size": 128}

# (config, whether coat.convert takes it)
CASES = {
    "llama-silu": (_LLAMA | {"hidden_act": "silu"}, True),
    "llama-swish": (_LLAMA | {"hidden_act": "swish"}, True),
    "llama-gelu-tanh": (_LLAMA | {"hidden_act": "gelu_pytorch_tanh"}, True),
    "llama-no-act": (_LLAMA, True),  # LlamaConfig's default: silu
    "llama-gelu": (_LLAMA | {"hidden_act": "gelu"}, False),
    "gemma3": (_GEMMA | {"hidden_activation": "gelu_pytorch_tanh"}, True),
    "gemma3-no-act": (_GEMMA, True),  # Gemma3TextConfig's default: gelu_pytorch_tanh
    "gemma3-gelu": (_GEMMA | {"hidden_activation": "gelu"}, False),
    "gemma3-final-softcap": (_GEMMA | {"final_logit_softcapping": 30.0}, False),
    "gemma3-attn-softcap": (_GEMMA | {"attn_logit_softcapping": 50.0}, False),
    "gemma2-style": (_GEMMA | {"hidden_activation": "gelu", "final_logit_softcapping": 30.0,
                               "attn_logit_softcapping": 50.0}, False),
}


def _estimate(capsys, path, recipe: str) -> tuple[int, str]:
    try:
        code = main(["estimate", "--model", str(path), "--recipe", recipe, "--json"])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, " ".join(out.err.split())


def _convert_takes(cfg: dict) -> bool:
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"], **kw))
    try:
        coat.convert(model)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_takes_what_convert_takes(tmp_path, capsys, case):
    cfg, takes = CASES[case]
    assert _convert_takes(cfg) is takes  # the rule itself, as coat.convert applies it
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for recipe in ("coat", "coat-lean+release", "snsm"):
        code, err = _estimate(capsys, tmp_path, recipe)
        if takes:
            assert code == 0, err
        else:
            assert code == 2 and f"recipe {recipe} converts the decoder layers with coat.convert" in err, err
            assert "estimate --recipe amp or bf16" in err
    # recipes that keep Hugging Face's layers take every one of them: the suggestion holds
    for recipe in ("amp", "bf16"):
        assert _estimate(capsys, tmp_path, recipe)[0] == 0


def test_the_refusal_names_what_convert_refuses(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(CASES["gemma3-final-softcap"][0]))
    assert "final_logit_softcapping=30.0" in _estimate(capsys, tmp_path, "coat")[1]
    (tmp_path / "config.json").write_text(json.dumps(CASES["gemma3-gelu"][0]))
    assert "hidden_activation='gelu'" in _estimate(capsys, tmp_path, "coat")[1]


def test_a_model_of_no_supported_family_is_refused_for_its_type_not_its_activation(tmp_path, capsys):
    """A GPT-NeoX config (gelu MLP, no family of coat.models): the refusal names the model types the
    plan takes, under every recipe, and does not send the user to amp, which refuses it as well."""
    cfg = {"model_type": "gpt_neox", "hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
           "intermediate_size": 2048, "vocab_size": 1000, "hidden_act": "gelu"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for recipe in ("coat", "amp", "bf16"):
        code, err = _estimate(capsys, tmp_path, recipe)
        assert code == 2 and "model_type 'gpt_neox' is not one of llama, mistral" in err, err
        assert "--recipe amp" not in err and "hidden_act" not in err, err
