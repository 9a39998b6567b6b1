"""`coat train` checkpoints: --save-every/--keep-last/--resume, exact resumption, clean stops on
SIGINT/SIGTERM, and checkpoints that are whole or absent even when the process is killed while
writing one. CPU, ~0.1M-parameter model, seconds per run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from _dist import wait_for_step

from coat.cli import checkpoint as ckpt
from coat.cli.config import TrainConfig
from coat.cli.main import main
from coat.cli.train import train

REPO_ROOT = Path(__file__).resolve().parents[2]
STDLIB_JSON = Path(sysconfig.get_paths()["stdlib"]) / "json"
TIMING = ("tokens_per_s", "elapsed_s")


def tiny(tmp: Path, name: str, **overrides) -> TrainConfig:
    base = dict(model="tiny", steps=12, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2, eval_every=4,
                eval_batches=2, log_every=1, data=str(STDLIB_JSON), out=str(tmp / name),
                cache_dir=str(tmp / "cache"), device="cpu", quiet=True, recipe="bf16", save_every=6)
    return TrainConfig(**(base | overrides))


def records(folder: Path) -> list[dict]:
    """metrics.jsonl without the timing fields (which differ between any two runs)."""
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def assert_same_state(a: Path, b: Path) -> None:
    """Model and optimizer state of two single-process checkpoints are bit-identical."""
    sa = torch.load(a / "model_optim.pt", weights_only=True)
    sb = torch.load(b / "model_optim.pt", weights_only=True)
    assert sa["model"].keys() == sb["model"].keys()
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]), k
    assert sa["optim"]["state"].keys() == sb["optim"]["state"].keys()
    for pid, st in sa["optim"]["state"].items():
        for k, v in st.items():
            other = sb["optim"]["state"][pid][k]
            assert torch.equal(v, other) if isinstance(v, torch.Tensor) else v == other, (pid, k)


def _env() -> dict:
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def _argv(cfg: TrainConfig) -> list[str]:
    argv = ["train"]
    for k, v in vars(cfg).items():
        if v is False and getattr(TrainConfig, k) is True:  # a flag on by default: --no-...
            argv.append(f"--no-{k.replace('_', '-')}")
        if v is None or v is False or k == "quiet":
            continue
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return argv + ["--quiet"]


# ---- exact resumption -------------------------------------------------------------------------


def train_and_resume(tmp_path: Path, **run) -> tuple[dict, dict]:
    """Train 12 steps (checkpoints at 6 and 12), then resume the run's folder as it was after step 6:
    the same records (every loss, grad norm and lr) and the same final checkpoint, bit for bit.
    Returns (straight, resumed) summaries."""
    straight = train(tiny(tmp_path, "straight", **run))
    assert straight["finished"] and [s for s, _ in ckpt.checkpoints(tmp_path / "straight")] == [6, 12]
    half = tmp_path / "half"
    shutil.copytree(tmp_path / "straight", half, ignore=shutil.ignore_patterns("step_00000012", ".lock"))
    (half / "summary.json").unlink()
    resumed = train(TrainConfig(resume=str(half), quiet=True, cache_dir=str(tmp_path / "cache")))
    assert resumed["finished"] and resumed["steps"] == 12
    assert records(half) == records(tmp_path / "straight")
    assert_same_state(half / "checkpoints" / "step_00000012", tmp_path / "straight" / "checkpoints" / "step_00000012")
    return straight, resumed


@pytest.mark.parametrize("recipe", ["bf16", "coat", "coat-release"])
def test_n_steps_resume_n_steps_equals_2n_steps(tmp_path: Path, recipe: str) -> None:
    # coat-release: gradient release, its carried clipping norm saved in the checkpoint.
    extra = dict(recipe="coat", release_grads=True) if recipe == "coat-release" else dict(recipe=recipe)
    straight, resumed = train_and_resume(tmp_path, **extra)
    assert resumed["final_val_loss"] == straight["final_val_loss"]


def test_keep_last_and_resume_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    train(tiny(tmp_path, "run", steps=10, save_every=2, keep_last=2, eval_every=5))
    assert [s for s, _ in ckpt.checkpoints(run)] == [8, 10]
    assert not list((run / "checkpoints").glob(".*"))  # no temporary or half-deleted folders left

    def usage_error(*argv: str) -> str:
        with pytest.raises(SystemExit) as exc:
            main(["train", *argv])
        assert exc.value.code == 2
        return capsys.readouterr().err

    assert "already finished its 10 steps" in usage_error("--resume", str(run))
    assert "argument --lr: cannot change when resuming" in usage_error("--resume", str(run), "--lr", "0.1")
    assert "argument --out: a resumed run writes into its own folder" in usage_error(
        "--resume", str(run), "--out", str(tmp_path / "elsewhere"))
    no_ckpt = tmp_path / "no_ckpt"
    train(tiny(tmp_path, "no_ckpt", steps=3, save_every=None))
    assert "holds no whole checkpoint" in usage_error("--resume", str(no_ckpt), "--steps", "6")
    assert "is not a coat train output folder" in usage_error("--resume", str(tmp_path / "cache"))
    # A checkpoint from another world size is refused, naming the count.
    meta = run / "checkpoints" / "step_00000010" / "meta.json"
    meta.write_text(json.dumps(json.loads(meta.read_text()) | {"world_size": 2, "format": "dcp"}))
    (meta.parent / ".metadata").write_bytes(b"")
    ckpt.write_manifest(meta.parent)  # a whole checkpoint of two processes, as far as its files tell
    assert "written by 2 process(es)" in usage_error("--resume", str(run), "--steps", "12")


def test_steps_can_be_extended_on_resume(tmp_path: Path) -> None:
    # Constant schedule: the lr never depends on the total, so 6 + resume + 4 == 10 exactly.
    kw = dict(schedule="constant", warmup_steps=0, eval_every=100, save_every=100)
    train(tiny(tmp_path, "short", steps=6, **kw))
    extended = train(TrainConfig(resume=str(tmp_path / "short"), steps=10, quiet=True,
                                 cache_dir=str(tmp_path / "cache")))
    assert extended["steps"] == 10
    long = train(tiny(tmp_path, "long", steps=10, **kw))
    assert extended["final_val_loss"] == long["final_val_loss"]

    def train_losses(folder: Path) -> list[dict]:  # the short run also evaluated at its old end, step 6
        return [{k: v for k, v in r.items() if k != "val_loss"} for r in records(folder)]

    assert train_losses(tmp_path / "short") == train_losses(tmp_path / "long")
    assert_same_state(tmp_path / "short" / "checkpoints" / "step_00000010",
                      tmp_path / "long" / "checkpoints" / "step_00000010")


# ---- signals and kills ------------------------------------------------------------------------


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_cleanly_and_the_run_resumes_exactly(tmp_path: Path, sig: int, status: int) -> None:
    # Constant lr and no evaluation until the end: the run's steps do not depend on its total,
    # so "stopped at k, resumed to k + 4" must equal a run of k + 4 steps.
    kw = dict(schedule="constant", warmup_steps=0, eval_every=100000, save_every=None)
    cfg = tiny(tmp_path, "stopped", steps=100000, **kw)
    proc = subprocess.Popen([sys.executable, "-m", "coat", *_argv(cfg)], env=_env(), stderr=subprocess.PIPE,
                            text=True)
    wait_for_step(tmp_path / "stopped" / "metrics.jsonl", 3, proc, timeout=120)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err
    assert f"{signal.Signals(sig).name}: stopping after this step" in err
    lines = (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert all(line.endswith("\n") for line in lines) and [json.loads(line) for line in lines]  # whole lines
    summary = json.loads((tmp_path / "stopped" / "summary.json").read_text())
    k = summary["steps"]
    assert summary["stopped_by"] == signal.Signals(sig).name and not summary["finished"]
    assert [s for s, _ in ckpt.checkpoints(tmp_path / "stopped")] == [k] and k >= 3

    resumed = train(TrainConfig(resume=str(tmp_path / "stopped"), steps=k + 4, save_every=100000, quiet=True,
                                cache_dir=str(tmp_path / "cache")))
    straight = train(tiny(tmp_path, "straight", steps=k + 4, **(kw | {"save_every": 100000})))
    assert resumed["finished"] and resumed["final_val_loss"] == straight["final_val_loss"]
    assert records(tmp_path / "stopped") == records(tmp_path / "straight")
    assert_same_state(tmp_path / "stopped" / "checkpoints" / f"step_{k + 4:08d}",
                      tmp_path / "straight" / "checkpoints" / f"step_{k + 4:08d}")


_KILL_WHILE_SAVING = """
import os, signal, sys
from coat.cli import checkpoint, main
real = checkpoint._save_file
def dying_save(obj, path):
    if "step_00000004" in str(path) and path.name == "train_state.pt":
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    real(obj, path)
checkpoint._save_file = dying_save
sys.exit(main.main(sys.argv[1:]))
"""


def test_a_process_killed_while_saving_leaves_the_last_whole_checkpoint(tmp_path: Path) -> None:
    cfg = tiny(tmp_path, "killed", steps=8, save_every=2, eval_every=4)
    proc = subprocess.run([sys.executable, "-c", _KILL_WHILE_SAVING, *_argv(cfg)], env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    folder = tmp_path / "killed"
    assert [s for s, _ in ckpt.checkpoints(folder)] == [2]  # step 4 never became a checkpoint
    assert (folder / "checkpoints" / ".tmp-step_00000004").is_dir()
    assert max(json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()) == 4

    resumed = train(TrainConfig(resume=str(folder), quiet=True, cache_dir=str(tmp_path / "cache")))
    train(tiny(tmp_path, "straight", steps=8, save_every=2, eval_every=4))
    assert resumed["finished"] and records(folder) == records(tmp_path / "straight")
    assert not (folder / "checkpoints" / ".tmp-step_00000004").exists()  # removed by the next save
    assert_same_state(folder / "checkpoints" / "step_00000008", tmp_path / "straight" / "checkpoints" / "step_00000008")
