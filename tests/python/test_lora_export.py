"""LoRA adapters saved from converted models are plain PEFT adapters (issue 26 item 2):
``coat train --lora --save`` writes an adapter that ``peft.AutoPeftModelForCausalLM`` loads from
another folder in a process where coat cannot be imported, computing what the trained FP8 model
computes (within the FP8 tolerance); ``save_pretrained`` of a PEFT model around a converted model
names the transformers class; ``get_peft_model(coat.convert(m, frozen_weights="fp8"))`` is
refused at its first forward until converted again; the LoRA default learning rate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import coat
from coat.cli.config import INIT_LR, LORA_LR, TrainConfig, resolve_config
from coat.cli.main import main

peft = pytest.importorskip("peft")
import transformers as tf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cli_train_init import make_checkpoint, write_jsonl  # noqa: E402

IDS = [[5, 9, 17, 33, 2, 40, 41, 7]]

# Loads the adapter with plain PEFT while every import of coat fails.
_PLAIN_PEFT = """
import importlib.abc, sys
class _NoCoat(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "coat" or name.startswith("coat."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
sys.meta_path.insert(0, _NoCoat())
import torch, peft
model = peft.AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]).eval()
assert not [m for m in sys.modules if m == "coat" or m.startswith("coat.")]
with torch.no_grad():
    logits = model(torch.tensor(%r)).logits
torch.save({"logits": logits, "class": type(model.get_base_model()).__module__}, sys.argv[2])
""" % (IDS,)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_cli_adapter_loads_with_plain_peft_without_coat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_jsonl(tmp_path / "ft.jsonl")
    ckpt = make_checkpoint(tmp_path / "tiny-llama", "llama")
    monkeypatch.chdir(tmp_path)  # --init by a relative path, as in the README
    main(["train", "--device", "cpu", "--init", "tiny-llama", "--data", "ft.jsonl", "--recipe", "coat",
          "--lora", "8", "--frozen-fp8", "--steps", "2", "--save", "--save-every", "2", "--lr", "2e-2",
          "--warmup-steps", "0", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--out", "run",
          "--cache-dir", "cache", "--quiet"])
    adapter = tmp_path / "run" / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(ckpt.resolve())
    auto = cfg.get("auto_mapping")
    assert auto is None or auto["parent_library"].startswith("transformers."), auto

    # Plain PEFT, in a process where coat cannot be imported, run from another folder (offline).
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", _PLAIN_PEFT, str(adapter), str(tmp_path / "plain.pt")], cwd=elsewhere,
                   env=env, check=True, timeout=300)
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert plain["class"].startswith("transformers.")

    # The trained model as it was at the end of training (the checkpoint of step 2): the FP8 model.
    sd = torch.load(tmp_path / "run" / "checkpoints" / "step_00000002" / "model_optim.pt", weights_only=True)["model"]
    base = coat.convert(tf.AutoModelForCausalLM.from_pretrained(ckpt), recipe="fp8")
    trained = coat.convert(peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=8)), frozen_weights="fp8")
    trained.load_state_dict(sd)
    ids = torch.tensor(IDS)
    with torch.no_grad():
        fp8 = trained.eval()(input_ids=ids).logits
        untuned = tf.AutoModelForCausalLM.from_pretrained(ckpt).eval()(ids).logits
    moved = _rel(plain["logits"], untuned)
    err = _rel(fp8, plain["logits"])
    # Tolerance: coat's FP8 GEMMs (E4M3 activations and weights, per-tensor / per-group scales) against
    # PEFT's fp32 model give a relative L2 logits error of a few percent on this tiny model: 0.08
    # allowed. The adapter must move the logits by clearly more than that (it trained at lr 2e-2).
    assert err < 0.08, (err, moved)
    assert moved > 2 * err, (err, moved)


@pytest.mark.parametrize("order", ["convert_then_peft", "peft_then_convert"])
def test_api_save_pretrained_names_the_transformers_class(tmp_path: Path, order: str) -> None:
    ckpt = make_checkpoint(tmp_path / "base", "llama", tokenizer=False)
    model = tf.AutoModelForCausalLM.from_pretrained(ckpt)
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    m = peft.get_peft_model(coat.convert(model), cfg) if order == "convert_then_peft" \
        else coat.convert(peft.get_peft_model(model, cfg))
    assert type(m.get_base_model()).__module__.startswith("coat.")
    m.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["auto_mapping"] == {"base_model_class": "LlamaForCausalLM",
                                     "parent_library": "transformers.models.llama.modeling_llama"}
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")
    assert type(loaded.get_base_model()) is tf.LlamaForCausalLM


def _tiny(seed: int = 0) -> tf.LlamaForCausalLM:
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=64))


def test_convert_fp8_then_peft_is_refused_until_converted_again() -> None:
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    m = peft.get_peft_model(coat.convert(_tiny(), frozen_weights="fp8"), cfg)
    ids = torch.randint(0, 64, (1, 6))
    # The base stays fp32 here (nothing was frozen at convert): refused, naming the order that works.
    with pytest.raises(ValueError, match=r"frozen after coat.convert\(frozen_weights='fp8'\).*again after"):
        m(input_ids=ids, labels=ids)
    with torch.no_grad(), pytest.raises(ValueError, match="not FP8"):
        m(input_ids=ids)
    coat.convert(m, frozen_weights="fp8")
    q = m.get_base_model().model.layers[0].self_attn.q_proj
    assert q.base_layer.weight.dtype == torch.float8_e4m3fn
    m(input_ids=ids, labels=ids).loss.backward()
    assert q.lora_A["default"].weight.grad is not None
    # The other order ends with the same FP8 base.
    other = coat.convert(peft.get_peft_model(_tiny(), cfg), frozen_weights="fp8")
    assert other.get_base_model().model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    # dequantize_frozen: floating-point frozen weights from then on, as asked: no refusal.
    coat.nn.dequantize_frozen(m)
    with torch.no_grad():
        m(input_ids=ids)


def test_lora_default_lr(tmp_path: Path) -> None:
    def lr(**kw) -> float:
        return resolve_config(TrainConfig(init=str(tmp_path), device="cpu", **kw)).lr

    assert lr(lora=8) == LORA_LR == 2e-4
    assert lr() == INIT_LR
    assert lr(lora=8, lr=1e-3) == 1e-3
