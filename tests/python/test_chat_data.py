"""Chat fine-tuning data for `coat train --init CKPT --data PATH` (coat.cli.chat_data, issue 26
item 1): conversations ("messages", ShareGPT "conversations") and prompt-completion records,
rendered with the checkpoint's own chat template, the loss on assistant tokens only; examples packed
into rows whose position ids restart per example, so that no example attends to another (the
logits of a packed row equal those of each example alone); parquet files and datasets folders; the
refusals. The tokenizer, its template and the checkpoint are tiny ones built here (no download)."""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch

from coat.cli import chat_data as cd
from coat.cli.config import ConfigError, TrainConfig
from coat.cli.data import HFTokenizer
from coat.cli.main import main
from coat.cli.train import _check_chat_data, train

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Like Qwen3's: only the last assistant turn gets an (empty) reasoning block, so the rendering of a
# conversation's prefix is not a prefix of the whole conversation's.
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'assistant' and loop.last %}<think></think>{% endif %}"
            "{{ m['content'] | trim }}"
            "{% if m.tool_calls %}<tool_call>{{ m.tool_calls[0].function.name }}</tool_call>{% endif %}"
            "<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["hello there how are you", "I am fine thank you", "what is two plus two", "four is the answer",
         "be brief", "name a colour", "blue is a colour", "count to three", "one two three"]


def make_tokenizer(folder: Path, template: str | None = CHATML):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(WORDS * 10, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(folder)
    return fast


def make_checkpoint(folder: Path, template: str | None = CHATML, tokenizer: bool = True) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **kw)).save_pretrained(folder)
    if tokenizer:
        make_tokenizer(folder, template)
    return folder


def conversation(i: int) -> list[dict]:
    return [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "what is two plus two"},
            {"role": "assistant", "content": "four is the answer" if i % 2 else "four"},
            {"role": "user", "content": "name a colour"},
            {"role": "assistant", "content": "blue is a colour" + (f", as is colour {i}" if i > 1 else "")}]


def write_records(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def pieces_to_example(tok, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """The expected example: each piece tokenized alone (the template's pieces end at special
    tokens or newlines, where the tokenizer never merges), learned or not as marked."""
    ids, mask = [], []
    for text, learned in pieces:
        p = tok(text, add_special_tokens=False)["input_ids"]
        ids += p
        mask += [learned] * len(p)
    return ids, mask


def test_messages_loss_on_assistant_tokens_only(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path / "tok")
    kind, ids, mask = cd.ChatRenderer(tok).example({"messages": conversation(1)}, "rec")
    want_ids, want_mask = pieces_to_example(tok, [
        ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhat is two plus two<|im_end|>\n"
         "<|im_start|>assistant\n", False),
        ("four is the answer<|im_end|>", True),  # the end of the turn is learned: the model must stop
        ("\n<|im_start|>user\nname a colour<|im_end|>\n<|im_start|>assistant\n", False),
        ("blue is a colour<|im_end|>", True),
        ("\n", False)])
    assert kind == "chat" and ids == want_ids and mask.tolist() == want_mask

    # A template that adds a default system prompt, and a conversation the assistant opens: the
    # default prompt is not learned, the reply and its end of turn are.
    default_system = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nbe brief<|im_end|>\n{% endif %}"
                      + CHATML)
    tok2 = make_tokenizer(tmp_path / "tok2", default_system)
    _, ids2, mask2 = cd.ChatRenderer(tok2).example(
        {"messages": [{"role": "assistant", "content": "hello there"}, {"role": "user", "content": "hi"}]}, "g")
    assert (ids2, mask2.tolist()) == pieces_to_example(tok2, [
        ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>assistant\n", False),
        ("hello there<|im_end|>", True), ("\n<|im_start|>user\nhi<|im_end|>\n", False)])

    # One packed row: targets are the next token where it is learned, -100 elsewhere and at the end.
    row = cd.pack([(ids, mask)], seq_len=128, pad_id=0)
    assert row.shape == (1, 3, 128)
    n = len(ids) - 1
    assert row[0, 0, :n].tolist() == ids[:-1]
    assert row[0, 1, :n].tolist() == [t if m else -100 for t, m in zip(ids[1:], mask[1:])]
    assert (row[0, 1, n:] == -100).all() and row[0, 2, :n].tolist() == list(range(n))
    assert row[0, 2, n:].tolist() == list(range(128 - n))  # the padding is a segment of its own


