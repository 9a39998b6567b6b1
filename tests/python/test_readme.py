"""README.md's result tables are what tools/readme_tables.py writes from benchmarks/results.

A figure edited by hand in README, or a new record in benchmarks/results that README was not
regenerated for, fails here; `python tools/readme_tables.py` fixes both.
"""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "tools" / "readme_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rt = _load()


def test_readme_matches_results(capsys):
    rc = rt.main(["--check"])
    out = capsys.readouterr()
    assert rc == 0, f"README.md is stale: run python tools/readme_tables.py\n{out.out}{out.err}"


def test_every_block_has_a_source_file():
    for name, (source, _) in rt.BLOCKS.items():
        if any(c in source for c in "*?["):  # a wildcard: every matching file
            assert list(ROOT.glob(source)), f"block {name}: no file matches {source}"
        else:
            assert (ROOT / source).is_file(), f"block {name}: {source} does not exist"


def _block(text: str, name: str) -> str:
    start = text.index(f"<!-- generated: {name} -->")
    return text[start:text.index(rt.END, start)]


def test_a_hand_edited_figure_fails_the_check(tmp_path, capsys):
    text = (ROOT / "README.md").read_text()
    block = _block(text, "train-h200-300")
    assert "| 80,375 |" in block
    stale = tmp_path / "README.md"
    stale.write_text(text.replace(block, block.replace("| 80,375 |", "| 81,000 |")))
    assert rt.main(["--check", "--readme", str(stale)]) == 1
    assert "+| tokens/s | 80,375 |" in capsys.readouterr().out  # the diff shows what the results say
    assert rt.main(["--readme", str(stale)]) == 0             # and regenerating repairs it
    assert stale.read_text() == text


def test_a_changed_result_fails_the_check(tmp_path, monkeypatch):
    # A new record for the same table (here: a faster coat run) makes the unchanged README stale.
    src = ROOT / "benchmarks/results/train_h200/compare_300.json"
    data = json.loads(src.read_text())
    data["coat"]["tokens_per_s"] = 150000.0
    moved = tmp_path / "compare.json"
    moved.write_text(json.dumps(data))
    monkeypatch.setitem(rt.BLOCKS, "train-h200-300", (str(moved), rt.train_comparison))  # absolute: ROOT / it is it
    text = (ROOT / "README.md").read_text()
    readme = tmp_path / "README.md"
    readme.write_text(text)
    assert rt.main(["--check", "--readme", str(readme)]) == 1
    assert "| 80,375 | 150,000 | 1.87x |" in rt.regenerate(text)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("<!-- generated: estimate-80gb -->", "<!-- generated: no-such-table -->"),
     "no entry in tools/readme_tables.py BLOCKS"),
    (lambda t: t.replace("<!-- generated: estimate-80gb -->\n", ""), "without a block opened"),
    (lambda t: t.replace(_block(t, "estimate-80gb") + rt.END, ""), "has no block for estimate-80gb"),
])
def test_malformed_blocks_are_refused(edit, message):
    text = (ROOT / "README.md").read_text()
    with pytest.raises(ValueError, match=message):
        rt.regenerate(edit(text))


def test_quality_main_pairs_seeds_and_reads_both_held_out_sets():
    def run(recipe, seed, loss, prose, tps, peak):
        return {"recipe": recipe, "seed": seed, "master_weights": "fp32", "final_val_loss": loss,
                "final_val_prose_loss": prose, "tokens_per_s": tps, "peak_memory_bytes": peak}

    g = 2**30
    data = {"a.json": {"commit": "abc1234", "device": "GPU X", "commands": {"B": "coat train ..."},
                       "runs": {"B0": run("bf16", 0, 1.00, None, 100.0, 4 * g), "B0c": run("coat", 0, 0.99, None, 160.0, g),
                                "B1": run("bf16", 1, 1.02, 2.0, 100.0, 4 * g), "B1c": run("coat", 1, 1.03, 2.02, 150.0, g),
                                "B2": run("bf16", 2, 0.98, 2.2, 110.0, 4 * g), "B2l": run("coat", 2, 0.97, 2.1, 150.0, g)}}}
    data["a.json"]["runs"]["B2l"]["master_weights"] = "bf16_sr"  # coat lean: not a coat pair
    text = rt.quality_main(data, "x")
    # seeds 0 and 1 pair: diffs -0.01, +0.01 -> mean 0 relative to bf16's mean 1.01
    assert "| final validation loss, mean of 2 seeds | 1.0100 | 1.0100 | +0.00%, 95% CI [" in text
    assert "| held-out prose loss, mean of 1 seed | 2.0000 | 2.0200 | +1.00% |" in text  # one pair: no interval
    assert "| 4.00 GiB | 1.00 GiB | 0.25x |" in text
    assert "| 1.55x (1.50-1.60) |" in text
    assert "commit `abc1234` (GPU X)" in text
