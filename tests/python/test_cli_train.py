"""Tests of `coat train` (coat.cli): corpus, batching, a tiny CPU run, flags and bad input, output
folders, plotting. Checkpoints, --init, --compare and torchrun have files of their own
(test_cli_train_*.py).

Everything runs on CPU with a ~0.1M-parameter model, so the file takes well under a minute.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from coat.cli import checkpoint as ckpt
from coat.cli import data
from coat.cli.config import DEVICE_DEFAULTS
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
                cache_dir=str(tmp / "cache"), device="cpu", quiet=True, recipe="bf16")
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
    assert corpus.info["split"] == "documents" and corpus.info["val_documents"] == 2  # 5% of 40
    expected_val = b"".join(f.read_bytes() + b"\0" for f in files[-2:])
    val = corpus.val.astype(np.int64)
    assert val[val == data.BYTE_EOS_ID].size == 2
    assert bytes(np.where(val == data.BYTE_EOS_ID, 0, val).astype(np.uint8)) == expected_val
    train_text = bytes(corpus.train[corpus.train < 256].astype(np.uint8))
    assert b"document 38" not in train_text and b"document 39" not in train_text
    assert b"document 0\n" in train_text and b"never read" not in train_text
    assert corpus.vocab_size == data.BYTE_VOCAB_SIZE == 257


def test_jsonl_records_are_documents(tmp_path: Path) -> None:
    path = tmp_path / "ft.jsonl"
    records = [{"text": f"record {i} " + "abc" * i, "meta": i} for i in range(40)] + [{"text": ""}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    corpus = data.load_corpus(path, cache_dir=tmp_path / "cache", log=lambda _: None)
    assert corpus.info["split"] == "documents" and corpus.info["val_documents"] == 2
    val = bytes(corpus.val.astype(np.int64).clip(max=0xFF).astype(np.uint8))
    assert val == b"".join(r["text"].encode() + b"\xff" for r in records[38:40])  # EOS clipped to 0xff
    assert corpus.train[corpus.train == data.BYTE_EOS_ID].size == 38  # the empty record is skipped


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\n{"txt": "no text field"}\n', ':2: each JSONL record needs a string "text" field'),
    ('{"text": "ok"}\nnot json\n', ":2: not valid JSON"),
    ('["text"]\n', ':1: each JSONL record needs a string "text" field'),
])
def test_bad_jsonl_names_the_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        data.load_corpus(path, cache_dir=tmp_path / "cache", log=lambda _: None)


def test_builtin_corpus_is_python_source() -> None:
    sources = data.builtin_sources()
    assert list(sources)[:2] == ["stdlib", "torch"] and "transformers" in sources
    for files in sources.values():
        assert files == sorted(files) and all(f.suffix == ".py" for f in files)
        assert not any("site-packages" in f.parts for f in sources["stdlib"])


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


def test_corpus_cache_follows_the_content_not_the_mtime(tmp_path: Path) -> None:
    doc = tmp_path / "data.txt"
    doc.write_text("abcdefgh" * 64)
    messages: list[str] = []
    first = data.load_corpus(doc, cache_dir=tmp_path / "cache", log=messages.append)
    st = doc.stat()
    doc.write_text("ABCDEFGH" * 64)  # same size, its mtime set back: only the content tells
    os.utime(doc, ns=(st.st_atime_ns, st.st_mtime_ns))
    edited = data.load_corpus(doc, cache_dir=tmp_path / "cache", log=messages.append)
    assert messages[1].startswith("Tokenizing") and edited.train[:8].tolist() == list(b"ABCDEFGH")
    assert not np.array_equal(first.train, edited.train)
    os.utime(doc)  # touched, content unchanged: the entry is reused
    data.load_corpus(doc, cache_dir=tmp_path / "cache", log=messages.append)
    assert messages[2].startswith("Using cached")


def test_single_file_splits_by_tokens(tmp_path: Path) -> None:
    path = tmp_path / "one.txt"
    path.write_bytes(bytes(range(32, 127)) * 20)
    corpus = data.load_corpus(path, cache_dir=tmp_path / "cache", log=lambda _: None)
    assert corpus.info["split"] == "tokens"
    whole = np.concatenate([corpus.train, corpus.val])
    assert len(corpus.val) == int(len(whole) * 0.05)
    np.testing.assert_array_equal(whole[:-1], np.frombuffer(path.read_bytes(), np.uint8))


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


@pytest.mark.parametrize("tokens, message", [
    (np.array([1, 2, -3, 4], np.int32), "holds a negative token id"),
    (np.array([1, 2, 1 << 20, 4], np.int64), "holds token id 1048576, above the largest allowed id"),
    (np.array([[1, 2]], np.int64), "expected a 1-D integer token array"),
    (np.array([], np.int64), "the token array is empty"),
])
def test_bad_token_arrays_are_rejected(tmp_path: Path, tokens: np.ndarray, message: str) -> None:
    path = tmp_path / "t.npy"
    np.save(path, tokens)
    with pytest.raises(ValueError, match=message):
        data.load_corpus(path)


def test_a_json_file_is_not_read_as_text(tmp_path: Path) -> None:
    # Records in a .json file would otherwise train on '[{"text": ...' as characters (found by review).
    path = tmp_path / "records.json"
    path.write_text(json.dumps([{"text": "first record"}, {"text": "second record"}]))
    with pytest.raises(ValueError, match=r"records\.json is a \.json file.*JSONL \(\.jsonl"):
        data.load_corpus(path, cache_dir=tmp_path / "cache")


def test_binary_file_is_not_text(tmp_path: Path) -> None:
    path = tmp_path / "prog"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="looks like a binary file"):
        data.load_corpus(path, cache_dir=tmp_path / "cache")
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("text")
    (folder / "b.txt").write_bytes(b"bin\0ary")
    assert data.text_files(folder) == [folder / "a.txt"]  # a binary file in a folder is skipped


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
        def __init__(self, params, master_weights: str, expansion: bool, **kwargs) -> None:
            created.update(kwargs, master_weights=master_weights, expansion=expansion)
            super().__init__(params, **kwargs)

    monkeypatch.setitem(sys.modules, "coat.optim", types.SimpleNamespace(AdamW=FakeAdamW))
    cfg = resolve_config(TrainConfig(model="tiny", optim="coat", master_weights="bf16_sr", lr=1e-3, device="cpu"))
    opt = build_optimizer(build_model(cfg), cfg)
    assert isinstance(opt, FakeAdamW)
    assert created == {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, "master_weights": "bf16_sr",
                       "expansion": True}
    # Matrices decay; norm gains do not.
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


# --- command line -------------------------------------------------------------------------


def _env() -> dict:
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.mark.parametrize("module", ["coat.cli.main", "coat"])
def test_help_runs_as_module(module: str) -> None:
    proc = subprocess.run([sys.executable, "-m", module, "train", "--help"], capture_output=True,
                          text=True, env=_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage: coat train" in proc.stdout or "usage: __main__.py train" in proc.stdout
    for text in ("--optim {torch,coat,coat4bit,snsm}", "--recipe NAME", "--activations {bf16,fp8}", "(default: cosine)",
                 "on CPU", "--eval-every", "--compare, --no-compare", "--init PATH", "--resume DIR",
                 "--save-every N", "--keep-last N"):
        assert text in proc.stdout


def test_top_level_help_lists_train(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0 and "train" in capsys.readouterr().out


def test_default_recipe_is_coat_compared_with_bf16() -> None:
    cfg = resolve_config(TrainConfig(device="cpu"))
    assert (cfg.recipe, cfg.activations, cfg.optim, cfg.compare) == ("coat", "fp8", "coat", True)
    assert resolve_config(TrainConfig(device="cpu", recipe="coat")).compare is False  # a named recipe runs alone
    assert resolve_config(TrainConfig(device="cpu", recipe="fp8", compare=True)).compare is True
    assert resolve_config(TrainConfig(device="cpu", compare=False)).compare is False
    # Parts given without a recipe: the rest from the default recipe; compared unless it is bf16 itself.
    assert resolve_config(TrainConfig(device="cpu", optim="torch")).recipe == "fp8"
    cfg = resolve_config(TrainConfig(device="cpu", activations="bf16", optim="torch"))
    assert (cfg.recipe, cfg.compare) == ("bf16", False)


@pytest.mark.parametrize("flags", [
    dict(), dict(recipe="bf16"), dict(recipe="fp8", compare=True), dict(optim="torch"),
    dict(activations="bf16", optim="coat", master_weights="bf16_sr"), dict(tokenizer="bpe", vocab_size=1024),
    dict(init="/some/ckpt", steps=40), dict(model="tiny", steps=7, save_every=3),
])
def test_resolving_is_idempotent(flags: dict) -> None:
    once = resolve_config(TrainConfig(device="cpu", **flags), 256 if "init" in flags else None)
    assert resolve_config(once, 256 if "init" in flags else None) == once


def test_defaults_stay_far_below_one_pass_over_the_corpus() -> None:
    corpus_bytes = sum(f.stat().st_size for fs in data.builtin_sources().values() for f in fs)
    for device, d in DEVICE_DEFAULTS.items():
        tokens = d["steps"] * d["batch_size"] * d["seq_len"]  # byte tokens: one per byte of source
        assert tokens < 0.1 * corpus_bytes, device  # no token seen twice on average: no memorization


@pytest.fixture
def bad_data(tmp_path: Path) -> dict[str, str]:
    np.save(tmp_path / "neg.npy", np.array([3, -1] * 500, np.int32))
    np.save(tmp_path / "big.npy", np.array([3, 2**40] * 500, np.int64))
    (tmp_path / "binary").write_bytes(b"\x7fELF" + bytes(range(256)) * 8)
    (tmp_path / "afile").write_text("x")
    return {k.split(".")[0]: str(tmp_path / k) for k in ("neg.npy", "big.npy", "binary", "afile")}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data", "/no/such/path"], "argument --data: path does not exist"),
        (["--steps", "0"], "argument --steps: must be a positive integer"),
        (["--model", "tiny", "--seq-len", "4096"], "argument --seq-len: 4096 exceeds the model's max positions"),
        (["--hidden-size", "100", "--heads", "3"], "argument --heads:"),
        (["--lr", "1e-3", "--min-lr", "1e-2"], "argument --min-lr:"),
        (["--recipe", "bf16", "--master-weights", "bf16_sr"],
         "argument --master-weights: only applies to --optim coat"),
        (["--recipe", "fp16"], "argument --recipe: unknown recipe 'fp16' (recipes: amp, bf16,"),
        (["--steps", "ten"], "argument --steps: invalid int value"),
        (["--lr", "inf"], "argument --lr: must be a finite number, got inf"),
        (["--lr", "nan"], "argument --lr: must be a finite number, got nan"),
        (["--min-lr", "nan"], "argument --min-lr: must be a finite number, got nan"),
        (["--weight-decay", "nan"], "argument --weight-decay: must be a finite number"),
        (["--beta1", "2"], "argument --beta1: must be < 1, got 2.0"),
        (["--beta2", "-0.5"], "argument --beta2: must be >= 0"),
        (["--grad-clip", "inf"], "argument --grad-clip: must be a finite number"),
        (["--lr", "0"], "argument --lr: must be > 0"),
        (["--seed", "-1"], "argument --seed: must be an integer in [0, 4294967295], got -1"),
        (["--warmup-steps", "50", "--steps", "10"], "argument --warmup-steps: 50 is more than --steps 10"),
        (["--recipe", "coat", "--optim", "torch"], "argument --optim: 'torch' contradicts --recipe coat"),
        (["--recipe", "bf16", "--activations", "fp8"], "argument --activations: 'fp8' contradicts --recipe bf16"),
        (["--recipe", "bf16", "--compare"], "argument --compare: trains the bf16 baseline beside the recipe"),
        (["--vocab-size", "1000"], "argument --vocab-size: only applies to --tokenizer bpe"),
        (["--keep-last", "0"], "argument --keep-last: must be a positive integer"),
        (["--fsdp-unit", "0"], "argument --fsdp-unit: must be auto or a positive integer"),
        (["--model", "tiny", "--fsdp-unit", "3"], "argument --fsdp-unit: 3 is more than the model's 2 decoder layers"),
        (["--fsdp-unit", "2"], "argument --fsdp-unit: applies to FSDP2 runs: start coat train under torchrun"),
        (["--fp8-all-gather"], "argument --fp8-all-gather: applies to FSDP2 runs: start coat train under torchrun"),
        (["--fp8-all-gather", "--recipe", "coat", "--fp8-granularity", "row"],
         "argument --fp8-all-gather: gives per-tensor weight codes to eager layers: not with --compile or "
         "--fp8-granularity row"),
        (["--cuda-graph"], "argument --cuda-graph: needs a CUDA device"),
        (["--cuda-graph", "--recipe", "coat", "--release-grads"],
         "argument --cuda-graph: cannot be combined with --release-grads"),
        (["--save-every", "0"], "argument --save-every: must be a positive integer"),
        (["--model", "tiny", "--init", "/x"], "argument --model: cannot be combined with --init"),
        (["--init", "/no/such/ckpt"], "argument --init: /no/such/ckpt is not a folder"),
        (["--resume", "/no/such/run"], "argument --resume: /no/such/run is not a folder"),
        (["--data", "{neg}"], "argument --data: .*neg.npy: holds a negative token id"),
        (["--data", "{big}"], "argument --data: .*big.npy: holds token id 1099511627776"),
        (["--data", "{binary}"], "argument --data: .*binary looks like a binary file"),
        (["--out", "{afile}"], "argument --out: .*afile exists and is not a folder"),
        (["--out", "{afile}/run"], "argument --out: cannot create .*afile is a file, not a folder"),
        (["--out", "/proc/coat-run"], "argument --out: cannot create /proc/coat-run: /proc is not writable"),
    ],
)
def test_bad_flags_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture,
                                    tmp_path: Path, bad_data: dict[str, str]) -> None:
    out = tmp_path / "out"
    argv = [a.format(**bad_data) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(out)]
    with pytest.raises(SystemExit) as exc:
        main(["train", "--device", "cpu", "--cache-dir", str(tmp_path / "cache"), *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "usage: coat train" in err
    assert (re.search(message, err) if ".*" in message else message in err), err
    assert not out.exists()  # rejected before anything was written
    assert {p.name for p in tmp_path.iterdir()} <= {"cache", *(Path(p).name for p in bad_data.values())}


def test_missing_coat_optimizer_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "coat.optim", None)  # makes the import fail
    with pytest.raises(SystemExit) as exc:
        main(["train", "--device", "cpu", "--optim", "coat"])
    assert exc.value.code == 2 and "argument --optim: 'coat' needs coat.optim.AdamW" in capsys.readouterr().err


# --- output folders ---------------------------------------------------------------------------


def test_rerun_into_a_used_folder_keeps_its_files(tiny_run: dict, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    out = Path(tiny_run["out_dir"])
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(SystemExit) as exc:
        main(["train", "--device", "cpu", "--recipe", "bf16", "--out", str(out)])
    assert exc.value.code == 2 and "already holds files" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_default_folders_are_unique_within_a_second(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckpt.time, "strftime", lambda fmt, *a: "20250101-000000")
    first = ckpt.reserve_out(None, tmp_path / "runs")
    second = ckpt.reserve_out(None, tmp_path / "runs")
    assert first.name == "20250101-000000" and second.name == "20250101-000000-2"
    with pytest.raises(ckpt.OutputError, match="in use by another coat train"):
        _lock_from_another_process(first)
    ckpt.unlock(first)
    ckpt.unlock(second)


def _lock_from_another_process(folder: Path) -> None:
    code = ("import sys; from pathlib import Path; from coat.cli import checkpoint as c\n"
            "try:\n c.lock(Path(sys.argv[1]))\nexcept c.OutputError as e:\n print(e); sys.exit(3)")
    proc = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, env=_env(),
                          timeout=60)
    if proc.returncode == 3:
        raise ckpt.OutputError(proc.stdout.strip())
    assert proc.returncode == 0, proc.stderr


def test_non_finite_metrics_are_written_as_null(tmp_path: Path) -> None:
    log = ckpt.MetricsLog(tmp_path / "m.jsonl")
    log.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    log.close()
    line = (tmp_path / "m.jsonl").read_text()
    assert json.loads(line) == {"step": 1, "loss": None, "grad_norm": None, "lr": 1e-3}
    with pytest.raises(FileExistsError):  # a new log never truncates an existing file
        ckpt.MetricsLog(tmp_path / "m.jsonl")


def test_a_non_finite_held_out_loss_is_a_divergence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The last update can break the weights while its own train loss is still finite: the held-out
    # loss after it says so, and the run must not be reported finished with a NaN final loss.
    from coat.cli import runner

    real = runner._Training.evaluate_all

    def evaluate_all(self):
        scores = real(self)
        return {k: [float("nan")] * len(v) for k, v in scores.items()} if self.state["step"] >= 4 else scores

    monkeypatch.setattr(runner._Training, "evaluate_all", evaluate_all)
    code = main(["train", "--device", "cpu", "--recipe", "bf16", "--model", "tiny", "--steps", "8", "--eval-every",
                 "4", "--warmup-steps", "1", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "1", "--data",
                 str(STDLIB_JSON), "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "run"), "--quiet"])
    assert code == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["diverged_at"] == 4 and summary["finished"] is False


def test_divergence_stops_with_an_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # A finite but absurd learning rate diverges within a few steps: exit status 1, strict JSON.
    code = main(["train", "--device", "cpu", "--recipe", "bf16", "--model", "tiny", "--steps", "30",
                 "--lr", "1e6", "--grad-clip", "0", "--warmup-steps", "0", "--log-every", "1", "--seq-len", "32",
                 "--batch-size", "4", "--eval-batches", "1", "--data", str(STDLIB_JSON),
                 "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "run"), "--quiet"])
    assert code == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["diverged_at"] is not None and summary["finished"] is False
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # strict JSON: would fail on NaN / Infinity