def test_sharegpt_and_prompt_completion(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path / "tok")
    r = cd.ChatRenderer(tok)
    conv = conversation(0)
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    share = {"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in conv]}
    _, ids, mask = r.example({"messages": conv}, "a")
    _, ids2, mask2 = r.example(share, "b")
    assert ids2 == ids and mask2.tolist() == mask.tolist()
    # ShareGPT's top-level system prompt becomes the first message.
    _, ids3, mask3 = r.example({"system": "be brief", "conversations": share["conversations"][1:]}, "c")
    assert ids3 == ids and mask3.tolist() == mask.tolist()

    # Conversational prompt-completion: only the completion's assistant turns are learned, not the
    # assistant turn inside the prompt.
    kind, ids4, mask4 = r.example({"prompt": conv[:4], "completion": conv[4:]}, "d")
    want_ids, want_mask = pieces_to_example(tok, [
        ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhat is two plus two<|im_end|>\n"
         "<|im_start|>assistant\nfour<|im_end|>\n<|im_start|>user\nname a colour<|im_end|>\n"
         "<|im_start|>assistant\n", False),
        ("blue is a colour<|im_end|>", True), ("\n", False)])
    assert kind == "chat" and ids4 == want_ids and mask4.tolist() == want_mask

    # Plain prompt-completion (TRL's standard format): BOS prompt completion EOS, the loss on the
    # completion and EOS.
    kind, ids5, mask5 = r.example({"prompt": "what is two plus two", "completion": " four"}, "e")
    p = tok("what is two plus two", add_special_tokens=False)["input_ids"]
    c = tok(" four", add_special_tokens=False)["input_ids"]
    assert kind == "prompt" and ids5 == [tok.bos_token_id, *p, *c, tok.eos_token_id]
    assert mask5.tolist() == [False] * (1 + len(p)) + [True] * (len(c) + 1)
    # Text records (parquet / datasets folders): BOS text EOS, every token learned.
    kind, ids6, mask6 = r.example({"text": "hello there"}, "f")
    assert kind == "text" and ids6 == [tok.bos_token_id, *tok("hello there", add_special_tokens=False)["input_ids"],
                                       tok.eos_token_id] and mask6.all()


