"""`coat train --init PATH`: fine-tuning a Hugging Face checkpoint folder (Llama, Mistral, Qwen2,
Qwen3) with its own tokenizer on JSONL data, and `--save` through save_pretrained. The
checkpoints are tiny ones the tests create (no download)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coat.cli.config import TrainConfig
from coat.cli.main import main
from coat.cli.train import train

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
TEXTS = [f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300)]


def make_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(folder)


def make_checkpoint(folder: Path, model_type: str, tokenizer: bool = True) -> Path:
    """A randomly initialized 2-layer model of ``model_type``, saved as a Hugging Face folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
    if model_type in ("qwen3", "gemma3_text"):
        kw["head_dim"] = 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw))
    model.save_pretrained(folder)
    if tokenizer:
        make_tokenizer(folder)
    return folder


def write_jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    return path


def finetune_config(tmp: Path, ckpt: Path, name: str, **overrides) -> TrainConfig:
    base = dict(init=str(ckpt), data=str(tmp / "ft.jsonl"), steps=8, batch_size=4, seq_len=48, lr=3e-3,
                warmup_steps=1, eval_every=4, eval_batches=2, log_every=1, out=str(tmp / name),
                cache_dir=str(tmp / "cache"), device="cpu", quiet=True, recipe="coat", save_every=8)
    return TrainConfig(**(base | overrides))


_LOGITS = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out = {}
for folder in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = AutoTokenizer.from_pretrained(folder)("def function_3(x):", return_tensors="pt").input_ids
    with torch.no_grad():
        out[folder] = (ids, model(ids).logits)
