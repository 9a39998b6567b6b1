"""`coat train` with no recipe: coat and the BF16 baseline, each in a fresh process, same seed and
data order, one table and one PNG; Ctrl-C stops the comparison cleanly and --resume finishes it."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from _dist import wait_for_step

from coat.cli import checkpoint as ckpt
from coat.cli.compare import comparison_table
from coat.cli.main import main

REPO_ROOT = Path(__file__).resolve().parents[2]
STDLIB_JSON = Path(sysconfig.get_paths()["stdlib"]) / "json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _summary(**kw) -> dict:
    base = dict(final_val_loss=2.0, final_train_loss=1.9, peak_memory_bytes=600 * 2**20, peak_memory_kind="peak_rss",
                peak_memory_above_start_bytes=100 * 2**20, optimizer_state_bytes=8 * 2**20, tokens_per_s=1000.0,
                train_time_s=10.0, steps=100, tokens=102400, n_params=10**6, world_size=1, device="cpu",
                precision={"fp8": ["GEMMs"], "not_fp8": ["LM head"]})
    return base | kw


def test_comparison_table() -> None:
    table = comparison_table({"bf16": _summary(), "coat": _summary(
        final_val_loss=2.01, optimizer_state_bytes=2 * 2**20 + 2**18, tokens_per_s=500.0, train_time_s=20.0,
        peak_memory_above_start_bytes=80 * 2**20)}, "bf16", "coat")
    md = table["markdown"]
    assert "| final validation loss | 2.0000 | 2.0100 | +0.0100 (+0.50%) |" in md
    assert "| optimizer states | 8.0 MiB | 2.2 MiB | 0.28x |" in md
    assert "| tokens/s | 1,000 | 500 | 0.50x |" in md
    assert "| peak memory (process RSS) | 600.0 MiB | 600.0 MiB | 1.00x |" in md
    assert "|   added by training (peak RSS - RSS at start) | 100.0 MiB | 80.0 MiB | 0.80x |" in md
    assert "coat, in FP8: GEMMs." in md and "coat, not in FP8: LM head." in md
    assert "C++ reference kernels" in md  # a CPU table says its tokens/s mean nothing for GPUs
    assert table["rows"]["coat"]["final_val_loss"] == 2.01


def test_each_side_of_a_comparison_resolves_to_its_recipe() -> None:
    from coat.cli.compare import _sub_flags
    from coat.cli.config import TrainConfig, resolve_config

    # Parts given without a recipe (bf16 activations, FP8 optimizer states): a combination with no
    # recipe name, compared with bf16; each side's flags resolve without contradicting themselves.
    flags = TrainConfig(activations="bf16", optim="coat", master_weights="bf16_sr", device="cpu")
    top = resolve_config(flags)
    assert top.compare and top.recipe == "bf16-activations+coat-adamw"
    base = resolve_config(_sub_flags(flags, ("bf16", "torch"), Path("b")))
    side = resolve_config(_sub_flags(flags, (top.activations, top.optim), Path("c")))
    assert (base.recipe, base.compare, base.master_weights) == ("bf16", False, "fp32")
    assert (side.recipe, side.compare, side.master_weights) == (top.recipe, False, "bf16_sr")
    assert resolve_config(side) == side  # a resolved side resolves to itself


def test_compare_is_stopped_by_ctrl_c_and_resumed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    top = tmp_path / "cmp"
    argv = ["train", "--device", "cpu", "--model", "tiny", "--steps", "100000", "--batch-size", "4", "--seq-len", "32",
            "--eval-batches", "2", "--eval-every", "4", "--log-every", "1", "--schedule", "constant",
            "--warmup-steps", "0", "--data", str(STDLIB_JSON), "--cache-dir", str(tmp_path / "cache"),
            "--out", str(top), "--quiet"]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "coat", *argv], env=env, stderr=subprocess.PIPE, text=True)
    wait_for_step(top / "bf16" / "metrics.jsonl", 2, proc, timeout=180)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends; the parent forwards it to the training child
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err
    assert err.count("SIGINT: stopping after this step") == 1  # delivered once, not twice (which aborts)
    k = json.loads((top / "bf16" / "summary.json").read_text())["steps"]
    assert [s for s, _ in ckpt.checkpoints(top / "bf16")] == [k]
    assert not (top / "coat").exists() and not (top / "comparison.md").exists()  # the second run never started

    steps = k + 4
    assert main(["train", "--resume", str(top), "--steps", str(steps), "--quiet"]) == 0
    runs = {r: json.loads((top / r / "summary.json").read_text()) for r in ("bf16", "coat")}
    assert all(r["finished"] and r["steps"] == steps for r in runs.values())
    assert runs["coat"]["optimizer_state_bytes"] < 0.3 * runs["bf16"]["optimizer_state_bytes"]
    # Same seed, so the same initial weights; same data order, so near-identical first losses.
    first = {r: [json.loads(line) for line in (top / r / "metrics.jsonl").read_text().splitlines()][:2]
             for r in runs}
    assert abs(first["bf16"][0]["val_loss"] - first["coat"][0]["val_loss"]) < 0.01
    assert abs(first["bf16"][1]["loss"] - first["coat"][1]["loss"]) < 0.01
    md = (top / "comparison.md").read_text()
    for row in ("final validation loss", "peak memory (process RSS)", "optimizer states", "tokens/s"):
        assert f"| {row} |" in md
    assert "coat, in FP8: GEMMs of 2/2 decoder layers" in md
    assert (top / "comparison.png").read_bytes()[:8] == PNG_MAGIC
    table = json.loads((top / "comparison.json").read_text())
    assert table["coat"]["final_val_loss"] == runs["coat"]["final_val_loss"]

    # Each recipe's run loads --data itself: recipes that saw different tokens (data changed between
    # them) are not paired. Stood in for by the coat run's recorded digest; nothing is written.
    cfg_path = top / "coat" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    assert cfg["corpus"]["digest"] == json.loads((top / "bf16" / "config.json").read_text())["corpus"]["digest"]
    cfg_path.write_text(json.dumps(cfg | {"corpus": cfg["corpus"] | {"digest": "0" * 32}}))
    for f in ("comparison.md", "comparison.json", "comparison.png"):
        (top / f).unlink()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["train", "--resume", str(top), "--quiet"])
    err = " ".join(capsys.readouterr().err.split())
    assert exc.value.code == 2 and "the recipes of this comparison trained on different data" in err, err
    assert not any((top / f).exists() for f in ("comparison.md", "comparison.json", "comparison.png"))


@pytest.mark.gpu
def test_compare_on_a_gpu(tmp_path: Path) -> None:
    """The default comparison's GPU path at a tiny size: bf16 autocast, CUDA peaks, FP8 states."""
    top = tmp_path / "cmp"
    assert main(["train", "--device", "cuda", "--model", "tiny", "--steps", "40", "--batch-size", "8", "--seq-len",
                 "128", "--eval-batches", "2", "--log-every", "5", "--data", str(STDLIB_JSON),
                 "--cache-dir", str(tmp_path / "cache"), "--out", str(top), "--quiet"]) == 0
    runs = {r: json.loads((top / r / "summary.json").read_text()) for r in ("bf16", "coat")}
    for r in runs.values():
        assert r["finished"] and r["device"] == "cuda" and r["peak_memory_kind"] == "cuda_max_allocated"
        assert r["peak_memory_bytes"] > 0 and r["tokens_per_s"] > 0
        assert any("bf16 (autocast)" in p for p in r["precision"]["not_fp8"])
    assert runs["coat"]["optimizer_state_bytes"] < 0.3 * runs["bf16"]["optimizer_state_bytes"]
    # FP8 noise on a tiny model: the final losses agree to a few percent.
    assert abs(runs["coat"]["final_val_loss"] / runs["bf16"]["final_val_loss"] - 1) < 0.05
    assert "peak memory (CUDA max allocated)" in (top / "comparison.md").read_text()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["coat", "bf16"])
def test_cuda_graph_trains_as_the_eager_loop(tmp_path: Path, recipe: str) -> None:
    """--cuda-graph (coat.CudaGraphStep in the loop: clipping, the LR schedule re-capturing the
    optimizer graph, evaluations between steps) ends where the eager loop ends."""
    summaries = {}
    for mode in ("eager", "graph"):
        out = tmp_path / mode
        assert main(["train", "--device", "cuda", "--model", "tiny", "--recipe", recipe, "--steps", "30",
                     "--batch-size", "8", "--seq-len", "128", "--eval-batches", "2", "--eval-every", "10",
                     "--log-every", "5", "--data", str(STDLIB_JSON), "--cache-dir", str(tmp_path / "cache"),
                     "--out", str(out), "--quiet", *(["--cuda-graph"] if mode == "graph" else [])]) == 0
        summaries[mode] = json.loads((out / "summary.json").read_text())
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows if "grad_norm" in r)
    e, g = summaries["eager"], summaries["graph"]
    assert g["finished"] and g["final_val_loss"] < g["initial_val_loss"] - 0.2
    assert abs(g["final_val_loss"] / e["final_val_loss"] - 1) < 0.01