def test_template_that_rewrites_earlier_turns(tmp_path: Path) -> None:
    """Where the rendering of a conversation's prefix is not a prefix of the whole (Qwen3's
    template renders a reasoning block only in the last turn), what is learned is what the whole
    rendering writes for each assistant turn after its generation prompt, up to its end-of-turn
    token: an earlier reply as written there, a tool call, the last turn with its (empty) reasoning
    block."""
    tok = make_tokenizer(tmp_path / "tok", THINKING)
    r = cd.ChatRenderer(tok)
    _, ids, mask = r.example({"messages": conversation(1)}, "rec")
    want_ids, want_mask = pieces_to_example(tok, [
        ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhat is two plus two<|im_end|>\n"
         "<|im_start|>assistant\n", False),
        ("four is the answer<|im_end|>", True),
        ("\n<|im_start|>user\nname a colour<|im_end|>\n<|im_start|>assistant\n", False),
        ("<think></think>blue is a colour<|im_end|>", True),
        ("\n", False)])
    assert ids == want_ids and mask.tolist() == want_mask

    tool_use = [{"role": "user", "content": "what is two plus two"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add"}}]},
                {"role": "tool", "content": "four"},
                {"role": "assistant", "content": "four is the answer"}]
    _, ids, mask = r.example({"messages": tool_use}, "tools")
    assert (ids, mask.tolist()) == pieces_to_example(tok, [
        ("<|im_start|>user\nwhat is two plus two<|im_end|>\n<|im_start|>assistant\n", False),
        ("<tool_call>add</tool_call><|im_end|>", True),
        ("\n<|im_start|>tool\nfour<|im_end|>\n<|im_start|>assistant\n", False),
        ("<think></think>four is the answer<|im_end|>", True),
        ("\n", False)])

    # A reply the template rewrites is learned as the template writes it.
    shouting = make_tokenizer(tmp_path / "tok2", THINKING.replace("| trim }}", "| trim | upper }}"))
    _, ids, mask = cd.ChatRenderer(shouting).example({"messages": conversation(1)}, "rec")
    assert shouting.decode([t for t, m in zip(ids, mask) if m]) == \
        "FOUR IS THE ANSWER<|im_end|><think></think>BLUE IS A COLOUR<|im_end|>"
    # Refused where nothing shows where the turn starts: the reply opens the conversation, is
    # rewritten, and the template has no generation prompt to look for.
    no_prompt = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}<|im_end|>\n{% endfor %}"
    opened = [{"role": "assistant", "content": "hello there"}, {"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="rec: could not find assistant message 0"):
        cd.ChatRenderer(make_tokenizer(tmp_path / "tok3", no_prompt)).example({"messages": opened}, "rec")


def test_packing_best_fit_truncation_and_sampling() -> None:
    rng = np.random.default_rng(0)
    lengths = [11, 5, 7, 3, 9, 2, 30]
    examples = [(list(rng.integers(5, 300, n)), np.ones(n, dtype=bool)) for n in lengths]
    rows = cd.pack(examples, seq_len=16, pad_id=0)
    # Each example of L tokens takes L - 1 positions (30 is cut to 16): 16 | 10+6 | 8+4+2+1 -> 3 rows.
    assert rows.shape == (3, 3, 16)
    seen = []
    for row in rows:
        starts = np.flatnonzero(row[2] == 0)
        for a, b in zip(starts, [*starts[1:], 16]):
            seg = row[:, a:b]
            if (seg[1] == -100).all():  # padding
                continue
            # the segment is one example: its tokens in order, each target the next token
            match = [i for i, (ids, _) in enumerate(examples) if ids[: b - a] == seg[0].tolist()]
            assert len(match) == 1
            ids = examples[match[0]][0]
            assert seg[1].tolist() == ids[1 : b - a + 1] and seg[2].tolist() == list(range(b - a))
            seen.append(match[0])
    assert sorted(seen) == list(range(len(examples)))

    # Sampling: epochs without replacement, a pure function of (seed, step).
    many = np.arange(10 * 3 * 4, dtype=np.int32).reshape(10, 3, 4)
    first_epoch = torch.cat([cd.sample_rows(many, 5, s, [0, 0]) for s in (1, 2)])
    assert sorted(first_epoch[:, 0, 0].tolist()) == sorted(many[:, 0, 0].tolist())
    assert torch.equal(cd.sample_rows(many, 5, 2, [0, 0]), first_epoch[5:])
    assert not torch.equal(cd.sample_rows(many, 5, 1, [1, 0]), first_epoch[:5])
    val = cd.eval_rows(many, 4, 3)  # 12 places for 10 rows: every row, two of them twice
    assert [b.shape[0] for b in val] == [3, 3, 3, 3]
    assert set(torch.cat(val)[:, 0, 0].tolist()) == set(many[:, 0, 0].tolist())
    assert len(cd.eval_rows(many, 2, 2)) == 2


def _block_mask(positions: torch.Tensor) -> torch.Tensor:
    """An explicit 4-D additive mask: causal within each segment of restarting positions."""
    seg = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), (positions.diff() != 1).long()]), 0)
    t = len(positions)
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    return torch.zeros(1, 1, t, t).masked_fill(~allowed, torch.finfo(torch.float32).min)


