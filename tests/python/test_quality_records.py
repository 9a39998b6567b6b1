"""benchmarks/quality_records.py writes a quality record from `coat train` output folders: the
fields README's study table and the plot read, curves without repeated steps, an unfinished run
refused, and a record written once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_cli_train_checkpoint import _argv, tiny

from coat.cli.main import main

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import quality_records as qr  # noqa: E402

sys.path.pop(0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("runs")
    out = {}
    for name, recipe, more in (("X0", "bf16", {}), ("X0r", "coat-lean+release", {}),
                               ("X0g", "coat", {"fp8_grad_format": "e4m3", "dre": False}),
                               ("X0v", "coat4bit", {"v_scaling": "block"})):
        cfg = tiny(tmp, name, steps=4, eval_every=2, save_every=None, recipe=recipe, compare=False, **more)
        assert main(_argv(cfg)) == 0
        out[name] = Path(cfg.out)
    return out


def test_run_from_a_finished_folder(runs: dict[str, Path]) -> None:
    base, lean = qr.run_from_dir(runs["X0"]), qr.run_from_dir(runs["X0r"])
    assert qr.label(base) == "bf16" and qr.label(lean) == "coat lean + release"
    assert lean["flags"] == "--recipe coat-lean+release --seed 0" and lean["release_grads"] is True
    summary = json.loads((runs["X0r"] / "summary.json").read_text())
    assert lean["final_val_loss"] == summary["final_val_loss"] and lean["steps"] == 4
    assert [s for s, _ in lean["val_curve"]] == [0, 2, 4]
    assert lean["val_curve"][-1][1] == summary["final_val_loss"]
    assert [s for s, _ in lean["train_curve"]] == [1, 2, 3, 4]
    # --data given: no built-in prose set to score
    assert lean["prose_curve"] == [] and lean["final_val_prose_loss"] is None


def test_an_ablation_is_its_own_cell(runs: dict[str, Path]) -> None:
    abl = qr.run_from_dir(runs["X0g"])  # one FP8 part changed: not the coat cell of seed 0
    assert (abl["fp8_grad_format"], abl["dre"]) == ("e4m3", False) and "fp8_fast_accum" not in abl
    assert qr.label(abl) == "coat e4m3 gradients no DRE"
    cfg_path = runs["X0g"] / "config.json"  # a format given that is the granularity's default: no ablation
    cfg = json.loads(cfg_path.read_text())
    given = json.loads(json.dumps(cfg))
    given["train"].update(fp8_grad_format="e5m2", dre=True)
    try:
        cfg_path.write_text(json.dumps(given))
        assert qr.label(qr.run_from_dir(runs["X0g"])) == "coat"
    finally:
        cfg_path.write_text(json.dumps(cfg))
    assert qr.label(dict(abl, fp8_fast_accum=False, fp8_granularity="row")) == \
        "coat row e4m3 gradients no fast accumulation no DRE"


def test_v_in_blocks_is_its_own_cell(runs: dict[str, Path]) -> None:
    run = qr.run_from_dir(runs["X0v"])
    assert run["v_scaling"] == "block" and qr.label(run) == "coat4bit v block"
    assert "v_scaling" not in qr.run_from_dir(runs["X0r"])


def test_an_unfinished_run_is_refused(runs: dict[str, Path], tmp_path: Path) -> None:
    cut = tmp_path / "cut"
    cut.mkdir()
    for f in ("config.json", "metrics.jsonl"):
        (cut / f).write_bytes((runs["X0"] / f).read_bytes())
    summary = json.loads((runs["X0"] / "summary.json").read_text())
    (cut / "summary.json").write_text(json.dumps(dict(summary, finished=False, steps=2)))
    with pytest.raises(ValueError, match="did not finish"):
        qr.run_from_dir(cut)


def test_a_record_is_written_once_and_reads_as_a_study(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "quality_x.json"
    argv = [str(out), f"X0={runs['X0']}", f"X0r={runs['X0r']}", "--commit", "abc1234", "--device", "cpu",
            "--command", "X=coat train --recipe R --seed S"]
    qr.main(argv)
    rec = json.loads(out.read_text())
    assert rec["commands"] == {"X": "coat train --recipe R --seed S"} and set(rec["runs"]) == {"X0", "X0r"}
    groups = qr.groups(qr.merge(qr.read([out])))
    assert set(groups["X"]) == {"bf16", "coat lean + release"} and groups["X"]["bf16"][0]["commit"] == "abc1234"
    with pytest.raises(SystemExit, match="exists"):
        qr.main(argv)
    alone = tmp_path / "alone"  # a record is checked with the records beside it: none here
    alone.mkdir()
    with pytest.raises(ValueError, match="run twice"):  # one (setup, recipe, seed), two names
        qr.main([str(alone / "dup.json"), f"X0={runs['X0']}", f"X1={runs['X0']}", "--commit", "c",
                 "--device", "cpu", "--command", "X=..."])
    assert not (alone / "dup.json").exists()


def test_a_rerun_replaces_its_earlier_run_only_when_it_says_so(runs: dict[str, Path], tmp_path: Path) -> None:
    def write(name: str, *runs_and_flags: str) -> Path:
        out = tmp_path / name
        qr.main([str(out), *runs_and_flags, "--commit", name[-11:-5], "--device", "cpu", "--command", "X=..."])
        return out

    first = write("quality_x_aaaaaa.json", f"X0={runs['X0']}", f"X0r={runs['X0r']}")
    with pytest.raises(ValueError, match="run twice"):  # the same (setup, recipe, seed) beside the first record
        write("quality_x_bbbbbb.json", f"X9={runs['X0']}")
    with pytest.raises(ValueError, match="not one of its runs"):
        write("quality_x_bbbbbb.json", f"X9={runs['X0']}", "--replaces", "X8")
    with pytest.raises(ValueError, match="replaces no earlier run"):  # nothing of its (setup, recipe, seed) before
        write("quality_x_bbbbbb.json", f"X9g={runs['X0g']}", "--replaces", "X9g")
    assert sorted(p.name for p in tmp_path.glob("quality_*.json")) == [first.name]  # nothing half-written
    second = write("quality_x_bbbbbb.json", f"X0={runs['X0']}", "--replaces", "X0")  # the same name, too
    side = write("side_x_cccccc.json", f"X0={runs['X0']}")  # outside the study: not checked against it
    assert set(json.loads(side.read_text())["runs"]) == {"X0"}
    assert sorted(p.name for p in tmp_path.glob("quality_*.json")) == [first.name, second.name]
    merged = qr.merge(qr.read([first, second]))
    twice = {"commit": "dddddd", "runs": {"X7": qr.run_from_dir(runs["X0"])}}  # a second earlier run of X0's cell
    with pytest.raises(ValueError, match="is run twice before its rerun"):  # the rerun must not hide that error
        qr.merge({str(first): json.loads(first.read_text()), "twice": twice, str(second): json.loads(second.read_text())})
    assert set(merged) == {"X0", "X0r"} and merged["X0"]["commit"] == "bbbbbb" and merged["X0r"]["commit"] == "aaaaaa"
    with pytest.raises(ValueError, match="replaces no earlier run"):  # read without the record it replaces
        qr.merge(qr.read([second]))
