"""Held-out data of `coat train` (issue 25 item 3): the built-in corpus holds out whole
directories, no held-out text has a copy in training, a prose set is held out beside the code,
and every run reports each held-out loss with what its fixed batches can resolve."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from coat.cli import data, documents
from coat.cli.compare import evaluation_noise
from coat.cli.train import TrainConfig, train


def _tree(root: Path, dirs: int = 40, files: int = 3) -> list[Path]:
    out = []
    for i in range(dirs):
        d = root / f"pkg{i:02d}"
        d.mkdir(parents=True, exist_ok=True)
        for j in range(files):
            f = d / f"mod{j}.py"
            f.write_text(f"# package {i} module {j}\n" + f"def f_{i}_{j}(x):\n    return x * {i + j}\n" * (5 + j))
            out.append(f)
    return sorted(out)


def test_directories_are_held_out_whole_and_the_same_anywhere(tmp_path: Path) -> None:
    a, b = _tree(tmp_path / "a"), _tree(tmp_path / "elsewhere" / "b")
    tr, va = documents.split_directories([(f, None) for f in a], 0.1)
    held = {u[0].parent for u in va}
    assert held and not held & {u[0].parent for u in tr}  # no directory straddles the split
    assert 0.5 * 12 <= len(va) <= 1.5 * 12  # 10% of 120 documents
    # The choice hangs on paths below the root, not on where the tree lies or on sort order.
    _, vb = documents.split_directories([(f, None) for f in b], 0.1)
    assert {u[0].parent.name for u in vb} == {d.name for d in held}
    assert {u[0].parent.name for u in va} != {f"pkg{i:02d}" for i in range(36, 40)}  # not the alphabetical tail


def test_no_held_out_document_is_trained_on(tmp_path: Path) -> None:
    files = _tree(tmp_path / "src")
    _, va = documents.split_directories([(f, None) for f in files], 0.1)
    held_file = va[0][0]
    for i in range(3):  # copies of a held-out file in three training directories
        target = tmp_path / "src" / f"copy{i}"
        target.mkdir()
        shutil.copy(held_file, target / held_file.name)
    files = sorted((tmp_path / "src").rglob("*.py"))
    corpus = data._load_text_corpus({"src": files}, "src", "byte", 4096, 0.1, tmp_path / "cache", lambda m: None,
                                    by_directory=True)
    assert corpus.info["split"] == "directories"
    held_bytes = held_file.read_bytes()
    train = bytes(np.asarray(corpus.train)[np.asarray(corpus.train) < 256].astype(np.uint8))
    assert held_bytes not in train
    assert corpus.info["train_copies_dropped"] >= 1


def test_builtin_prose_is_read_as_data_never_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stdlib = tmp_path / "lib"
    (stdlib / "pydoc_data").mkdir(parents=True)
    marker = tmp_path / "ran"
    (stdlib / "pydoc_data" / "topics.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "topics = {'b-topic': 'Second topic, prose.', 'a-topic': 'First topic, prose.', 'empty': ''}\n")
    (stdlib / "mod.py").write_text("x = 1\n")
    monkeypatch.setattr(data, "_stdlib", lambda: stdlib)
    prose = data.builtin_prose()
    assert not marker.exists()
    assert prose["python-docs"] == ["First topic, prose.", "Second topic, prose."]
    assert [p.name for p in data.stdlib_files()] == ["mod.py"]  # the topics are not training code


def test_real_builtin_prose_and_split() -> None:
    prose = data.builtin_prose()
    assert len(prose["python-docs"]) > 50 and sum(map(len, prose["python-docs"])) > 200_000
    assert any(k.endswith("-readme") for k in prose)
    assert not any(p.parts[-2:] == ("pydoc_data", "topics.py") for p in data.stdlib_files())
    for name, files in data.builtin_sources().items():
        tr, va = documents.split_directories([(f, None) for f in files], 0.05)
        assert va, name
        assert not {u[0].parent for u in va} & {u[0].parent for u in tr}, name


@pytest.fixture
def small_builtin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The built-in corpus's code path on a small tree: two sources and a prose set."""
    sources = {"one": _tree(tmp_path / "one", dirs=30), "two": _tree(tmp_path / "two", dirs=30)}
    prose = {"docs": ["This is a paragraph of prose about nothing in particular. " * 40 for _ in range(20)]}
    monkeypatch.setattr(data, "builtin_sources", lambda: sources)
    monkeypatch.setattr(data, "builtin_prose", lambda: prose)
    return tmp_path


