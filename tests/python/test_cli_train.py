"""Tests of `coat train` (coat.cli): corpus, batching, a tiny CPU run, CLI errors, plotting.

Everything runs on CPU with a ~0.1M-parameter model, so the file takes well under a minute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from coat.cli import data
from coat.cli.main import main
from coat.cli.plot import plot_runs, read_metrics
from coat.cli.train import TrainConfig, build_model, build_optimizer, lr_lambda, resolve_config, train

REPO_ROOT = Path(__file__).resolve().parents[2]
# Real Python source that every interpreter ships; small enough for seconds-long runs.
STDLIB_JSON = Path(sysconfig.get_paths()["stdlib"]) / "json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny_config(tmp: Path, **overrides) -> TrainConfig:
    base = dict(model="tiny", steps=20, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=4, eval_every=5,
                eval_batches=4, log_every=1, data=str(STDLIB_JSON), out=str(tmp / "run"),
                cache_dir=str(tmp / "cache"), device="cpu", quiet=True)
    return TrainConfig(**(base | overrides))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    return train(tiny_config(tmp_path_factory.mktemp("tiny")))


def losses(metrics_path: str) -> list[float]:
    return [r["loss"] for r in read_metrics(metrics_path) if "loss" in r]


# --- corpus -------------------------------------------------------------------------------


@pytest.fixture
def text_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    for i in range(40):
        sub = folder / f"part{i // 10}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"doc{i:02d}.txt").write_text(f"document {i}\n" + "lorem ipsum " * (i + 1))
    (folder / ".hidden").mkdir()
    (folder / ".hidden" / "skip.txt").write_text("never read")
    return folder


def test_byte_corpus_holds_out_last_files(text_folder: Path, tmp_path: Path) -> None:
    corpus = data.load_corpus(text_folder, cache_dir=tmp_path / "cache", log=lambda _: None)
    files = data.text_files(text_folder)
    assert len(files) == 40 and files == sorted(files)
    assert corpus.info["split"] == "files" and corpus.info["val_files"] == 2  # 5% of 40
    expected_val = b"".join(f.read_bytes() + b"\0" for f in files[-2:])
    val = corpus.val.astype(np.int64)
    assert val[val == data.BYTE_EOS_ID].size == 2
    assert bytes(np.where(val == data.BYTE_EOS_ID, 0, val).astype(np.uint8)) == expected_val
    train_text = bytes(corpus.train[corpus.train < 256].astype(np.uint8))
    assert b"document 38" not in train_text and b"document 39" not in train_text
    assert b"document 0\n" in train_text and b"never read" not in train_text
    assert corpus.vocab_size == data.BYTE_VOCAB_SIZE == 257


def test_corpus_is_deterministic_and_cached(text_folder: Path, tmp_path: Path) -> None:
    messages: list[str] = []
    first = data.load_corpus(text_folder, cache_dir=tmp_path / "a", log=messages.append)
    again = data.load_corpus(text_folder, cache_dir=tmp_path / "a", log=messages.append)
    fresh = data.load_corpus(text_folder, cache_dir=tmp_path / "b", log=messages.append)
    assert messages[0].startswith("Tokenizing") and messages[1].startswith("Using cached")
    for other in (again, fresh):
        np.testing.assert_array_equal(first.train, other.train)
        np.testing.assert_array_equal(first.val, other.val)
    assert len(list((tmp_path / "a").glob("*.npy"))) == 2


def test_single_file_splits_by_tokens(tmp_path: Path) -> None:
    path = tmp_path / "one.txt"
    path.write_bytes(bytes(range(32, 127)) * 20)
    corpus = data.load_corpus(path, cache_dir=tmp_path / "cache", log=lambda _: None)
    assert corpus.info["split"] == "tokens"
    whole = np.concatenate([corpus.train, corpus.val])
    assert len(corpus.val) == int(len(whole) * 0.05)
    np.testing.assert_array_equal(whole[:-1], np.frombuffer(path.read_bytes(), np.uint8))


def test_stdlib_corpus_files() -> None:
    files = data.stdlib_files()
    assert len(files) > 100 and files == sorted(files)
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)


def test_bpe_tokenizer(text_folder: Path, tmp_path: Path) -> None:
    corpus = data.load_corpus(text_folder, tokenizer="bpe", vocab_size=512, cache_dir=tmp_path, log=lambda _: None)
    assert corpus.vocab_size == 512 and corpus.train.dtype == np.uint16
    assert 0 < corpus.train.max() < 512
    # Merges compress the repetitive text well below one token per byte.
    raw_bytes = sum(f.stat().st_size for f in data.text_files(text_folder)[:-2])
    assert len(corpus.train) < raw_bytes / 2
    from tokenizers import Tokenizer

    assert corpus.eos_id == Tokenizer.from_file(corpus.info["tokenizer_json"]).token_to_id(data.BPE_EOS_TOKEN)


@pytest.mark.parametrize("suffix", [".npy", ".bin"])
def test_token_array_files(tmp_path: Path, suffix: str) -> None:
    tokens = (np.arange(5000) * 7 % 300).astype(np.uint16)
    path = tmp_path / f"tokens{suffix}"
    np.save(path, tokens) if suffix == ".npy" else tokens.tofile(path)
    corpus = data.load_corpus(path)
    assert corpus.vocab_size == 300 and corpus.info["tokenizer"] == "pretokenized"
    np.testing.assert_array_equal(np.concatenate([corpus.train, corpus.val]), tokens)
    assert len(corpus.val) == 250


def test_training_on_npy_tokens(tmp_path: Path) -> None:
    # A strictly periodic stream is trivially learnable: the loss must drop far below ln(50).
    path = tmp_path / "tokens.npy"
    np.save(path, np.tile(np.arange(50, dtype=np.uint16), 400))
    result = train(tiny_config(tmp_path, data=str(path), steps=30))
    config = json.loads(Path(result["config"]).read_text())
    assert config["corpus"]["tokenizer"] == "pretokenized" and config["model"]["vocab_size"] == 50
    assert result["initial_val_loss"] > 3.5 and result["final_val_loss"] < 0.5 * result["initial_val_loss"]


# --- batching and schedule ----------------------------------------------------------------


def test_batches_are_shifted_windows() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    batch = data.sample_batch(tokens, 4, 16, np.random.default_rng(0))
    assert batch.shape == (4, 17) and batch.dtype == torch.int64
    assert torch.equal(batch[:, 1:] - batch[:, :-1], torch.ones(4, 16, dtype=torch.int64))
    assert torch.equal(batch, data.sample_batch(tokens, 4, 16, np.random.default_rng(0)))
    assert not torch.equal(batch, data.sample_batch(tokens, 4, 16, np.random.default_rng(1)))

    evals = data.eval_batches(tokens, 3, 4, 16)
    assert [b.shape for b in evals] == [(4, 17)] * 3
    assert evals[0][0, 0] == 0 and evals[-1][-1, -1] == 999  # spans the whole split
    assert all(torch.equal(a, b) for a, b in zip(evals, data.eval_batches(tokens, 3, 4, 16)))


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_lr_schedule(schedule: str) -> None:
    cfg = resolve_config(TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr=1e-4, schedule=schedule,
                                     device="cpu"))
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert f(100) == pytest.approx(1.0 if schedule == "constant" else 0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 100))


# --- training -----------------------------------------------------------------------------


def test_tiny_run_writes_outputs_and_learns(tiny_run: dict) -> None:
    records = read_metrics(tiny_run["metrics"])
    assert records[0] == {"step": 0, "tokens": 0, "lr": pytest.approx(3e-3 / 4), "val_loss": records[0]["val_loss"]}
    assert [r["step"] for r in records] == list(range(21))
    assert [r["step"] for r in records if "val_loss" in r] == [0, 5, 10, 15, 20]
    assert all(r["tokens_per_s"] > 0 and r["lr"] > 0 for r in records[1:])
    # Starts near uniform over 257 byte ids (ln 257 = 5.55) and must learn a lot in 20 steps.
    assert 4.5 < tiny_run["initial_val_loss"] < 6.0
    assert tiny_run["final_val_loss"] < tiny_run["initial_val_loss"] - 1.0
    assert tiny_run["final_val_loss"] == records[-1]["val_loss"]

    config = json.loads(Path(tiny_run["config"]).read_text())
    assert config["train"]["steps"] == 20 and config["train"]["device"] == "cpu"
    assert config["model"]["hidden_size"] == 64 and config["n_params"] == tiny_run["n_params"]
    assert config["environment"]["torch"] == torch.__version__
    assert Path(tiny_run["plot"]).read_bytes()[:8] == PNG_MAGIC
    assert json.loads(Path(tiny_run["summary"]).read_text())["final_val_loss"] == tiny_run["final_val_loss"]


def test_same_seed_same_losses(tiny_run: dict, tmp_path: Path) -> None:
    again = train(tiny_config(tmp_path))
    other = train(tiny_config(tmp_path, seed=1, out=str(tmp_path / "seed1")))
    assert losses(again["metrics"]) == losses(tiny_run["metrics"])
    assert again["final_val_loss"] == tiny_run["final_val_loss"]
    assert losses(other["metrics"]) != losses(tiny_run["metrics"])


def test_plot_runs_compares_runs(tiny_run: dict, tmp_path: Path) -> None:
    out = plot_runs({"torch": tiny_run["metrics"], "coat": tiny_run["metrics"]}, tmp_path / "cmp" / "both.png")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_model_shape_and_overrides() -> None:
    cfg = TrainConfig(model="tiny", hidden_size=96, heads=4, layers=3, device="cpu")
    model = build_model(cfg, vocab_size=300)
    assert model.config.hidden_size == 96 and model.config.num_hidden_layers == 3
    assert model.config.intermediate_size == 176 and model.config.vocab_size == 300


def test_coat_optimizer_gets_master_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    created: dict = {}

    class FakeAdamW(torch.optim.AdamW):
        def __init__(self, params, master_weights: str, **kwargs) -> None:
            created.update(kwargs, master_weights=master_weights)
            super().__init__(params, **kwargs)

    monkeypatch.setitem(sys.modules, "coat.optim", types.SimpleNamespace(AdamW=FakeAdamW))
    cfg = resolve_config(TrainConfig(model="tiny", optim="coat", master_weights="bf16_sr", lr=1e-3, device="cpu"))
    opt = build_optimizer(build_model(cfg), cfg)
    assert isinstance(opt, FakeAdamW)
    assert created == {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, "master_weights": "bf16_sr"}
    # Matrices decay; norm gains do not.
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


# --- command line -------------------------------------------------------------------------


def test_help_runs_as_module() -> None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "coat.cli.main", "train", "--help"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage: coat train" in proc.stdout
    for text in ("--optim {torch,coat}", "--recipe {bf16,fp8,coat}", "--activations {bf16,fp8}", "(default: cosine)",
                 "on CPU", "--eval-every"):
        assert text in proc.stdout


def test_top_level_help_lists_train(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0 and "train" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data", "/no/such/path"], "argument --data: path does not exist"),
        (["--steps", "0"], "argument --steps: must be a positive integer"),
        (["--model", "tiny", "--seq-len", "4096"], "argument --seq-len: 4096 exceeds the model's max positions"),
        (["--hidden-size", "100", "--heads", "3"], "argument --heads:"),
        (["--lr", "1e-3", "--min-lr", "1e-2"], "argument --min-lr:"),
        (["--master-weights", "bf16_sr"], "argument --master-weights: only applies to --optim coat"),
        (["--recipe", "fp16"], "argument --recipe: invalid choice"),
        (["--steps", "ten"], "argument --steps: invalid int value"),
    ],
)
def test_bad_flags_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture,
                                    tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--device", "cpu", "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "usage: coat train" in err and message in err
    assert not any(tmp_path.iterdir())  # rejected before anything was written


def test_missing_coat_optimizer_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "coat.optim", None)  # makes the import fail
    with pytest.raises(SystemExit) as exc:
        main(["train", "--device", "cpu", "--optim", "coat"])
    assert exc.value.code == 2 and "argument --optim: 'coat' needs coat.optim.AdamW" in capsys.readouterr().err
