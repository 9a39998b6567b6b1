"""The name estimate and bench give a model read from a config.json: the model id where the path
holds one (Hugging Face's cache), else the folder's name."""

from __future__ import annotations

import json

from coat import memory as M

_BASE = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128}


def test_a_hub_cache_snapshot_is_named_by_its_model_id(tmp_path, capsys):
    """A config.json in Hugging Face's cache (models--<org>--<name>/snapshots/<revision>/) names the
    model by its id in estimate's output, not by the revision's hash; another folder by its name."""
    from coat.cli.main import main

    snap = tmp_path / "models--meta-llama--Llama-2-7b-hf" / "snapshots" / "8cca527612d856d7d32bd94f8103728d614eb852"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(_BASE))
    assert M.load_shape(str(snap)).name == M.load_shape(str(snap / "config.json")).name == "meta-llama/Llama-2-7b-hf"
    assert main(["estimate", "--model", str(snap), "--recipe", "amp"]) == 0
    assert capsys.readouterr().out.startswith("meta-llama/Llama-2-7b-hf: ")
    plain = tmp_path / "my-run"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(_BASE))
    assert M.load_shape(str(plain)).name == "my-run"