def test_packed_rows_attend_within_each_example(tmp_path: Path) -> None:
    """The logits of a packed row equal those of each example run alone (Hugging Face's model), and
    coat's converted model masks the same way (identical to an explicit block-diagonal mask on the
    same row: its FP8 scales span the row, so it is compared on the same row); its fused loss
    counts only the learned targets."""
    import coat
    from transformers import AutoModelForCausalLM

    from coat.cli.model import lm_loss

    ckpt = make_checkpoint(tmp_path / "ckpt", tokenizer=False)
    rng = np.random.default_rng(1)
    docs = [list(rng.integers(5, 300, n)) for n in (10, 15, 7)]
    learn = [np.arange(len(d)) >= 3 for d in docs]
    batch = torch.from_numpy(cd.pack(list(zip(docs, learn)), seq_len=40, pad_id=0).astype(np.int64))
    assert batch.shape[0] == 1
    ids, targets, positions = batch.unbind(1)
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        unmasked = model(input_ids=ids, use_cache=False).logits[0]
        pos = 0
        for d in sorted(docs, key=len, reverse=True):  # packed longest first
            n = len(d) - 1
            alone = model(input_ids=torch.tensor([d[:n]]), use_cache=False).logits[0]
            torch.testing.assert_close(packed[pos : pos + n], alone, rtol=1e-5, atol=1e-5)
            if pos:  # a later example would see the earlier ones without the position ids
                assert (unmasked[pos : pos + n] - alone).abs().max() > 0.05
            pos += n
        assert lm_loss(model, batch, nullcontext()).item() == pytest.approx(
            torch.nn.functional.cross_entropy(packed, targets[0], ignore_index=-100).item(), rel=1e-5)

        coat.convert(model, recipe="fp8")
        packed8 = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        explicit8 = model(input_ids=ids, position_ids=positions, attention_mask=_block_mask(positions[0]),
                          use_cache=False).logits[0]
        torch.testing.assert_close(packed8, explicit8, rtol=0, atol=0)
        assert (model(input_ids=ids, use_cache=False).logits[0] - packed8).abs().max() > 0.05
        # coat's fused LM head + loss (no logits) over the same targets
        assert lm_loss(model, batch, nullcontext()).item() == pytest.approx(
            torch.nn.functional.cross_entropy(packed8, targets[0], ignore_index=-100).item(), rel=1e-4)


def _corpus(tmp_path: Path, data: Path, tok, seq_len: int = 64):
    kind = cd.detect(data)
    assert kind is not None
    return cd.load_chat_corpus(data, kind, HFTokenizer(tok, "test"), seq_len, 0.25, tmp_path / "cache",
                               log=lambda _: None)


def test_what_is_chat_data_and_folders_of_it(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path / "tok")
    records = [{"messages": conversation(i)} for i in range(8)]
    single = _corpus(tmp_path, write_records(tmp_path / "chat.jsonl", records), tok)
    # A folder of JSONL files (read in name order) and a JSON array are the same data.
    (tmp_path / "folder").mkdir()
    write_records(tmp_path / "folder" / "a.jsonl", records[:5])
    write_records(tmp_path / "folder" / "b.jsonl", records[5:])
    (tmp_path / "array.json").write_text(json.dumps(records))
    for data in (tmp_path / "folder", tmp_path / "array.json"):
        got = _corpus(tmp_path, data, tok)
        assert np.array_equal(got.train, single.train) and np.array_equal(got.val, single.val), data
    # What coat.cli.data reads stays there: text JSONL, text files and folders, JSON that is not an array.
    (tmp_path / "texts").mkdir()
    write_records(tmp_path / "texts" / "t.jsonl", [{"text": "hello"}])
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "obj.json").write_text(json.dumps({"messages": []}))
    for data in ("texts", "texts/t.jsonl", "notes.txt", "obj.json"):
        assert cd.detect(tmp_path / data) is None, data


