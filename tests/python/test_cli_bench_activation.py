"""coat bench rebuilds each model from its shape in a worker process (``asdict(shape)`` ->
``ModelShape`` -> ``hf_config`` -> transformers): the MLP's activation travels with it, so a model
whose activation is not SiLU is benchmarked with its own, not with the config class's default."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from coat import memory as M
from coat.cli import bench_worker

_BASE = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 128}


@pytest.mark.parametrize("model_type,key,act,fn", [
    ("llama", "hidden_act", "gelu_pytorch_tanh", "GELUTanh"),
    ("llama", "hidden_act", "gelu", "GELUActivation"),
    ("qwen3", "hidden_act", "swish", "SiLU"),
    ("gemma3_text", "hidden_activation", "silu", "SiLU"),  # Gemma 3's default is gelu_pytorch_tanh
])
def test_the_activation_reaches_the_benchmarked_model(tmp_path, model_type, key, act, fn):
    (tmp_path / "config.json").write_text(json.dumps(_BASE | {"model_type": model_type, key: act}))
    shape = M.load_shape(str(tmp_path))
    assert shape.hidden_act == act
    crossed = M.ModelShape(**json.loads(json.dumps(asdict(shape))))  # as bench hands it to its worker
    assert crossed == shape and crossed.hf_config()[key] == act
    model = bench_worker.build_model(crossed, torch.float32, torch.device("cpu"))
    assert getattr(model.config, key) == act
    assert type(model.model.layers[0].mlp.act_fn).__name__.startswith(fn), model.model.layers[0].mlp.act_fn


def test_a_config_without_the_key_keeps_its_class_default(tmp_path):
    for model_type, key, default in (("llama", "hidden_act", "silu"), ("gemma3_text", "hidden_activation",
                                                                       "gelu_pytorch_tanh")):
        (tmp_path / "config.json").write_text(json.dumps(_BASE | {"model_type": model_type}))
        shape = M.load_shape(str(tmp_path))
        assert shape.hidden_act == "" and key not in shape.hf_config()
        model = bench_worker.build_model(shape, torch.float32, torch.device("cpu"))
        assert getattr(model.config, key) == default


def test_older_records_without_the_field_still_load():
    d = asdict(M.PRESETS["tiny"])
    del d["hidden_act"]
    assert M.ModelShape(**d) == M.PRESETS["tiny"]


def test_a_gelu_model_runs_through_the_bench_worker_with_its_activation(tmp_path):
    shape = M.ModelShape(name="gelu", hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128, vocab=128,
                         hidden_act="gelu_pytorch_tanh")
    res = bench_worker.run_config({"setup": "coat", "shape": asdict(shape), "batch": 1, "seq": 16, "warmup": 1,
                                   "steps": 1, "device": "cpu"})
    assert res["status"] == "ok", res
    assert res["shape"]["hidden_act"] == "gelu_pytorch_tanh"
