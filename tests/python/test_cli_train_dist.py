"""`torchrun --nproc_per_node 2 -m coat train` on two CPU ranks (gloo): FSDP2 with the coat recipe
(converted decoder layers + coat.optim.AdamW over sharded parameters), metrics written once by
rank 0, torch.distributed.checkpoint checkpoints, and a resume that continues bit for bit."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from coat.cli import checkpoint as ckpt

from test_cli_train_resume_safety import _WritesMarker  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
STDLIB_JSON = Path(sysconfig.get_paths()["stdlib"]) / "json"

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def torchrun(*argv: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
                        "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           "-m", "coat", "train", *argv], capture_output=True, text=True, env=env, timeout=600)


def tiny_args(tmp: Path, out: str, recipe: str, device: str = "cpu") -> list[str]:
    return ["--device", device, "--recipe", recipe, "--model", "tiny", "--steps", "6", "--save-every", "3",
            "--batch-size", "4", "--seq-len", "32", "--eval-every", "3", "--eval-batches", "2", "--log-every", "1",
            "--data", str(STDLIB_JSON), "--cache-dir", str(tmp / "cache"), "--out", str(tmp / out), "--quiet"]


def dcp_state(ckpt_dir: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp / f"{ckpt_dir.parent.parent.name}-{ckpt_dir.name}.pt"
    dcp_to_torch_save(ckpt_dir, target)
    return torch.load(target, weights_only=False)


def assert_equal_nested(a, b, path: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_equal_nested(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_nested(x, y, f"{path}/{i}")
    else:
        assert a == b, path


def resumed_from_step_3(straight: Path, tmp: Path, *flags: str) -> Path:
    """A copy of the 6-step run ``straight`` as it was at step 3, resumed on two ranks (with
    ``flags``): asserts the same metrics and the same step-6 checkpoint, bit for bit."""
    half = tmp / "half"
    shutil.copytree(straight, half, ignore=shutil.ignore_patterns("step_00000006", ".lock", "model"))
    (half / "summary.json").unlink()
    proc = torchrun("--resume", str(half), "--quiet", *flags)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def strip(folder: Path) -> list[dict]:
        return [{k: v for k, v in json.loads(line).items() if k not in ("tokens_per_s", "elapsed_s")}
                for line in (folder / "metrics.jsonl").read_text().splitlines()]

    assert strip(half) == strip(straight)
    assert_equal_nested(dcp_state(half / "checkpoints" / "step_00000006", tmp),
                        dcp_state(straight / "checkpoints" / "step_00000006", tmp))
    return half


@pytest.mark.parametrize("recipe", ["coat", "coat4bit"])
def test_fsdp2_two_ranks_train_checkpoint_and_resume_exactly(tmp_path: Path, recipe: str) -> None:
    # coat: both layers in one fully_shard unit, and the resume below at one per unit (a flag a
    # resume may change): the same steps, bit for bit.
    unit = ["--fsdp-unit", "2"] if recipe == "coat" else []
    proc = torchrun(*tiny_args(tmp_path, "straight", recipe), "--save", *unit)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    straight = tmp_path / "straight"
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["finished"] and summary["world_size"] == 2 and summary["recipe"] == recipe
    assert summary["tokens"] == 6 * 4 * 32 * 2  # every rank trains its own batch
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.5
    lines = (straight / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(7))  # rank 0 alone writes
    config = json.loads((straight / "config.json").read_text())
    assert config["world_size"] == 2 and any("decoder layers" in p for p in config["precision"]["fp8"])
    # the unit size as resolved: given, or --fsdp-unit auto (the default), which is 1 without a CUDA GPU
    assert (config["fsdp_unit"], config["train"]["fsdp_unit"]) == ((2, 2) if unit else (1, "auto"))
    found = ckpt.checkpoints(straight)
    assert [s for s, _ in found] == [3, 6]
    assert {p.name for p in found[0][1].iterdir()} >= {"meta.json", "train_state.pt", "rank00000.pt", "rank00001.pt",
                                                         ".metadata"}
    assert ckpt.read_meta(found[0][1])["format"] == "dcp"

    # --save gathers the sharded model on rank 0: plain transformers loads the final weights.
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(straight / "model").state_dict()
    final = dcp_state(found[1][1], tmp_path)["model"]
    assert saved.keys() == final.keys() and all(torch.equal(saved[k], final[k]) for k in saved)

    # The run as it was at step 3, resumed on two ranks: the same steps, bit for bit (coat: at one layer
    # per unit and with FP8 all-gather, flags a resume may change).
    half = resumed_from_step_3(straight, tmp_path, *(["--fsdp-unit", "1", "--fp8-all-gather"] if unit else []))

    # One rank cannot resume a two-rank checkpoint.
    one = subprocess.run([sys.executable, "-m", "coat", "train", "--resume", str(half), "--steps", "9"],
                         capture_output=True, text=True, timeout=300,
                         env=os.environ | {"PYTHONPATH": str(REPO_ROOT)})
    assert one.returncode == 2 and "written by 2 process(es)" in one.stderr

    # A checkpoint folder someone hands over, its .metadata a pickle that writes a file when
    # loaded (its manifest updated to match): the resume refuses it, and nothing ran.
    marker = tmp_path / "marker"
    last = half / "checkpoints" / "step_00000006"
    (last / ".metadata").write_bytes(pickle.dumps(_WritesMarker(marker)))
    ckpt.write_manifest(last)
    proc = torchrun("--resume", str(half), "--steps", "9", "--quiet")
    assert proc.returncode != 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # One usage error; torchrun's own traceback follows it, none from coat's code.
    assert "its .metadata cannot be read safely: it refers to io.open" in proc.stderr and "coat/" not in proc.stderr
    assert "--from-step 3" in proc.stderr and not marker.exists()


def _release_run_resumes_exactly(tmp_path: Path, device: str, *more: str) -> dict:
    """coat lean + gradient release under FSDP2 through `coat train`, then the run as it was at step
    3 resumed: the same steps, bit for bit. Returns the straight run's summary."""
    proc = torchrun(*tiny_args(tmp_path, "straight", "coat-lean+release", device=device), *more)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    straight = tmp_path / "straight"
    summary = json.loads((straight / "summary.json").read_text())
    config = json.loads((straight / "config.json").read_text())
    assert summary["finished"] and summary["world_size"] == 2 and config["train"]["release_grads"] is True
    resumed_from_step_3(straight, tmp_path)
    return summary


