"""`coat train --resume`: every flag given is honoured or refused, defaults included (a flag
typed at its default value is a flag given), and a new --steps of a decaying schedule continues
the lr from where the run was (no jump), saying so. CPU, a ~0.1M-parameter model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_cli_train_checkpoint import records, tiny
from test_cli_train_resume_safety import usage_error

from coat.cli import checkpoint as ckpt
from coat.cli.main import main
from coat.cli.train import train


def test_flags_at_their_default_values_are_checked_too(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    train(tiny(tmp_path, "run", steps=4, save_every=1, keep_last=3, eval_every=2, grad_clip=0.5, seed=3,
               weight_decay=0.05))
    for flag, value, used in (("--grad-clip", "1.0", "0.5"), ("--seed", "0", "3"), ("--weight-decay", "0.1", "0.05")):
        err = usage_error(capsys, "--resume", str(run), "--steps", "6", flag, value)
        assert f"argument {flag}: cannot change when resuming (the run in {run} used {used})" in err
    # The run's own values are accepted (and change nothing): this resume goes on to say it is finished.
    assert "already finished its 4 steps" in usage_error(capsys, "--resume", str(run), "--grad-clip", "0.5",
                                                         "--seed", "3", "--recipe", "bf16")
    assert "argument --steps: 3 is before the checkpoint to resume from (step 4)" in usage_error(
        capsys, "--resume", str(run), "--steps", "3")
    # --keep-last is honoured, also at its default value (2, where the run kept 3).
    assert main(["train", "--resume", str(run), "--steps", "6", "--keep-last", "2", "--quiet"]) == 0
    assert [s for s, _ in ckpt.checkpoints(run)] == [5, 6]


def test_more_steps_continue_the_cosine_decay_without_a_jump(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    straight = tmp_path / "straight"
    train(tiny(tmp_path, "straight", steps=8, save_every=4, eval_every=4))
    half = tmp_path / "half"
    shutil.copytree(straight, half, ignore=shutil.ignore_patterns("step_00000008", ".lock"))
    capsys.readouterr()
    assert main(["train", "--resume", str(half), "--steps", "12"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    lrs = {r["step"]: r["lr"] for r in records(half) if "loss" in r}
    before = {r["step"]: r["lr"] for r in records(straight) if "loss" in r}
    cfg = json.loads((half / "config.json").read_text())["train"]
    assert cfg["lr_anchor"] == [4, pytest.approx(before[5] / cfg["lr"])]
    assert (f"--steps 8 -> 12: the cosine schedule continues from lr {before[5]:.4g} at step 4 and now decays to "
            f"--min-lr {cfg['min_lr']:.4g} until step 12 (without this the lr would jump to") in out
    assert [lrs[s] for s in range(1, 6)] == [before[s] for s in range(1, 6)]  # step 5: the lr it would have had
    steps = sorted(lrs)
    assert all(lrs[a] > lrs[b] for a, b in zip(steps[4:], steps[5:]))  # then a smooth decay ...
    assert cfg["min_lr"] < lrs[12] < 1.3 * cfg["min_lr"]  # ... to --min-lr after the new last step

    # Extended again: the decay goes on from the lr it reached, never up.
    assert main(["train", "--resume", str(half), "--steps", "14"]) == 0
    assert "the cosine schedule stays at --min-lr" in " ".join(capsys.readouterr().out.split())
    again = {r["step"]: r["lr"] for r in records(half) if "loss" in r}
    assert again[13] <= lrs[12] and again[14] <= again[13]


def test_save_on_a_finished_comparison_exports_both_recipes(tmp_path: Path) -> None:
    cfg = tiny(tmp_path, "cmp", recipe=None, compare=True, steps=2, save_every=2, eval_every=2)
    assert train(cfg)["runs"]["coat"]["finished"]
    assert not list((tmp_path / "cmp").glob("*/model"))
    assert main(["train", "--resume", str(tmp_path / "cmp"), "--save", "--quiet"]) == 0  # honoured, not ignored
    assert sorted(p.parent.name for p in (tmp_path / "cmp").glob("*/model")) == ["bf16", "coat"]
    summary = json.loads((tmp_path / "cmp" / "coat" / "summary.json").read_text())
    assert summary["finished"] and summary["model_dir"] == str(tmp_path / "cmp" / "coat" / "model")


def test_from_step_before_an_extension_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # Extended at step 8, the run's lr schedule before step 8 was the 8-step one, which the config no
    # longer records: a resume from step 4 would follow neither it nor a plain 12-step schedule.
    run = tmp_path / "run"
    train(tiny(tmp_path, "run", steps=8, save_every=2, keep_last=10, eval_every=4))
    assert main(["train", "--resume", str(run), "--steps", "12", "--quiet"]) == 0
    err = usage_error(capsys, "--resume", str(run), "--from-step", "4")
    assert "argument --from-step: step 4 comes before step 8, where the run" in err and ">= 8" in err, err
    assert main(["train", "--resume", str(run), "--from-step", "10", "--quiet"]) == 0  # after it: the same schedule


def test_a_new_steps_on_an_unfinished_comparison_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # bf16 stopped at step 4 of 6, coat not started: with --steps 10, bf16 would decay from its stop and coat
    # run a plain 10-step cosine; not a pair. Refused before anything (compare.json included) is written.
    top = tmp_path / "cmp"
    train(tiny(tmp_path, "cmp", recipe=None, compare=True, steps=6, save_every=2, keep_last=5, eval_every=2))
    shutil.rmtree(top / "coat")
    shutil.rmtree(top / "bf16" / "checkpoints" / "step_00000006")
    summary = json.loads((top / "bf16" / "summary.json").read_text())
    (top / "bf16" / "summary.json").write_text(json.dumps(summary | {"finished": False}))
    before = (top / "compare.json").read_text()
    err = usage_error(capsys, "--resume", str(top), "--steps", "10")
    assert "argument --steps: this comparison has not finished its 6 steps" in err, err
    assert (top / "compare.json").read_text() == before and not (top / "coat").exists()
