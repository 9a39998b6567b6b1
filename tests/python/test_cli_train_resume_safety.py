"""`coat train --resume` reads only checkpoints that are whole, of this run, and safe: every file
is checked against the checkpoint's manifest (size, sha256); a damaged or foreign latest
checkpoint gives one clear error that offers the newest whole one (--from-step N); no file is
read in a way that could run code from it (DCP's .metadata and byte entries included).
CPU, a ~0.1M-parameter model, seconds per run."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from test_cli_train_checkpoint import STDLIB_JSON, records, tiny

from coat.cli import checkpoint as ckpt
from coat.cli.config import TrainConfig
from coat.cli.main import main
from coat.cli.train import train


class _WritesMarker:
    """Unpickling this creates the file at ``path``: code run from a checkpoint."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def usage_error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["train", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    return " ".join(err.split())


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 6-step run with checkpoints at steps 2, 4 and 6."""
    tmp = tmp_path_factory.mktemp("base")
    train(tiny(tmp, "run", steps=6, save_every=2, keep_last=3, eval_every=3))
    return tmp


def test_resume_refuses_changed_data_of_the_same_size(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A file of --data rewritten with as many bytes (so as many tokens) between a run and its
    resume: the run would go on with other tokens, and its curve would join two data sets."""
    data = tmp_path / "data"
    shutil.copytree(STDLIB_JSON, data, ignore=shutil.ignore_patterns("__pycache__"))
    train(tiny(tmp_path, "run", steps=4, save_every=2, data=str(data)))
    victim = max(data.glob("*.py"), key=lambda p: p.stat().st_size)
    victim.write_text(victim.read_text().swapcase())
    err = usage_error(capsys, "--resume", str(tmp_path / "run"), "--steps", "6", "--cache-dir", str(tmp_path / "cache"))
    assert "--data" in err and "as many tokens, but not the same ones" in err, err
    assert [s for s, _ in ckpt.checkpoints(tmp_path / "run")] == [2, 4]  # nothing ran


def damaged_copy(base: Path, tmp: Path, damage) -> Path:
    run = tmp / "run"
    shutil.copytree(base / "run", run, ignore=shutil.ignore_patterns(".lock"))
    damage(run / "checkpoints" / "step_00000006")
    return run


def flip_byte(ckpt_dir: Path) -> None:
    path = ckpt_dir / "model_optim.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(ckpt_dir: Path) -> None:
    path = ckpt_dir / "train_state.pt"
    path.write_bytes(path.read_bytes()[:10])


def bad_meta(ckpt_dir: Path) -> None:
    (ckpt_dir / "meta.json").write_text("{not json")
    ckpt.write_manifest(ckpt_dir)  # the checksums agree: only the record itself is wrong


@pytest.mark.parametrize("damage, why", [
    (flip_byte, "its file model_optim.pt does not match its checksum"),
    (truncate, "its file train_state.pt has 10 bytes"),
    (lambda c: (c / "train_state.pt").write_bytes(b""), "its file train_state.pt has 0 bytes"),
    (lambda c: (c / "rank00000.pt").unlink(), "its file rank00000.pt is missing"),
    (lambda c: (c / "manifest.json").unlink(), "it has no manifest.json"),
    (lambda c: (shutil.rmtree(c), c.mkdir()), "it has no manifest.json"),  # an empty folder
    (bad_meta, "its meta.json is not valid JSON"),
])
def test_a_damaged_latest_checkpoint_is_refused_with_the_previous_offered(
        base: Path, tmp_path: Path, capsys: pytest.CaptureFixture, damage, why: str) -> None:
    run = damaged_copy(base, tmp_path, damage)
    err = usage_error(capsys, "--resume", str(run), "--steps", "8")
    assert "argument --resume: checkpoint" in err and "step_00000006 cannot be resumed" in err and why in err
    assert f"resume from it with --resume {run} --from-step 4" in err