def test_fsdp2_release_trains_and_resumes_exactly(tmp_path: Path) -> None:
    summary = _release_run_resumes_exactly(tmp_path, "cpu")
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available()),
                    reason="needs two CUDA devices and NCCL")
def test_fsdp2_release_on_two_gpus(tmp_path: Path) -> None:
    # FP8 layers, gradient release and NCCL together (refused until the SwiGLU race was fixed: RESULTS.md 38, 40).
    summary = _release_run_resumes_exactly(tmp_path, "cuda", "--lr", "2e-3", "--warmup-steps", "0")
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available()),
                    reason="needs two CUDA devices and NCCL")
def test_fsdp2_two_gpus(tmp_path: Path) -> None:
    # The CPU's lr schedule for 6 steps (the CUDA defaults, lr 3e-4 after a longer warmup, would
    # barely move the loss in 6 steps: 5.38 -> 5.21 on 2 x H200, bf16 alike).
    proc = torchrun(*tiny_args(tmp_path, "gpus", "coat", device="cuda"), "--lr", "2e-3", "--warmup-steps", "0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "gpus" / "summary.json").read_text())
    assert summary["finished"] and summary["world_size"] == 2 and summary["peak_memory_kind"] == "cuda_max_allocated"
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.5


def test_auto_unit_reads_coat_trains_own_model_and_the_gpu(monkeypatch) -> None:
    """--fsdp-unit auto under torchrun: coat train's model config parses into the memory plan's shape
    (a parse failure would quietly give 1), and the GPU's memory bounds K. CUDA is faked: only the
    device's memory is read."""
    from types import SimpleNamespace

    from coat import memory
    from coat.cli import distributed_train as dt
    from coat.cli.config import MODEL_PRESETS, TrainConfig, resolve_config
    from coat.cli.model import build_model

    cfg = resolve_config(TrainConfig(model="tiny", device="cpu"))
    model = build_model(cfg)
    shape = memory.ModelShape.from_hf_config(model.config.to_dict())
    assert (shape.hidden, shape.layers) == (MODEL_PRESETS["tiny"]["hidden_size"], MODEL_PRESETS["tiny"]["layers"])
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    gib = {"v": 139.8}
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(total_memory=int(gib["v"] * memory.GiB)))
    cuda = torch.device("cuda", 0)
    assert dt.auto_unit(model, "coat", (8, 512), torch.device("cpu")) == 1  # no GPU: one layer per unit
    want = memory.auto_fsdp_unit(shape, "coat", 8, 512, 2, 139.8)
    assert want == shape.layers and dt.auto_unit(model, "coat", (8, 512), cuda) == want  # tiny GEMMs: all layers
    one, two = (memory.plan(shape, "coat", 8, 512, 2, "cuda", k).required_gib for k in (1, 2))
    assert one < two
    gib["v"] = (one + two) / 2  # room for one layer per unit only
    assert dt.auto_unit(model, "coat", (8, 512), cuda) == 1
