"""`coat train --init PATH --side-tuning R` (issue 31 item 2): Quantized Side Tuning (coat.SideTuned)
on the FP8 frozen base of a tiny Hugging Face checkpoint the tests write: the loss falls, the run's
checkpoints hold the side network only, --save writes the side network alone (OUT/side), which
SideTuned.load_side loads onto the original checkpoint with the trained logits; a resume equals the
uninterrupted run; --compare trains coat+lora beside it; the flags it cannot be combined with are
refused naming them; and coat bench's coat+side setup runs on the CPU. CPU path."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cli_train_init import _usage_error, finetune_config, make_checkpoint, write_jsonl

from coat.cli import distributed_train as dt
from coat.cli.config import ConfigError, TrainConfig, resolve_config, setup_name, validate
from coat.cli.train import prepare, train
from coat.side_tuning import SideTuned

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "ft.jsonl")
    return make_checkpoint(tmp_path / "ckpt", "llama")


def _side(tmp_path: Path, ckpt: Path, name: str, **kw):
    return finetune_config(tmp_path, ckpt, name, **({"side_tuning": 4, "steps": 6, "save_every": 3, "lr": 1e-2} | kw))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_resume_on_a_changed_base_is_refused(tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    # The checkpoints hold the side network only: a base re-saved in place with other weights would be
    # side-tuned on silently (found by review). Same config, other weights, same file sizes.
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    assert train(_side(tmp_path, ckpt, "run", steps=3, save_every=3))["finished"]
    base = AutoModelForCausalLM.from_pretrained(ckpt)
    with torch.no_grad():
        for p in base.parameters():
            p.mul_(1.01)
    base.save_pretrained(ckpt)
    err = " ".join(_usage_error(["--resume", str(run), "--steps", "6"], capsys).split())
    assert "argument --init: the weight files of" in err and "side network" in err, err
    assert json.loads((run / "summary.json").read_text())["steps"] == 3  # nothing ran


def test_side_tuning_trains_saves_the_side_network_and_resumes(tmp_path: Path, ckpt: Path) -> None:
    from transformers import AutoModelForCausalLM

    straight = train(_side(tmp_path, ckpt, "straight"))
    assert straight["finished"] and straight["final_val_loss"] < straight["initial_val_loss"] - 0.05
    out = tmp_path / "straight"
    assert straight["setup"] == json.loads((out / "config.json").read_text())["setup"] == "coat+side"
    side_dir = Path(straight["model_dir"])
    assert side_dir == out / "side" and not (out / "model").exists() and not (out / "adapter").exists()
    assert sorted(p.name for p in side_dir.iterdir()) == ["side_config.json", "side_model.safetensors"]
    assert json.loads((side_dir / "side_config.json").read_text())["r"] == 4
    # The checkpoint holds the side network and its optimizer only, never the (dequantized) base.
    state = torch.load(out / "checkpoints" / "step_00000006" / "model_optim.pt", weights_only=True)["model"]
    assert state and not any(k.startswith("base.") for k in state)
    # The saved folder on the original checkpoint gives the trained model's logits (its last checkpoint's).
    ids = torch.tensor([[5, 9, 17, 33, 2, 40, 7]])
    loaded = SideTuned.load_side(side_dir, AutoModelForCausalLM.from_pretrained(ckpt)).eval()
    trained = SideTuned(AutoModelForCausalLM.from_pretrained(ckpt), r=4).eval()
    trained.load_side_state_dict(state)
    plain = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    assert torch.equal(_logits(loaded, ids), _logits(trained, ids))
    assert not torch.allclose(_logits(loaded, ids), _logits(plain, ids))  # it did train
    # Resumed from step 3, it ends where the uninterrupted run ended, bit for bit.
    half = tmp_path / "half"
    shutil.copytree(out, half, ignore=shutil.ignore_patterns("step_00000006", ".lock", "side"))
    (half / "summary.json").unlink()
    resumed = train(TrainConfig(resume=str(half), quiet=True))
    assert resumed["finished"] and resumed["final_val_loss"] == straight["final_val_loss"]
    assert resumed["final_train_loss"] == straight["final_train_loss"]
    again = SideTuned.load_side(half / "side", AutoModelForCausalLM.from_pretrained(ckpt)).eval()
    assert torch.equal(_logits(again, ids), _logits(loaded, ids))


def test_compare_trains_lora_on_the_same_fp8_base(tmp_path: Path, ckpt: Path) -> None:
    result = train(_side(tmp_path, ckpt, "cmp", compare=True, steps=2, save_every=None, save=False, eval_batches=1))
    assert set(result["runs"]) == {"coat+lora", "coat+side"} and "| | coat+lora | coat+side |" in result["table"]
    lora = json.loads((tmp_path / "cmp" / "coat+lora" / "config.json").read_text())["train"]
    assert (lora["lora"], lora["lora_alpha"], lora["frozen_fp8"], lora["side_tuning"]) == (16, 32, True, 0)
    assert len(lora["lora_targets"].split(",")) == 7
    side = json.loads((tmp_path / "cmp" / "coat+side" / "config.json").read_text())["train"]
    assert (side["side_tuning"], side["lora"], side["lr"]) == (4, 0, lora["lr"])


def test_the_setup_name_and_defaults() -> None:
    cfg = resolve_config(TrainConfig(recipe="coat+side", init="unused", device="cpu"))
    assert (cfg.recipe, cfg.side_tuning, cfg.compare) == ("coat", 16, False) and setup_name(cfg) == "coat+side"
    assert setup_name(resolve_config(TrainConfig(recipe="coat-lean+side", side_tuning=8, init="x", device="cpu"))) \
        == "coat-lean+side"
    cfg = resolve_config(TrainConfig(side_tuning=16, init="unused", device="cpu"))
    assert cfg.compare is False and cfg.lr == 2e-4  # no bf16 baseline to compare with unless --compare asks
    validate(cfg)
    from coat.cli.main import build_parser

    assert build_parser().parse_args(["train", "--side-tuning", "--init", "x"]).side_tuning == 16  # R defaults to 16
    for bad, msg in ((dict(recipe="bf16+side"), "--recipe: side tuning runs on the FP8 frozen base"),
                     (dict(recipe="coat+lora+side", lora=4), "--recipe: side and lora exclude each other")):
        with pytest.raises(ConfigError, match=msg):
            resolve_config(TrainConfig(init="unused", device="cpu", **bad))


def test_refusals_name_the_flags(tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "bad"
    common = ["--data", str(tmp_path / "ft.jsonl"), "--steps", "2", "--out", str(out)]
    init = ["--init", str(ckpt)]
    for argv, msg in (
            (["--side-tuning", "4"], "--side-tuning: side tuning fine-tunes a pretrained model: give --init PATH"),
            ([*init, "--side-tuning", "4", "--lora", "4"], "--side-tuning: cannot be combined with --lora"),
            ([*init, "--side-tuning", "4", "--recipe", "bf16"], "--side-tuning: needs the FP8 frozen base"),
            ([*init, "--side-tuning", "4", "--recipe", "coat", "--release-grads"],
             "--side-tuning: cannot be combined with --release-grads"),
            ([*init, "--side-tuning", "4", "--compile"], "--side-tuning: cannot be combined with --compile"),
            ([*init, "--side-tuning", "4", "--recipe", "fp8", "--fp8-stats"],
             "--side-tuning: cannot be combined with --fp8-stats"),
            ([*init, "--side-tuning", "-1"], "--side-tuning: must be a reduction factor >= 1"),
            ([*init, "--side-tuning", "3"], "--side-tuning: 3 must divide the --init model's hidden size 64"),
            ([*init, "--side-tuning", "4", "--lora-alpha", "4"], "--lora-alpha: only applies with --lora")):
        assert msg in _usage_error([*argv, *common], capsys), argv
    assert not out.exists()
    # Under torchrun (FSDP2) it is refused before anything is loaded or written.
    cfg = TrainConfig(init=str(ckpt), side_tuning=4, data=str(tmp_path / "ft.jsonl"), device="cpu", out=str(out))
    with pytest.raises(ConfigError, match="--side-tuning: side tuning under torchrun"):
        prepare(cfg, dt.Dist(rank=0, world=2), log=lambda _: None)
    assert not out.exists()


def test_refused_on_packed_chat_data(tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": f"def f{i}(x):", "completion": f" return x + {i}"}) + "\n"
                            for i in range(40)))
    err = _usage_error(["--init", str(ckpt), "--side-tuning", "4", "--data", str(chat), "--steps", "2", "--out",
                        str(tmp_path / "bad")], capsys)
    assert "--side-tuning: does not run on packed chat data" in err


def test_coat_bench_runs_the_side_setup_on_the_cpu(tmp_path: Path) -> None:
    js = tmp_path / "b.json"
    p = subprocess.run([sys.executable, "-m", "coat.cli.main", "bench", "--setups", "coat+side", "--batches", "1",
                        "--warmup", "1", "--steps", "1", "--device", "cpu", "--json", str(js), "--png",
                        str(tmp_path / "b.png")], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    (rec,) = json.loads(js.read_text())["records"]
    # the recipe is coat.memory's coat+side plan (2368124); it plans GPUs only, so no estimate on a CPU
    assert (rec["setup"], rec["status"], rec["model"], rec["recipe"]) == ("coat+side", "ok", "tiny", "coat+side")
    assert rec["peak_gib"] > rec["resident_gib"] > 0 and rec["tokens_per_s"] > 0 and rec.get("estimate_gib") is None
    assert "| tiny | coat+side | 1 |" in p.stdout


def test_bench_builds_the_side_base_one_fp8_layer_at_a_time() -> None:
    # coat+side's model (coat/cli/bench_frozen.py): every projection frozen in FP8, the model whole
    # and working, and at no moment more than about one decoder layer in bf16 (the tracker of live
    # storages coat bench uses on a CPU).
    from coat import memory
    from coat.cli.bench_frozen import build_frozen_fp8
    from coat.cli.bench_worker import LiveBytes
    from coat.nn import adapters

    shape = memory.ModelShape("deep", hidden=256, layers=8, heads=4, kv_heads=2, intermediate=688, vocab=64)
    torch.manual_seed(0)
    with LiveBytes() as live:
        model = build_frozen_fp8(shape, torch.bfloat16, torch.device("cpu"))
    bf16_layers = 2 * shape.layers * shape.layer_params
    assert live.peak < 0.75 * bf16_layers, (live.peak, bf16_layers)  # FP8 codes (half) + one bf16 layer
    assert model.config.num_hidden_layers == len(model.model.layers) == 8
    assert sum(adapters.is_frozen_fp8(m) for m in model.modules()) == 7 * 8
    assert not any(p.requires_grad for p in model.model.layers.parameters())
    ids = torch.randint(0, 64, (2, 16))
    loss = SideTuned(model, r=16)(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and abs(loss.item() - float(torch.tensor(64.0).log())) < 0.5


@pytest.mark.gpu
def test_side_tuning_under_cuda_graph_trains_as_eager_on_the_gpu(tmp_path: Path, ckpt: Path) -> None:
    """coat train --side-tuning R --cuda-graph (setup coat+side+graph): the replayed step trains the
    side network as the eager step does (the same seed and batches; within the accumulation-order
    differences of captured kernels) and saves it the same way."""
    eager = train(_side(tmp_path, ckpt, "eager", device="cuda"))
    graph = train(_side(tmp_path, ckpt, "graph", device="cuda", cuda_graph=True))
    assert graph["finished"] and graph["setup"] == "coat+side+graph"
    assert graph["final_val_loss"] < graph["initial_val_loss"] - 0.05
    assert graph["initial_val_loss"] == pytest.approx(eager["initial_val_loss"], rel=1e-6)
    assert graph["final_val_loss"] == pytest.approx(eager["final_val_loss"], rel=0.02)
    assert sorted(p.name for p in Path(graph["model_dir"]).iterdir()) == ["side_config.json", "side_model.safetensors"]