torch.save(out, sys.argv[1])
"""


def test_finetune_each_model_type_and_reload_in_a_fresh_process(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    write_jsonl(tmp_path / "ft.jsonl")
    saved: dict[str, tuple[Path, Path]] = {}
    for model_type in MODEL_TYPES:
        ckpt = make_checkpoint(tmp_path / f"ckpt-{model_type}", model_type)
        result = train(finetune_config(tmp_path, ckpt, f"ft-{model_type}"))
        assert result["finished"] and result["final_val_loss"] < result["initial_val_loss"] - 0.5, model_type
        config = json.loads(Path(result["config"]).read_text())
        assert config["init"]["model_type"] == model_type and config["corpus"]["tokenizer"] == "hf"
        assert config["corpus"]["split"] == "documents"  # JSONL records are documents
        saved[model_type] = (Path(result["model_dir"]), Path(result["out_dir"]) / "checkpoints" / "step_00000008")

    # A fresh process with plain transformers loads every saved folder (weights, config, tokenizer).
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "logits.pt"
    proc = subprocess.run([sys.executable, "-c", _LOGITS, str(out), *(str(m) for m, _ in saved.values())],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    fresh = torch.load(out, weights_only=True)
    for model_type, (model_dir, last_ckpt) in saved.items():
        cfg = json.loads((model_dir / "config.json").read_text())
        assert cfg["model_type"] == model_type and cfg["architectures"][0].endswith("ForCausalLM")
        # The trained weights, from the last training checkpoint, in a plain model of the init config:
        # the saved model must give the same logits (keys unchanged, nothing lost).
        plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / f"ckpt-{model_type}")).eval()
        plain.load_state_dict(torch.load(last_ckpt / "model_optim.pt", weights_only=True)["model"])
        ids, logits = fresh[str(model_dir)]
        assert torch.equal(ids, AutoTokenizer.from_pretrained(tmp_path / f"ckpt-{model_type}")(
            "def function_3(x):", return_tensors="pt").input_ids)
        with torch.no_grad():
            assert torch.equal(logits, plain(ids).logits), model_type
        before = AutoModelForCausalLM.from_pretrained(tmp_path / f"ckpt-{model_type}")
        assert not torch.equal(before.lm_head.weight, plain.lm_head.weight)  # it did train


def test_init_without_tokenizer_uses_bytes_and_save_is_on(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "ft.jsonl")
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", tokenizer=False)
    result = train(finetune_config(tmp_path, ckpt, "ft", recipe="bf16", save_every=None, steps=4))
    assert result["model_dir"] is not None and not (Path(result["model_dir"]) / "tokenizer.json").exists()
    config = json.loads(Path(result["config"]).read_text())
    assert config["corpus"]["tokenizer"] == "byte" and config["train"]["save"] is True
    assert config["train"]["lr"] == 3e-3 and config["model"]["vocab_size"] == 320


def test_init_run_resumes_exactly(tmp_path: Path) -> None:
    import shutil

    write_jsonl(tmp_path / "ft.jsonl")
    ckpt = make_checkpoint(tmp_path / "ckpt", "mistral")
    straight = train(finetune_config(tmp_path, ckpt, "straight", recipe="bf16", steps=6, save_every=3, save=False))
    half = tmp_path / "half"
    shutil.copytree(tmp_path / "straight", half, ignore=shutil.ignore_patterns("step_00000006", ".lock"))
    (half / "summary.json").unlink()
    resumed = train(TrainConfig(resume=str(half), quiet=True))
    assert resumed["finished"] and resumed["final_val_loss"] == straight["final_val_loss"]


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--device", "cpu", *argv])
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_bad_init_folders(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "argument --init: " + str(empty) + " has no config.json" in _usage_error(
        ["--init", str(empty), "--out", str(out)], capsys)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50257}))
    assert "argument --init: model_type 'gpt2' in" in _usage_error(["--init", str(gpt2), "--out", str(out)], capsys)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 320,
                                                        "max_position_embeddings": 256}))
    assert "has no weights" in _usage_error(["--init", str(no_weights), "--out", str(out)], capsys)
    ckpt = make_checkpoint(tmp_path / "ckpt", "qwen2")
    assert "argument --tokenizer: --init" in _usage_error(["--init", str(ckpt), "--tokenizer", "byte"], capsys)
    assert "argument --seq-len: 512 exceeds the model's max positions (256)" in _usage_error(
        ["--init", str(ckpt), "--seq-len", "512", "--out", str(out)], capsys)
    import numpy as np

    np.save(tmp_path / "ids.npy", np.arange(1000) % 400)  # ids up to 399; the model has 320
    assert "argument --data: " in _usage_error(
        ["--init", str(ckpt), "--data", str(tmp_path / "ids.npy"), "--out", str(out)], capsys)
    assert not out.exists()


# ---- LoRA --------------------------------------------------------------------------------------


def test_lora_with_frozen_fp8_base_trains_saves_the_adapter_and_resumes(tmp_path: Path) -> None:
    import shutil

    import peft
    from transformers import AutoModelForCausalLM

    write_jsonl(tmp_path / "ft.jsonl")
    ckpt = make_checkpoint(tmp_path / "ckpt", "qwen2")
    lora = dict(lora=4, lora_alpha=16, lora_targets="q_proj,v_proj,down_proj", frozen_fp8=True, steps=6,
                save_every=3, lr=1e-2)
    straight = train(finetune_config(tmp_path, ckpt, "straight", **lora))
    assert straight["finished"] and straight["final_val_loss"] < straight["initial_val_loss"]
    adapter = tmp_path / "straight" / "adapter"
    assert (adapter / "adapter_config.json").exists() and not (tmp_path / "straight" / "model").exists()
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 16 and set(cfg["target_modules"]) == {"q_proj", "v_proj", "down_proj"}
    # The adapter loads on the original checkpoint with plain PEFT and moves its logits.
    base = AutoModelForCausalLM.from_pretrained(ckpt)
    ids = torch.tensor([[5, 9, 17, 33, 2]])
    with torch.no_grad():
        plain = base(ids).logits
        tuned = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ckpt), adapter)(ids).logits
    assert not torch.allclose(plain, tuned)
    # Resume (the checkpoint holds the FP8 base and the adapters): bit for bit.
    half = tmp_path / "half"
    shutil.copytree(tmp_path / "straight", half, ignore=shutil.ignore_patterns("step_00000006", ".lock", "adapter"))
    (half / "summary.json").unlink()
    resumed = train(TrainConfig(resume=str(half), quiet=True))
    assert resumed["finished"] and resumed["final_val_loss"] == straight["final_val_loss"]


def test_lora_on_frozen_fp8_base_matches_bf16_lora_quality(tmp_path: Path) -> None:
    """Issue 17's quality bar: a short LoRA fine-tune of a small checkpoint with the base frozen in
    FP8 ends within 1% of the validation loss of PEFT's LoRA on the BF16 base (same seed, data)."""
    write_jsonl(tmp_path / "ft.jsonl")
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama")
    lora = dict(lora=8, lora_alpha=16, steps=60, lr=3e-2, eval_every=30, save_every=60)
    bf16 = train(finetune_config(tmp_path, ckpt, "bf16", recipe="bf16", **lora))
    fp8 = train(finetune_config(tmp_path, ckpt, "fp8", frozen_fp8=True, **lora))
    # The adapters learned something (a random-init base: 5.79 -> 5.22 nats here).
    assert bf16["final_val_loss"] < 0.95 * bf16["initial_val_loss"]
    assert abs(fp8["final_val_loss"] / bf16["final_val_loss"] - 1) < 0.01, (fp8["final_val_loss"],
                                                                           bf16["final_val_loss"])


