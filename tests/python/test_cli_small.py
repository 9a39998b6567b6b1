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