def test_parquet_and_datasets_folders_give_the_jsonl_rows(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow", reason="parquet and datasets folders are read with pyarrow")
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    tok = make_tokenizer(tmp_path / "tok")
    records = [{"messages": conversation(i)} for i in range(8)]
    jsonl = _corpus(tmp_path, write_records(tmp_path / "chat.jsonl", records), tok)
    assert jsonl.info["kind"] == "chat" and (jsonl.info["train_examples"], jsonl.info["val_examples"]) == (6, 2)
    logged: list[str] = []
    again = cd.load_chat_corpus(tmp_path / "chat.jsonl", "records", HFTokenizer(tok, "test"), 64, 0.25,
                                tmp_path / "cache", log=logged.append)
    assert logged[0].startswith("Using cached packed chat data") and again.info == jsonl.info
    assert np.array_equal(again.train, jsonl.train) and np.array_equal(again.val, jsonl.val)

    table = pa.Table.from_pylist(records)
    pq.write_table(table, tmp_path / "chat.parquet")
    for data in (tmp_path / "chat.parquet",):
        got = _corpus(tmp_path, data, tok)
        assert np.array_equal(got.train, jsonl.train) and np.array_equal(got.val, jsonl.val)

    def save_to_disk(folder: Path, rows: list[dict]) -> None:
        try:
            import datasets
        except ImportError:  # the layout datasets' save_to_disk writes: Arrow IPC streams + state.json
            folder.mkdir(parents=True)
            with ipc.new_stream(folder / "data-00000-of-00001.arrow", pa.Table.from_pylist(rows).schema) as w:
                w.write_table(pa.Table.from_pylist(rows))
            (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                                            "_split": None}))
            (folder / "dataset_info.json").write_text("{}")
        else:
            datasets.Dataset.from_list(rows).save_to_disk(str(folder))

    save_to_disk(tmp_path / "ds", records)
    got = _corpus(tmp_path, tmp_path / "ds", tok)
    assert np.array_equal(got.train, jsonl.train) and np.array_equal(got.val, jsonl.val)

    # A DatasetDict: its "test" split is the held-out set, whatever --val-fraction says.
    save_to_disk(tmp_path / "dd" / "train", records[:6])
    save_to_disk(tmp_path / "dd" / "test", records[6:])
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    got = _corpus(tmp_path, tmp_path / "dd", tok)
    assert got.info["split"] == "given" and np.array_equal(got.val, jsonl.val)
    assert np.array_equal(got.train, jsonl.train)


