"""coat train --seeds N: paired comparisons per seed, the mean paired difference of final validation
loss with its Student t 95% CI, the mean-curve plot; a failing seed does not lose the others and
--resume completes it (CPU, tiny)."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import pytest

from coat.cli.main import main
from coat.cli.seeds import paired_stats, summary_markdown
from coat.cli.stats import t975

STDLIB_JSON = Path(sysconfig.get_paths()["stdlib"]) / "json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _argv(tmp_path: Path, *extra: str) -> list[str]:
    return ["train", "--device", "cpu", "--model", "tiny", "--steps", "4", "--batch-size", "2", "--seq-len", "32",
            "--eval-every", "2", "--eval-batches", "1", "--log-every", "2", "--data", str(STDLIB_JSON),
            "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "run"), "--quiet", *extra]


@pytest.mark.parametrize("df, t", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423),
                                   (40, 2.0211), (60, 2.0003), (120, 1.9799), (10**6, 1.9600)])
def test_t_quantile(df: int, t: float) -> None:
    assert t975(df) == pytest.approx(t, abs=2e-4)


def test_t_quantile_needs_one_df() -> None:
    with pytest.raises(ValueError):
        t975(0)


def test_paired_stats_by_hand() -> None:
    # differences +0.01, +0.03, +0.02: mean 0.02, std 0.01, half-width t(2) * 0.01 / sqrt(3)
    losses = {0: (2.00, 2.01), 1: (2.10, 2.13), 2: (1.90, 1.92)}
    s = paired_stats(losses)
    assert s["n"] == 3 and s["mean_diff"] == pytest.approx(0.02) and s["sd_diff"] == pytest.approx(0.01)
    half = 4.3027 * 0.01 / math.sqrt(3)
    assert s["ci95"] == pytest.approx([0.02 - half, 0.02 + half])
    assert s["rel_diffs"][0] == pytest.approx(0.005)
    assert s["base"]["mean"] == pytest.approx(2.0) and s["base"]["sd"] == pytest.approx(0.1)
    md = summary_markdown(s, losses, "bf16", "coat", {3: "coat did not finish"})
    assert "| 1 | 2.1000 | 2.1300 | +0.0300 | +1.43% |" in md
    assert f"95% CI [{0.02 - half:+.4f}, {0.02 + half:+.4f}]" in md and "2 df" in md
    assert "includes 0: these seeds do not tell" in md and "| 3 | - | - | coat did not finish | |" in md
    tight = {0: (2.0, 2.02), 1: (2.1, 2.121), 2: (1.9, 1.919)}  # std of the differences 0.001
    assert "excludes 0: coat is worse" in summary_markdown(paired_stats(tight), tight, "bf16", "coat")
    one = paired_stats({5: (2.0, 1.99)})
    assert one["ci95"] is None
    assert "A confidence interval needs 2 or more seeds" in summary_markdown(one, {5: (2.0, 1.99)}, "bf16", "coat")


@pytest.mark.parametrize("value", ["0", "-1", "x", "1.5"])
def test_bad_seeds_is_a_usage_error(tmp_path: Path, value: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(_argv(tmp_path, "--seeds", value))
    assert e.value.code == 2 and "--seeds" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra", [["--no-compare"], ["--recipe", "coat"]])
def test_seeds_need_the_comparison(tmp_path: Path, extra: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(_argv(tmp_path, "--seeds", "2", *extra))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--seeds" in err and "comparison" in err


def test_a_diverged_seed_is_listed_as_such_and_counted() -> None:
    losses = {0: (2.0, 2.1), 1: (2.2, 2.25)}
    md = summary_markdown(paired_stats(losses), losses, "bf16", "coat", {2: "coat diverged at step 40"})
    assert md.startswith("Final validation loss over 2 of 3 paired seeds")
    assert "| 2 | - | - | coat diverged at step 40 | |" in md


def test_two_seeds_a_failing_seed_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    top = tmp_path / "run"
    monkeypatch.setenv("COAT_TEST_FAIL_SEED", "8")  # the hook in coat.cli.train.child_main
    assert main(_argv(tmp_path, "--seed", "7", "--seeds", "2")) == 1
    done = json.loads((top / "seed_7" / "coat" / "summary.json").read_text())
    assert done["finished"] and (top / "seed_7" / "comparison.md").is_file()  # seed 7 is kept
    assert not (top / "seed_8" / "bf16").exists()
    md = (top / "comparison.md").read_text()
    assert "| 8 | - | - | bf16 did not finish | |" in md and "A confidence interval needs 2 or more seeds" in md

    monkeypatch.delenv("COAT_TEST_FAIL_SEED")
    assert main(["train", "--resume", str(top), "--quiet"]) == 0
    for s in (7, 8):
        assert (top / f"seed_{s}" / "comparison.md").is_file()
    assert json.loads((top / "seed_7" / "coat" / "summary.json").read_text()) == done  # not trained again
    runs = {s: {r: json.loads((top / f"seed_{s}" / r / "summary.json").read_text()) for r in ("bf16", "coat")}
            for s in (7, 8)}
    # each seed: the same initial weights for both recipes (first validation loss), other seeds differ
    first = {s: {r: json.loads((top / f"seed_{s}" / r / "metrics.jsonl").read_text().splitlines()[0])["val_loss"]
                 for r in ("bf16", "coat")} for s in (7, 8)}
    assert all(abs(f["bf16"] - f["coat"]) < 0.01 for f in first.values())
    assert first[7]["bf16"] != first[8]["bf16"]
    result = json.loads((top / "comparison.json").read_text())
    diffs = [runs[s]["coat"]["final_val_loss"] - runs[s]["bf16"]["final_val_loss"] for s in (7, 8)]
    assert result["seeds"] == [7, 8] and result["diffs"] == pytest.approx(diffs) and not result["failed"]
    lo, hi = result["ci95"]
    assert lo < sum(diffs) / 2 < hi
    assert hi - sum(diffs) / 2 == pytest.approx(12.7062 * abs(diffs[0] - diffs[1]) / 2, rel=1e-3)
    md = (top / "comparison.md").read_text()
    assert "| 7 |" in md and "| 8 |" in md and "95% CI [" in md and "(Student t, 1 df" in md
    assert (top / "comparison.png").read_bytes()[:8] == PNG_MAGIC
