"""Ctrl-C in the first seconds of `coat train`: one line, no traceback, exit status 130, and no
half-made output folder left to block a rerun with the same --out. The interrupt is raised
in-process at the points it can hit (deterministic, unlike a timed signal)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli_train_checkpoint import _argv, tiny

from coat.cli import compare, runner
from coat.cli.main import main


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


@pytest.mark.parametrize("raised", [
    KeyboardInterrupt(),
    # transformers' lazy imports turn a Ctrl-C into an import error, the interrupt as its cause
    ModuleNotFoundError("Could not import module 'LlamaForCausalLM'"),
])
def test_an_interrupt_before_the_first_step_leaves_no_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, raised: BaseException) -> None:
    def interrupted_run(plan, d, log):
        (plan.out / "config.json").write_text("{}")  # what a run writes before its first step
        (plan.out / "metrics.jsonl").write_text(json.dumps({"step": 0, "val_loss": 5.0}) + "\n")
        if isinstance(raised, KeyboardInterrupt):
            raise raised
        raise raised from KeyboardInterrupt()

    monkeypatch.setattr(runner, "run", interrupted_run)
    cfg = tiny(tmp_path, "run")
    code, err = run_cli(_argv(cfg), capsys)
    assert code == 130 and "aborted;" in err
    assert not (tmp_path / "run").exists()

    monkeypatch.undo()
    assert main(_argv(tiny(tmp_path, "run", steps=2, save_every=None))) == 0  # the same --out works


def test_an_interrupted_comparison_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    calls = []

    def child_interrupted_while_importing(cfg, explicit=None):
        calls.append(cfg)
        return 130, "SIGINT"  # the child ended before it created its folder

    monkeypatch.setattr(compare, "_run_child", child_interrupted_while_importing)
    code, err = run_cli([*_argv(tiny(tmp_path, "run", recipe=None)), "--compare"], capsys)
    assert code == 130 and "[bf16] interrupted before its first step; nothing was kept" in err
    assert len(calls) == 1 and not (tmp_path / "run").exists()


def test_a_signal_as_one_recipe_finishes_stops_the_comparison(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    calls = []

    def child_finishing_as_signalled(cfg, explicit=None):
        calls.append(cfg)
        Path(cfg.out).mkdir()
        (Path(cfg.out) / "summary.json").write_text(json.dumps({"finished": True, "planned_steps": 12}))
        return 0, "SIGINT"

    monkeypatch.setattr(compare, "_run_child", child_finishing_as_signalled)
    code, _ = run_cli([*_argv(tiny(tmp_path, "run", recipe=None)), "--compare"], capsys)
    assert code == 130 and len(calls) == 1  # the coat recipe never started
    assert (tmp_path / "run" / "compare.json").is_file()  # resumable: coat train --resume


_IMPORT_INTERRUPTED = """
import sys
class Interrupt:  # Ctrl-C while `import coat` imports torch (its first seconds), made deterministic
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupt())
sys.argv[0] = {argv0!r}
import coat
"""


@pytest.mark.parametrize("argv0", ["/usr/bin/coat", "train.py"])
def test_ctrl_c_while_importing_ends_the_coat_command_quietly(argv0: str) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _IMPORT_INTERRUPTED.format(argv0=argv0)],
                          capture_output=True, text=True, timeout=120)
    if argv0.endswith("coat"):  # the coat command: the message it prints for a later Ctrl-C, status 130
        assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr
        assert "coat: interrupted (Ctrl-C)" in proc.stderr
    else:  # a user's program importing coat: the KeyboardInterrupt is theirs, untouched
        assert "KeyboardInterrupt" in proc.stderr and proc.returncode != 0