def test_bad_lora_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_jsonl(tmp_path / "ft.jsonl")
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama")
    common = ["--data", str(tmp_path / "ft.jsonl"), "--steps", "2"]
    assert "--lora: LoRA fine-tunes a pretrained model" in _usage_error(["--lora", "4", *common], capsys)
    assert "--lora-alpha: only applies with --lora" in _usage_error(["--init", str(ckpt), "--lora-alpha", "4",
                                                                     *common], capsys)
    assert "--frozen-fp8: needs the FP8 layers" in _usage_error(["--init", str(ckpt), "--lora", "4", "--recipe",
                                                                 "bf16", "--frozen-fp8", *common], capsys)
    assert "--lora: must be a rank >= 1" in _usage_error(["--init", str(ckpt), "--lora", "-1", *common], capsys)
    assert "--lora-dropout: must be in [0, 1)" in _usage_error(["--init", str(ckpt), "--lora", "4",
                                                                "--lora-dropout", "1.5", *common], capsys)
    err = _usage_error(["--init", str(ckpt), "--lora", "4", "--lora-targets", "no_such_proj", "--recipe", "coat",
                        "--out", str(tmp_path / "bad"), *common], capsys)
    assert "--lora-targets" in err and "no_such_proj" in err


def test_init_folders_never_run_their_own_code(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    """A tokenizer whose config names code in the folder (auto_map) is refused even where a prompt
    would be answered "y"; weights in a pickle that would run code are refused as --init's error."""
    import builtins

    marker = tmp_path / "marker"
    monkeypatch.setattr(builtins, "input", lambda *a, **k: "y")  # transformers' trust_remote_code prompt
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama")
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]})
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    (ckpt / "tokenization_evil.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nfrom transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    out = tmp_path / "out"
    err = _usage_error(["--init", str(ckpt), "--out", str(out), "--steps", "1"], capsys)
    assert "--init" in err and not marker.exists() and not out.exists()

    class _Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    bad = make_checkpoint(tmp_path / "bad", "llama", tokenizer=False)
    (bad / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": _Payload()}, bad / "pytorch_model.bin")
    err = _usage_error(["--init", str(bad), "--out", str(out), "--steps", "1", "--no-compare"], capsys)
    assert "argument --init: the model in" in err and "Traceback" not in err and not marker.exists(), err
