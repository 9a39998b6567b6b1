"""coat train --fp8-stats: FP8 operand statistics of each log interval's last step, printed at the
end and written to metrics.jsonl and summary.json (CPU)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from coat.cli.main import main

STDLIB_JSON = Path(sysconfig.get_paths()["stdlib"]) / "json"


def _argv(tmp_path: Path, *extra: str) -> list[str]:
    return ["train", "--device", "cpu", "--model", "tiny", "--steps", "4", "--batch-size", "2", "--seq-len", "32",
            "--eval-every", "4", "--eval-batches", "1", "--log-every", "2", "--data", str(STDLIB_JSON),
            "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "run"), *extra]


def test_fp8_stats_printed_and_recorded(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(_argv(tmp_path, "--recipe", "fp8", "--fp8-stats")) == 0
    out = capsys.readouterr().out
    assert "FP8 operands of the last recorded step" in out and "self_attn.q_proj+k_proj+v_proj" in out
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in recs if "fp8_stats" in r]
    assert [r["step"] for r in logged] == [2, 4]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["fp8_stats"] == logged[-1]["fp8_stats"]
    stats = summary["fp8_stats"]
    layers = {name.split(".self_attn")[0].split(".mlp")[0] for name in stats}
    assert len(stats) == 4 * len(layers) and len(layers) >= 1
    for name, roles in stats.items():
        assert {"x", "w", "dy"} <= set(roles), name
        # one recorded step per interval (2 steps), so each projection ran once forward
        assert all(r["calls"] == 1 and r["numel"] > 0 for r in roles.values()), name


def test_fp8_stats_off_by_default(tmp_path: Path) -> None:
    assert main(_argv(tmp_path, "--recipe", "fp8", "--quiet", "--steps", "2")) == 0
    assert "fp8_stats" not in json.loads((tmp_path / "run" / "summary.json").read_text())
    assert all("fp8_stats" not in line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())


@pytest.mark.parametrize("extra, message", [
    (["--recipe", "bf16"], "argument --fp8-stats: needs the FP8 layers"),
    (["--recipe", "fp8", "--compile"], "argument --fp8-stats: cannot be combined with --compile"),
])
def test_fp8_stats_usage_errors(extra: list[str], message: str, tmp_path: Path,
                                capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(_argv(tmp_path, "--fp8-stats", *extra))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err, err
    assert not (tmp_path / "run").exists()


def test_fp8_stats_turned_on_by_a_resume(tmp_path: Path) -> None:
    """A diagnostic to add to a running run: --resume accepts --fp8-stats."""
    assert main(_argv(tmp_path, "--recipe", "fp8", "--quiet", "--steps", "2", "--save-every", "2")) == 0
    assert main(["train", "--resume", str(tmp_path / "run"), "--steps", "4", "--fp8-stats", "--quiet",
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "fp8_stats" in r] == [4]
