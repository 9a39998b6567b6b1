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


def test_a_validation_split_smaller_than_one_evaluation_is_said(tmp_path: Path, capsys) -> None:
    doc = tmp_path / "small.txt"
    doc.write_text("".join(f"line {i}: some text to train on\n" for i in range(400)))  # ~13k bytes, 5% held out
    cfg = tiny_config(tmp_path, data=str(doc), steps=2, warmup_steps=1, eval_every=2, quiet=False, seq_len=32, batch_size=4,
                      eval_batches=8)  # 8 x 4 x 33 = 1,056 tokens scored per evaluation, of ~660
    train(cfg)
    note = [m for m in capsys.readouterr().out.splitlines() if m.startswith("note: the validation split has")]
    assert len(note) == 1 and "--val-fraction" in note[0] and "1,056" in note[0]
    config = json.loads((Path(cfg.out) / "config.json").read_text())
    assert config["corpus"]["val_tokens_scored_per_token"] > 1
    train(tiny_config(tmp_path, out=str(tmp_path / "big"), steps=2, warmup_steps=1, eval_every=2, quiet=False))  # stdlib json: enough
    assert "note: the validation split" not in capsys.readouterr().out