def test_refusals_name_the_flag_and_the_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    chat = write_records(tmp_path / "chat.jsonl", [{"messages": conversation(i)} for i in range(8)])
    base = dict(data=str(chat), steps=2, batch_size=2, seq_len=64, device="cpu", quiet=True, recipe="bf16",
                cache_dir=str(tmp_path / "cache"))

    def refused(**kw) -> ConfigError:
        with pytest.raises(ConfigError) as e:
            train(TrainConfig(**(base | {"out": str(tmp_path / "out")} | kw)))
        assert not (tmp_path / "out").exists()  # nothing written
        return e.value

    e = refused()
    assert e.flag == "--data" and "--init" in str(e) and "chat template" in str(e)
    e = refused(init=str(make_checkpoint(tmp_path / "bare", tokenizer=False)))
    assert e.flag == "--init" and "no tokenizer" in str(e)
    e = refused(init=str(make_checkpoint(tmp_path / "notemplate", template=None)))
    assert e.flag == "--data" and "chat_template" in str(e)
    # CUDA graphs cannot capture transformers' host-side check of the packed positions (checked
    # here directly: on a machine without CUDA, --cuda-graph is refused earlier for that).
    with pytest.raises(ConfigError) as ce:
        _check_chat_data(TrainConfig(init=str(ckpt), data=str(chat), cuda_graph=True), object())
    assert ce.value.flag == "--cuda-graph" and "packed chat data" in str(ce.value)

    bad = write_records(tmp_path / "bad.jsonl", [{"messages": conversation(0)},
                                                 {"messages": [{"role": "user", "content": 3}]}])
    e = refused(init=str(ckpt), data=str(bad))
    assert e.flag == "--data" and "bad.jsonl:2" in str(e) and "content" in str(e)
    odd = write_records(tmp_path / "odd.jsonl", [{"conversations": [{"from": "narrator", "value": "x"}]}] * 2)
    assert "narrator" in str(refused(init=str(ckpt), data=str(odd)))
    mixed = write_records(tmp_path / "mixed.jsonl", [{"messages": conversation(0)}] * 3
                          + [{"prompt": "a b", "completion": " c"}] * 3)
    assert "mixes record formats" in str(refused(init=str(ckpt), data=str(mixed)))
    with pytest.raises(ValueError, match="rec: \"tools\" is a string but not JSON"):
        cd.normalize({"messages": conversation(0), "tools": "{not json"}, "rec")
    assert cd.normalize({"messages": conversation(0), "tools": '[{"type": "function"}]'}, "rec")[1][2] == [
        {"type": "function"}]  # tools stored as a JSON string (as datasets often do) reach the template parsed
    unknown = write_records(tmp_path / "unknown.jsonl", [{"messages": conversation(0)}, {"question": "q"}])
    assert "unknown.jsonl:2" in str(refused(init=str(ckpt), data=str(unknown)))

    # Replies that start past --seq-len leave nothing to learn.
    with pytest.raises(ValueError, match="the train split of .* has no example with a token to learn within --seq-len 8"):
        cd.load_chat_corpus(chat, "records", HFTokenizer(make_tokenizer(tmp_path / "tok"), "t"), 8, 0.25,
                            tmp_path / "cache", log=lambda _: None)

    # A parquet file without pyarrow: what to install.
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    e = refused(init=str(ckpt), data=str(tmp_path / "x.parquet"))
    assert e.flag == "--data" and "pip install pyarrow" in str(e)

    # Text JSONL stays with the text loader.
    assert cd.detect(write_records(tmp_path / "text.jsonl", [{"text": "hello"}])) is None


def test_cli_chat_lora_run_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("peft")
    make_checkpoint(tmp_path / "tiny-chat")
    write_records(tmp_path / "chat.jsonl", [{"messages": conversation(i)} for i in range(40)])
    monkeypatch.chdir(tmp_path)
    status = main(["train", "--init", "tiny-chat", "--data", "chat.jsonl", "--lora", "8", "--steps", "3",
                   "--device", "cpu", "--recipe", "coat", "--batch-size", "4", "--seq-len", "96",
                   "--eval-batches", "1", "--out", "run", "--cache-dir", "cache", "--save-every", "3"])
    assert status == 0
    printed = capsys.readouterr().out
    assert "Chat data: 38 train / 2 val examples (chat)" in printed
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["finished"] and np.isfinite(summary["final_val_loss"])
    corpus = json.loads((tmp_path / "run" / "config.json").read_text())["corpus"]
    assert corpus["packed"] and corpus["kind"] == "chat" and corpus["train_tokens"] == corpus["train_rows"] * 96
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()

    # Extending the run: the packed data and its order are found again.
    assert main(["train", "--resume", "run", "--steps", "5", "--quiet"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["finished"] and summary["steps"] == 5


def test_a_copy_of_a_held_out_example_is_not_trained_on(tmp_path: Path) -> None:
    # Conversations repeated in a data set land on both sides of the split: the training copies of a
    # held-out example are dropped, as for text documents (found by review).
    tok = make_tokenizer(tmp_path / "tok")
    records = [{"messages": conversation(i)} for i in range(2, 8)] + [{"messages": conversation(i)} for i in (2, 3)]
    corpus = _corpus(tmp_path, write_records(tmp_path / "chat.jsonl", records), tok)
    assert corpus.info["val_examples"] == 2 and corpus.info["train_copies_dropped"] == 2
    assert corpus.info["train_examples"] == 4
    with pytest.raises(ValueError, match="every training example in .* is a copy of a held-out one"):
        _corpus(tmp_path, write_records(tmp_path / "same.jsonl", [{"messages": conversation(2)}] * 4), tok)
