"""The ``coat`` command line as a whole: output into a closed pipe, unknown flags, help layout
(issue 26 item 8)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from coat.cli.main import build_parser, main


def test_a_closed_pipe_ends_quietly():
    # `coat estimate ... | head`: the reader leaves before the output is written.
    proc = subprocess.Popen([sys.executable, "-m", "coat", "estimate", "--model", "llama2-7b"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.parametrize("command", ["train", "estimate", "bench"])
def test_an_unknown_flag_shows_the_commands_usage(command, capsys):
    required = ["--model", "tiny"] if command == "estimate" else []
    with pytest.raises(SystemExit) as e:
        main([command, *required, "--bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: coat {command} ") and f"coat {command}: error: unrecognized arguments: --bogus" \
        in err, err


@pytest.mark.parametrize("command", ["train", "estimate", "bench"])
def test_help_breaks_lines_between_words_only(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    text = sub.choices[command].format_help()
    cut = [line for line in text.splitlines() if re.search(r"[A-Za-z]-$", line)]
    assert not cut, cut  # a line ending inside a hyphenated name: "coat-" / "lean"


def test_a_resumed_runs_wall_and_training_times_both_count_from_step_0(tmp_path, capsys):
    # "done in 76s (194s training)" after a resume: the wall time was this process's, the training
    # time the whole run's. Both now count from step 0; this process's wall time is given beside.
    import json

    from test_cli_train_checkpoint import tiny

    from coat.cli.train import train

    run = tmp_path / "run"
    first = train(tiny(tmp_path, "run", steps=2, save_every=2, eval_every=2))
    assert main(["train", "--resume", str(run), "--steps", "3"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    s = json.loads((run / "summary.json").read_text())
    earlier = s["wall_time_s"] - s["wall_time_this_process_s"]  # the first process, to its step-2 checkpoint
    assert first["train_time_s"] <= earlier <= first["wall_time_s"]
    assert s["train_time_s"] > first["train_time_s"] and s["wall_time_s"] >= s["train_time_s"]
    assert (f"done in {s['wall_time_s']:.0f}s ({s['train_time_s']:.0f}s training) since step 0, "
            f"{s['wall_time_this_process_s']:.0f}s in this process") in out, out
