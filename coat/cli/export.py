"""--save at the end of ``coat train``: the trained model (or LoRA adapter) written as Hugging
Face writes it (a side-tuned run: the side network, as coat.SideTuned.save_side writes it), whole
or absent; when that fails, the weights stay in a checkpoint to export later with
``coat train --resume OUT --save``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from coat.cli import checkpoint as ckpt
from coat.cli import distributed_train as dt
from coat.cli.config import artifact

if TYPE_CHECKING:
    from coat.cli.plan import RunPlan


def _save_adapter(model: torch.nn.Module, out: Path, tokenizer: Any | None, base: Path | None) -> Path:
    """``model.save_pretrained`` of a PEFT model (adapter weights and config only), written to a
    temporary folder and renamed, so ``out`` is whole or absent. ``adapter_config.json`` names the
    --init checkpoint by its absolute path (transformers records the path as given, and PEFT would
    look a relative one up on the Hub from another folder), so that
    ``peft.AutoPeftModelForCausalLM.from_pretrained(out)`` loads from anywhere."""
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        if base is not None:
            cfg_file = tmp / "adapter_config.json"
            cfg = json.loads(cfg_file.read_text())
            cfg["base_model_name_or_path"] = str(base.resolve())
            cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace(out: Path, write: Callable[[Path], Path]) -> Path:
    """Writes a new ``out`` with ``write(staging)`` into a staging folder beside it, then swaps it
    in: an existing ``out`` (the export of a run now extended) is renamed aside, the new one
    renamed in, and the old one removed. On any failure the old ``out`` stays (put back if it had
    been moved aside) and nothing temporary is left; the error is raised."""
    staging = out.with_name(f".new-{out.name}-{os.getpid()}")
    old = out.with_name(f".old-{out.name}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write(staging)
        if not out.exists():
            os.replace(staging, out)
            return out
        os.replace(out, old)
        try:
            os.replace(staging, out)
        except BaseException:
            os.replace(old, out)  # the old export back where it was
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)  # the new export is in place; a failure here leaves only litter
    return out


def export(plan: RunPlan, model: torch.nn.Module, d: dt.Dist, device: torch.device, log: Callable[[str], None],
            save_checkpoint: Callable[[int], None], step: int) -> str | None:
    """--save: the trained model (or LoRA adapter, side network) in OUT/model (OUT/adapter, OUT/side),
    replacing the export of a run now extended (``--resume OUT --steps N``). If that fails, an
    earlier export stays as it was, the weights are kept in a checkpoint of the last step (written
    now if there is none), and ``WriteError`` says how to export them later."""
    from coat.cli.pretrained import save_model

    cfg, out = plan.cfg, plan.out
    error: BaseException | None = None
    saved = None
    full = None if cfg.lora or cfg.side_tuning else dt.full_state_dict(model, d)  # collective
    if d.is_main:
        try:
            if cfg.lora:  # the adapter, as PEFT saves it (plus the tokenizer)
                saved = str(_replace(out / "adapter", lambda p: _save_adapter(
                    model, p, plan.tokenizer, plan.init.path if plan.init else None)))
                log(f"[{cfg.recipe}] LoRA adapter saved to {saved}")
            elif cfg.side_tuning:  # the side network alone (coat.SideTuned.save_side): JSON + safetensors
                saved = str(_replace(out / "side", model.save_side))
                log(f"[{cfg.recipe}] side network saved to {saved} (load it with coat.SideTuned.load_side on "
                    f"{plan.init.path if plan.init else 'the base'})")
            else:
                tok = plan.tokenizer.tokenizer if plan.tokenizer else None
                dtype = plan.init.dtype if plan.init else "float32"
                arch = plan.init.architecture if plan.init else "LlamaForCausalLM"
                saved = str(_replace(out / "model", lambda p: save_model(full, model.config, p, dtype, tok, arch)))
                log(f"[{cfg.recipe}] model saved to {saved} ({dtype})")
        except Exception as e:  # a full disk: OSError, or a writer's RuntimeError caused by one
            error = e
    if not d.any(error is not None, device):
        return saved
    target = out / artifact(cfg)
    final = out / ckpt.CHECKPOINTS / f"step_{step:08d}"
    if not final.is_dir():
        save_checkpoint(step)  # a WriteError here says what is kept
    kept = f" ({target} still holds the earlier export, unchanged)" if target.is_dir() else ""
    why = ckpt.why_failed(error) if error else "failed on rank 0"
    raise ckpt.WriteError(f"could not write {target}: {why}{kept}; the trained weights "
                          f"are kept in {final}: free space, then export them with: "
                          f"coat train --resume {out} --save") from error