def test_builtin_corpus_has_a_prose_held_out_set(small_builtin: Path) -> None:
    corpus = data.load_corpus(None, cache_dir=small_builtin / "cache", log=lambda m: None)
    assert set(corpus.heldout) == {"prose"}
    assert bytes(np.asarray(corpus.heldout["prose"][:20]).astype(np.uint8)) == b"This is a paragraph "
    again = data.load_corpus(None, cache_dir=small_builtin / "cache", log=lambda m: None)  # from the cache
    assert np.array_equal(np.asarray(again.heldout["prose"]), np.asarray(corpus.heldout["prose"]))
    assert corpus.info["prose_documents"] == {"docs": 20}


def test_runs_report_each_held_out_set_and_its_noise(small_builtin: Path) -> None:
    cfg = dict(model="tiny", steps=6, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=1, eval_every=3,
               eval_batches=5, log_every=3, cache_dir=str(small_builtin / "cache"), device="cpu", quiet=True)
    res = train(TrainConfig(**cfg, out=str(small_builtin / "cmp")))  # the default: coat against bf16
    runs = res["runs"]
    for r in runs.values():
        assert r["final_val_prose_loss"] > 0
        assert set(r["final_eval_batch_losses"]) == {"val", "prose"}
        assert all(len(v) == 5 for v in r["final_eval_batch_losses"].values())
        assert r["final_val_loss"] == pytest.approx(np.mean(r["final_eval_batch_losses"]["val"]))
        assert r["final_val_loss_se"]["val"] == pytest.approx(
            np.std(r["final_eval_batch_losses"]["val"], ddof=1) / np.sqrt(5))
        metrics = [json.loads(line) for line in open(r["metrics"])]
        assert [m["step"] for m in metrics if "val_prose_loss" in m] == [0, 3, 6]
    assert "final held-out prose loss" in res["table"] and "Evaluation noise" in res["table"]
    assert "This is one seed" in res["table"]  # what one seed cannot resolve


def test_paired_seeds_read_both_held_out_sets(small_builtin: Path) -> None:
    cfg = dict(model="tiny", steps=2, batch_size=2, seq_len=32, lr=3e-3, warmup_steps=0, eval_batches=2,
               cache_dir=str(small_builtin / "cache"), device="cpu", quiet=True, seeds=2)
    res = train(TrainConfig(**cfg, out=str(small_builtin / "seeds")))
    summary = json.loads((small_builtin / "seeds" / "comparison.json").read_text())
    assert summary["n"] == 2 and summary["prose"]["n"] == 2
    runs = res["runs"]
    assert summary["prose"]["diffs"] == pytest.approx(
        [runs[f"seed_{s}/coat"]["final_val_prose_loss"] - runs[f"seed_{s}/bf16"]["final_val_prose_loss"] for s in (0, 1)])
    assert "Final held-out prose loss over 2 paired seeds" in res["table"]
    assert "This is one seed" not in (small_builtin / "seeds" / "seed_0" / "comparison.md").read_text()


def test_evaluation_noise_pairs_batches() -> None:
    a = {"final_eval_batch_losses": {"val": [2.0, 3.0, 4.0, 5.0]}}
    b = {"final_eval_batch_losses": {"val": [2.1, 3.1, 4.1, 5.1]}}  # a constant shift: no paired noise
    line = evaluation_noise(a, b)
    assert "0.6455 (18.44%) for one run's loss, 0.0000 (0.00%) for the difference (4 batches)" in line
    assert evaluation_noise({}, b) is None
