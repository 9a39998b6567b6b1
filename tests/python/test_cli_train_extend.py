"""Issue 26 item 3. Extending a finished run that saved ``model/`` or ``adapter/`` with
``coat train --resume OUT --steps N`` replaces the export with the new weights and updates
summary.json (it used to crash on the rename, leaving both stale); a failed replacement keeps the
old export. A config error found by a compare-mode child is a clean usage error that leaves no
folder behind. CPU, tiny models."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cli_train_checkpoint import tiny  # noqa: E402
from test_cli_train_init import make_checkpoint, write_jsonl  # noqa: E402
from test_cli_train_resume_safety import usage_error  # noqa: E402

from coat.cli import checkpoint as ckpt  # noqa: E402
from coat.cli import pretrained  # noqa: E402
from coat.cli.config import TrainConfig  # noqa: E402
from coat.cli.main import main  # noqa: E402
from coat.cli.train import train  # noqa: E402


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    assert out, f"no weights in {folder}"
    return out


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert a.keys() == b.keys()
    return any(not torch.equal(a[k], b[k]) for k in a)


def _no_temporaries(run: Path) -> None:
    assert not [p.name for p in run.iterdir() if p.name.startswith(".tmp-") or p.name.startswith(".old-")]


def test_extending_a_run_replaces_its_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    train(tiny(tmp_path, "run", steps=2, save_every=2, eval_every=2, save=True))
    before = _weights(run / "model")
    assert main(["train", "--resume", str(run), "--steps", "4", "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["finished"] and summary["model_dir"] == str(run / "model")
    after = _weights(run / "model")
    assert _differ(before, after)  # the weights of step 4, not those of step 2
    _no_temporaries(run)

    # A replacement that fails keeps the export it would have replaced, and says so.
    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pretrained, "save_model", full_disk)
    with pytest.raises(ckpt.WriteError, match=r"could not write .*model: .*No space left.*still holds the earlier "
                                              r"export, unchanged.*coat train --resume"):
        train(TrainConfig(resume=str(run), steps=6, quiet=True), explicit={"resume", "steps", "quiet"})
    assert not _differ(after, _weights(run / "model"))
    _no_temporaries(run)


def test_extending_a_lora_run_replaces_its_adapter(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    write_jsonl(tmp_path / "ft.jsonl")
    base = make_checkpoint(tmp_path / "tiny-llama", "llama")
    run = tmp_path / "run"
    common = ["--device", "cpu", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--cache-dir",
              str(tmp_path / "cache"), "--quiet"]
    assert main(["train", "--init", str(base), "--data", str(tmp_path / "ft.jsonl"), "--recipe", "bf16", "--lora",
                 "4", "--steps", "2", "--save", "--save-every", "2", "--eval-every", "2", "--lr", "2e-2",
                 "--warmup-steps", "0", "--out", str(run), *common]) == 0
    before = _weights(run / "adapter")
    assert main(["train", "--resume", str(run), "--steps", "4", "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["model_dir"] == str(run / "adapter")
    assert _differ(before, _weights(run / "adapter"))
    cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base.resolve())
    _no_temporaries(run)


def test_a_config_error_in_a_compare_child_is_a_clean_usage_error(tmp_path: Path,
                                                                 capfd: pytest.CaptureFixture) -> None:
    pytest.importorskip("peft")
    write_jsonl(tmp_path / "ft.jsonl")
    base = make_checkpoint(tmp_path / "tiny-llama", "llama")
    out = tmp_path / "cmp"
    argv = ["--init", str(base), "--data", str(tmp_path / "ft.jsonl"), "--lora", "4", "--lora-targets", "foo_proj",
            "--steps", "2", "--save-every", "2", "--eval-every", "2", "--device", "cpu", "--batch-size", "2",
            "--seq-len", "32", "--eval-batches", "1", "--cache-dir", str(tmp_path / "cache"), "--out", str(out),
            "--quiet"]
    single = usage_error(capfd, *argv, "--recipe", "coat")
    assert "argument --lora-targets:" in single and "foo_proj" in single
    assert not out.exists()
    both = usage_error(capfd, *argv, "--compare")
    assert "argument --lora-targets: the --init model has no module named foo_proj; its Linear layers are" in both
    assert not out.exists()  # nothing that blocks --out, nothing to --resume
    # A target the model has but PEFT refuses (a norm layer) is found inside the child: the same clean
    # usage error, exit status 2, and no folder left behind.
    capfd.readouterr()
    assert main(["train", *[a if a != "foo_proj" else "norm" for a in argv], "--compare"]) == 2
    err = capfd.readouterr().err
    assert "coat train: error: argument --lora-targets:" in err and "Traceback" not in err, err
    assert not out.exists()
    # The same --out then works with valid targets.
    fixed = [a if a != "foo_proj" else "q_proj,v_proj" for a in argv]
    assert main(["train", *fixed, "--recipe", "coat"]) == 0
    assert json.loads((out / "summary.json").read_text())["finished"]


def test_a_swap_that_fails_puts_the_old_export_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from coat.cli import export

    out = tmp_path / "model"
    out.mkdir()
    (out / "w").write_text("old")

    def write(p: Path) -> Path:
        p.mkdir()
        (p / "w").write_text("new")
        return p

    real = export.os.replace

    def replace(src, dst):  # moving the old export aside works; moving the new one in does not
        if Path(src).name.startswith(".new-"):
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(export.os, "replace", replace)
    with pytest.raises(OSError, match="Input/output error"):
        export._replace(out, write)
    assert (out / "w").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["model"]
    monkeypatch.setattr(export.os, "replace", real)
    assert export._replace(out, write) == out
    assert (out / "w").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["model"]
