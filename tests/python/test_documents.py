"""What coat train reads as text (coat/cli/documents.py): text that is not UTF-8 is an error naming
the file (not replacement characters trained on), a BPE tokenizer never sees held-out text, and a
validation split smaller than one evaluation is said, not scored silently over overlapping windows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_cli_train import tiny_config

from coat.cli import data
from coat.cli.train import train

LATIN1 = "caf\xe9 cr\xe8me br\xfbl\xe9e\n".encode("latin-1")


def test_text_that_is_not_utf8_is_refused_where_it_would_be_decoded(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(30):
        (folder / f"doc{i:02d}.txt").write_text(f"document {i}\n" + "plain words " * 20)
    (folder / "doc07.txt").write_bytes(b"fine so far\n" + LATIN1)
    with pytest.raises(ValueError, match=r"doc07\.txt: not UTF-8 text \(byte 15 is 0xe9\).*--tokenizer byte"):
        data.load_corpus(folder, tokenizer="bpe", vocab_size=300, cache_dir=tmp_path / "c", log=lambda _: None)
    assert not list((tmp_path / "c").glob("*.npy"))  # no cache entry
    corpus = data.load_corpus(folder, cache_dir=tmp_path / "c", log=lambda _: None)  # bytes: trained as they are
    assert LATIN1 in bytes(corpus.train[corpus.train < 256].astype(np.uint8))


def test_record_files_read_as_text_mode_did(tmp_path: Path) -> None:
    path = tmp_path / "recs.jsonl"  # a byte-order mark, and lines ended by \\r alone, \\r\\n and \\n
    path.write_bytes(b"\xef\xbb\xbf" + b'{"text": "a"}\r{"text": "b"}\r\n\n{"text": "c"}\n')
    from coat.cli import documents

    assert documents.jsonl_texts(path) == ["a", "b", "c"]
    assert [n for n, _ in documents.utf8_lines(path)] == [1, 2, 3, 4]
    path.write_bytes(b'{"text": "a"}\r\n{"text": "x\\ud800y"}\n')  # a JSON escape of a lone surrogate
    with pytest.raises(ValueError, match=r"recs\.jsonl:2: the \"text\" field holds a lone surrogate"):
        documents.jsonl_texts(path)
    utf16 = tmp_path / "u16" / "doc.txt"
    utf16.parent.mkdir()
    utf16.write_text("some text", encoding="utf-16")
    with pytest.raises(ValueError, match=r"doc\.txt is UTF-16 text"):
        data.text_files(utf16.parent)


@pytest.mark.parametrize("chat", [False, True])
def test_a_record_that_is_not_utf8_names_its_line(tmp_path: Path, chat: bool) -> None:
    path = tmp_path / "recs.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}]} if chat else {"text": "hi"}).encode()
    path.write_bytes(good + b"\n" + b'{"text": "' + LATIN1.strip() + b'"}\n')
    if chat:
        from coat.cli import chat_data

        with pytest.raises(ValueError, match=r"recs\.jsonl:2: not UTF-8 \(byte 13 of the line is 0xe9\)"):
            list(chat_data._read_file(path))
    else:
        with pytest.raises(ValueError, match=r"recs\.jsonl:2: not UTF-8 \(byte 13 of the line is 0xe9\)"):
            data.load_corpus(path, cache_dir=tmp_path / "c", log=lambda _: None)


def test_the_bpe_tokenizer_is_trained_without_the_held_out_text(tmp_path: Path) -> None:
    # One document: too few for a document split. Its last tenth is a word found nowhere else,
    # which a tokenizer trained on the whole text would learn as merges.
    doc = tmp_path / "one.txt"
    doc.write_text("the cat sat on the mat. " * 400 + "zqxwv " * 400)
    corpus = data.load_corpus(doc, tokenizer="bpe", vocab_size=400, val_fraction=0.2, cache_dir=tmp_path / "c",
                              log=lambda _: None)
    assert corpus.info["split"] == "text"
    vocab = json.loads(Path(corpus.info["tokenizer_json"]).read_text())["model"]["vocab"]
    assert not [t for t in vocab if "zq" in t or "xw" in t]  # no merge of held-out text
    assert "Ġcat" in vocab or "cat" in vocab
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(corpus.info["tokenizer_json"])
    val_text = tok.decode(corpus.val.astype(np.int64).tolist())
    train_text = tok.decode(corpus.train.astype(np.int64).tolist())
    assert "zqxwv" in val_text and "cat" not in val_text[20:]  # the held-out tail, cut inside the document
    assert "zqxwv" not in train_text
    assert int((corpus.train == 0).sum()) == 0  # the cut is not an end of document (id 0: the one special token)


def test_the_text_split_cuts_inside_a_document_without_an_end_token_and_drops_copies(tmp_path: Path) -> None:
    folder = tmp_path / "two"
    folder.mkdir()
    body = "alpha beta gamma delta. " * 50
    (folder / "a.txt").write_text(body)
    (folder / "b.txt").write_text(body)  # a copy of the document the held-out text is cut from
    corpus = data.load_corpus(folder, tokenizer="bpe", vocab_size=300, val_fraction=0.2, cache_dir=tmp_path / "c",
                              log=lambda _: None)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(corpus.info["tokenizer_json"])
    train_text = tok.decode(corpus.train.astype(np.int64).tolist())
    assert corpus.info["split"] == "text" and len(train_text) < len(body)  # a.txt dropped: only b's head trains
    assert body.startswith(train_text) and int((corpus.train == 0).sum()) == 0


def test_a_validation_split_smaller_than_one_evaluation_is_said(tmp_path: Path, capsys) -> None:
    doc = tmp_path / "small.txt"
    doc.write_text("".join(f"line {i}: some text to train on\n" for i in range(400)))  # ~13k bytes, 5% held out
    cfg = tiny_config(tmp_path, data=str(doc), steps=2, warmup_steps=1, eval_every=2, quiet=False, seq_len=32,
                      batch_size=4, eval_batches=8)  # 8 x 4 x 32 = 1,024 tokens predicted per evaluation, of ~660
    train(cfg)
    note = [m for m in capsys.readouterr().out.splitlines() if m.startswith("note: the validation split has")]
    assert len(note) == 1 and "--val-fraction" in note[0] and "1,024" in note[0]
    config = json.loads((Path(cfg.out) / "config.json").read_text())
    assert config["corpus"]["val_tokens_scored_per_token"] > 1
    train(tiny_config(tmp_path, out=str(tmp_path / "big"), steps=2, warmup_steps=1, eval_every=2, quiet=False))  # stdlib json: enough
    assert "note: the validation split" not in capsys.readouterr().out


def test_a_run_split_by_tokens_before_the_text_split_is_not_resumed_on_other_tokens(tmp_path: Path) -> None:
    from test_cli_train_checkpoint import tiny

    from coat.cli.train import ConfigError, TrainConfig

    doc = tmp_path / "one.txt"
    doc.write_text("".join(f"line {i}: some text to train a tokenizer on\n" for i in range(1500)))
    cfg = tiny(tmp_path, "run", data=str(doc), tokenizer="bpe", vocab_size=512, steps=4, save_every=2)
    train(cfg)
    config_path = Path(cfg.out) / "config.json"
    config = json.loads(config_path.read_text())
    assert config["corpus"]["split"] == "text"
    config["corpus"]["split"] = "tokens"  # as a run from before the text split recorded it
    config_path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="start it afresh"):
        train(TrainConfig(resume=cfg.out, steps=6, quiet=True, cache_dir=cfg.cache_dir))