def test_from_step_resumes_an_earlier_checkpoint_and_sets_the_later_aside(
        base: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = damaged_copy(base, tmp_path, flip_byte)
    assert "has no checkpoint of step 5 (it has steps 2, 4, 6)" in usage_error(
        capsys, "--resume", str(run), "--from-step", "5")
    assert "argument --from-step: only applies with --resume" in usage_error(capsys, "--from-step", "4")
    resumed = train(TrainConfig(resume=str(run), from_step=4, quiet=True, cache_dir=str(base / "cache")))
    assert resumed["finished"] and resumed["steps"] == 6
    assert records(run) == records(base / "run")  # steps 5 and 6 again, bit for bit
    assert [s for s, _ in ckpt.checkpoints(run)] == [2, 4, 6]
    assert (run / "checkpoints" / "set-aside-step_00000006").is_dir()  # kept, never deleted
    assert json.loads((run / "config.json").read_text())["flags"]["from_step"] is None  # not for the next resume


def test_a_rewound_run_no_longer_says_it_finished(base: Path, tmp_path: Path) -> None:
    # --from-step sets the later checkpoints aside; were that resume to die before its own summary, a
    # comparison would otherwise take the old summary (and its figures) for the run's result.
    run = damaged_copy(base, tmp_path, lambda _: None)
    assert json.loads((run / "summary.json").read_text())["finished"]
    moved = ckpt.set_aside_after(run, run / "checkpoints" / "step_00000004")
    assert [p.name for p in moved] == ["set-aside-step_00000006"]
    assert [s for s, _ in ckpt.checkpoints(run)] == [2, 4]
    assert json.loads((run / "summary.json").read_text())["finished"] is False


def test_a_checkpoint_of_another_run_is_refused(base: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # The same step of a run with another recipe and model shape, copied in whole with its manifest.
    train(tiny(tmp_path, "other", steps=6, save_every=6, recipe="coat", hidden_size=32))
    run = damaged_copy(base, tmp_path, lambda c: (shutil.rmtree(c), shutil.copytree(
        tmp_path / "other" / "checkpoints" / "step_00000006", c)))
    err = usage_error(capsys, "--resume", str(run), "--steps", "8")
    assert "it belongs to another run: run_id" in err and "recipe 'coat' (this run: 'bf16')" in err
    assert "model" in err and "--from-step 4" in err
    # The same settings, another run (its own id): refused too.
    train(tiny(tmp_path, "twin", steps=6, save_every=6))
    twin = damaged_copy(base, tmp_path / "x", lambda c: (shutil.rmtree(c), shutil.copytree(
        tmp_path / "twin" / "checkpoints" / "step_00000006", c)))
    err = usage_error(capsys, "--resume", str(twin), "--steps", "8")
    assert "it belongs to another run: run_id" in err and "recipe '" not in err.split('coat train: error:')[1]


# ---- nothing read runs code -----------------------------------------------------------------------


def test_dcp_metadata_and_entries_are_read_without_running_code(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint.api import CheckpointException

    from coat.cli.safe_load import SafeFileSystemReader, SafeLoadPlanner

    def state(value) -> dict:
        return {"model": {"w": torch.arange(12.0).reshape(3, 4)},
                "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "m_format": value}]}}

    def load(folder: Path) -> dict:
        target = state("")
        target["model"]["w"] = torch.zeros(3, 4)
        dcp.load(target, storage_reader=SafeFileSystemReader(str(folder)), planner=SafeLoadPlanner())
        return target

    marker = tmp_path / "marker"
    with pytest.warns(UserWarning):  # no process group: DCP says it saves as one process
        dcp.save(state("e4m3"), checkpoint_id=str(tmp_path / "good"))
        dcp.save(state(_WritesMarker(marker)), checkpoint_id=str(tmp_path / "bad_entry"))
    good = load(tmp_path / "good")
    assert good["optim"]["param_groups"][0] == {"lr": 0.1, "betas": (0.9, 0.95), "m_format": "e4m3"}
    assert torch.equal(good["model"]["w"], torch.arange(12.0).reshape(3, 4))

    with pytest.raises(CheckpointException, match="m_format: WeightsUnpickler error"):  # an entry that runs code
        load(tmp_path / "bad_entry")
    shutil.copytree(tmp_path / "good", tmp_path / "bad_meta")
    (tmp_path / "bad_meta" / ".metadata").write_bytes(pickle.dumps(_WritesMarker(marker)))
    with pytest.raises(CheckpointException, match="loading it could run code"):
        load(tmp_path / "bad_meta")
    assert not marker.exists()

    # verify() refuses the same .metadata before anything is loaded, with one clear reason.
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    shutil.copytree(tmp_path / "bad_meta", step)
    for name in ("train_state.pt", "rank00000.pt", "rank00001.pt"):
        torch.save({}, step / name)
    (step / "meta.json").write_text(json.dumps({"step": 2, "world_size": 2, "format": "dcp", "run": None}))
    ckpt.write_manifest(step)
    with pytest.raises(ckpt.CheckpointError, match=r"its \.metadata cannot be read safely: it refers to io\.open"):
        ckpt.verify(step, 2, None)
    assert not marker.exists()


def test_a_pickle_that_runs_code_in_a_checkpoint_file_is_refused(
        base: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    marker = tmp_path / "marker"

    def plant(ckpt_dir: Path) -> None:
        torch.save({"step": 6, "payload": _WritesMarker(marker)}, ckpt_dir / "train_state.pt")
        ckpt.write_manifest(ckpt_dir)  # a folder handed over whole, checksums and all

    run = damaged_copy(base, tmp_path, plant)
    err = usage_error(capsys, "--resume", str(run), "--steps", "8")
    assert "step_00000006 cannot be resumed: it could not be loaded safely (UnpicklingError: WeightsUnpickler " \
           "error: Unsupported global: GLOBAL io.open" in err
    assert f"resume from it with --resume {run} --from-step 4" in err and not marker.exists()


def test_a_manifest_naming_files_outside_the_checkpoint_is_refused(
        base: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A manifest is read from the checkpoint: the files it names are hashed, so none may lie outside."""
    outside = tmp_path / "outside.txt"
    outside.write_text("not the checkpoint's")

    def point_out(ckpt_dir: Path) -> None:
        manifest = json.loads((ckpt_dir / "manifest.json").read_text())
        manifest["files"]["../../../outside.txt"] = {"bytes": outside.stat().st_size, "sha256": "0"}
        (ckpt_dir / "manifest.json").write_text(json.dumps(manifest))

    run = damaged_copy(base, tmp_path, point_out)
    err = usage_error(capsys, "--resume", str(run), "--steps", "8")
    assert "names '../../../outside.txt', outside the checkpoint folder" in err

    def link_out(ckpt_dir: Path) -> None:  # a listed name that is a symlink to a file elsewhere
        (ckpt_dir / "model_optim.pt").unlink()
        (ckpt_dir / "model_optim.pt").symlink_to(outside)

    run = damaged_copy(base, tmp_path / "linked", link_out)
    err = usage_error(capsys, "--resume", str(run), "--steps", "8")
    assert "names 'model_optim.pt', outside the checkpoint folder" in err


def test_a_lock_file_that_is_a_symlink_is_refused(base: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = damaged_copy(base, tmp_path, lambda ckpt_dir: None)
    victim = tmp_path / "victim"
    (run / ".lock").symlink_to(victim)
    err = usage_error(capsys, "--resume", str(run), "--steps", "8")
    assert ".lock is a symlink or unusable" in err and not victim.exists()


def test_a_blocked_global_is_named_in_the_refusal() -> None:
    """torch names the global a pickle would run on one line among advice (worded otherwise across
    versions); the refusal keeps that line."""
    import io
    import os as _os

    from coat.cli.safe_load import unpickling_cause

    class _System:
        def __reduce__(self):
            return (_os.system, ("true",))

    buf = io.BytesIO()
    torch.save({"x": _System()}, buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError) as e:
        torch.load(buf, weights_only=True)
    cause = unpickling_cause(e.value)
    assert "system" in cause and "Check the documentation" not in cause and "Weights only load failed" not in cause
    import fractions

    buf = io.BytesIO()
    torch.save({"x": fractions.Fraction(1, 3)}, buf)  # a global of an allowed module: torch advises allowing it
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError) as e:
        torch.load(buf, weights_only=True)
    cause = unpickling_cause(e.value)
    assert "Fraction" in cause and "add_safe_globals" not in cause
