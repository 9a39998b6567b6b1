"""`coat train` on a full disk (writes that raise ENOSPC, simulated in-process): one clear error
and nothing torn or half-written (no .tmp- checkpoint left, metrics.jsonl whole lines only,
no half-exported model), and the trained weights are never lost: a final --save that fails
keeps them in a checkpoint, and `coat train --resume OUT --save` exports a finished run.
CPU, a ~0.1M-parameter model, seconds per run."""

from __future__ import annotations

import errno
import io
import json
import os
from pathlib import Path

import pytest
from test_cli_train_checkpoint import _argv, tiny

from coat.cli import checkpoint as ckpt
from coat.cli.config import TrainConfig
from coat.cli.main import main
from coat.cli.train import train

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # usage errors
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, " ".join(err.split())


def whole_lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_a_checkpoint_that_does_not_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture) -> None:
    class FullDisk(io.FileIO):
        """A file on a disk with room for 100 more bytes: torch.save then fails in its C++
        writer (a RuntimeError with the OSError as its context), as on a real full disk."""

        def write(self, data) -> int:
            if self.tell() + len(data) > 100:
                raise ENOSPC
            return super().write(data)

    def open_on_full_disk(path, mode="r", *args, **kwargs):
        if "step_00000004" in str(path) and "w" in mode:
            return io.BufferedWriter(FullDisk(path, "w")) if "b" in mode else \
                io.TextIOWrapper(io.BufferedWriter(FullDisk(path, "w")))
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(ckpt, "open", open_on_full_disk, raising=False)
    cfg = tiny(tmp_path, "run", steps=6, save_every=2, eval_every=3)
    code, err = run_cli(_argv(cfg), capsys)
    run = tmp_path / "run"
    assert code == 1
    assert (f"coat train: error: could not write checkpoint {run}/checkpoints/step_00000004: No space left on device; "
            "the checkpoints of steps 2 are kept; the run stopped at step 4: free space, then continue it from "
            f"step_00000002 with: coat train --resume {run}") in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]  # no .tmp- left
    assert max(r["step"] for r in whole_lines(run / "metrics.jsonl")) == 4

    monkeypatch.undo()
    resumed = train(TrainConfig(resume=str(run), quiet=True, cache_dir=str(tmp_path / "cache")))
    assert resumed["finished"] and [s for s, _ in ckpt.checkpoints(run)] == [4, 6]


def test_metrics_lines_are_whole_or_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    real, calls = ckpt._write_fd, []

    def full_disk(fd: int, data: bytes) -> int:
        calls.append(data)
        if len(calls) == 4:  # step 3's record: half of it reaches the file, then the disk is full
            os.write(fd, data[: len(data) // 2])
            raise ENOSPC
        return real(fd, data)

    monkeypatch.setattr(ckpt, "_write_fd", full_disk)
    code, err = run_cli(_argv(tiny(tmp_path, "run", steps=6, save_every=2, eval_every=3)), capsys)
    run = tmp_path / "run"
    assert code == 1
    assert (f"could not write {run}/metrics.jsonl: No space left on device; the run stopped at step 3: free space, "
            f"then continue it from step_00000002") in err
    assert [r["step"] for r in whole_lines(run / "metrics.jsonl")] == [0, 1, 2]


def test_a_final_save_that_fails_keeps_the_weights_to_export_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from transformers import AutoModelForCausalLM, PreTrainedModel

    real = PreTrainedModel.save_pretrained

    def full_disk(self, folder, *args, **kwargs) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"part of the weights")
        raise ENOSPC

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    cfg = tiny(tmp_path, "run", steps=4, save_every=None, eval_every=2)
    code, err = run_cli([*_argv(cfg), "--save"], capsys)
    run = tmp_path / "run"
    assert code == 1
    assert (f"could not write {run}/model: No space left on device; the trained weights are kept in "
            f"{run}/checkpoints/step_00000004: free space, then export them with: coat train --resume {run} "
            "--save") in err
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".lock")) == [
        "checkpoints", "config.json", "metrics.jsonl"]  # no half-written model folder
    assert [s for s, _ in ckpt.checkpoints(run)] == [4]  # written when the export failed

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real)
    code, err = run_cli(["train", "--resume", str(run), "--quiet"], capsys)
    assert code == 2 and "already finished its 4 steps; pass --steps with a larger total to train further, " \
                          "or --save to export its trained model" in err
    assert main(["train", "--resume", str(run), "--save", "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["model_dir"] == str(run / "model")
    assert AutoModelForCausalLM.from_pretrained(run / "model").num_parameters() > 0
    code, err = run_cli(["train", "--resume", str(run), "--save", "--quiet"], capsys)
    assert code == 2 and f"argument --save: {run}/model already exists" in err
