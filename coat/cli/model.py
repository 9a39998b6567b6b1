"""What a ``coat train`` run trains and how it scores it: the model (built or loaded, converted,
with LoRA), the optimizer, the language-model loss and the held-out evaluation."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from coat.cli import chat_data
from coat.cli import distributed_train as dt
from coat.cli.config import ConfigError, TrainConfig, fp8_recipe
from coat.cli.data import BYTE_VOCAB_SIZE, Corpus, eval_batches
from coat.cli.stats import mean_se
from coat.integrations import fsdp


# ---- model and optimizer ------------------------------------------------------------------------


def build_model(cfg: TrainConfig, vocab_size: int = BYTE_VOCAB_SIZE, eos_id: int | None = None) -> torch.nn.Module:
    """A randomly initialized ``LlamaForCausalLM`` with the configured shape (no download)."""
    # Imported here because transformers takes seconds to import; `coat --help` stays fast.
    from transformers import LlamaConfig, LlamaForCausalLM

    from coat.cli.config import resolve_config

    cfg = resolve_config(cfg)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config)


def _coat_adamw() -> type:
    from coat.optim import AdamW

    return AdamW


def add_lora(model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
    """PEFT LoRA adapters (the base frozen); on the FP8 layers, converted again so that the frozen
    base can be kept in FP8 (``--frozen-fp8``)."""
    import peft

    targets = [t.strip() for t in cfg.lora_targets.split(",")] if cfg.lora_targets else None
    lcfg = peft.LoraConfig(r=cfg.lora, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                           target_modules=targets)
    try:
        model = peft.get_peft_model(model, lcfg)
    except ValueError as e:  # e.g. a target module the model does not have
        raise ConfigError("--lora-targets", str(e)) from None
    if cfg.activations == "fp8":
        import coat

        coat.convert(model, recipe=fp8_recipe(cfg), frozen_weights="fp8" if cfg.frozen_fp8 else "keep")
    return model


def add_side(model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
    """``coat.SideTuned`` on ``model`` (already converted to the FP8 layers): the base frozen and kept
    only in FP8, a side network of width hidden / ``cfg.side_tuning`` beside it."""
    import coat

    try:
        return coat.SideTuned(model, r=cfg.side_tuning)
    except ValueError as e:  # e.g. an R that does not divide the hidden size
        raise ConfigError("--side-tuning", str(e)) from None


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the model; norms and biases are exempt from weight decay, as usual for LMs."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    if cfg.optim == "coat":
        return _coat_adamw()(groups, master_weights=cfg.master_weights, expansion=cfg.dre, **kwargs)
    if cfg.optim == "coat4bit":
        from coat.optim import AdamW4bit

        return AdamW4bit(groups, master_weights=cfg.master_weights, v_scaling=cfg.v_scaling, **kwargs)
    if cfg.optim == "snsm":
        return _snsm_optimizer(model, params, cfg, kwargs)
    # capturable: a CUDA graph replays the step (--cuda-graph), reading its step count on the device
    return torch.optim.AdamW(groups, fused=params[0].is_cuda, capturable=cfg.cuda_graph, **kwargs)


def _snsm_optimizer(model: torch.nn.Module, params: list, cfg: TrainConfig, kwargs: dict) -> torch.optim.Optimizer:
    """coat.optim.SubsetNormSM: Subset-Norm + Subspace-Momentum on the projection matrices
    (``snsm_param_groups``' split), FP8 AdamW on the rest, without weight decay on 1-D parameters."""
    from coat.optim import SubsetNormSM, snsm_param_groups

    trainable = {id(p) for p in params}
    matrices, rest = snsm_param_groups(model, weight_decay=cfg.weight_decay)
    rest = [p for p in rest["params"] if id(p) in trainable]
    groups = [
        {**matrices, "params": [p for p in matrices["params"] if id(p) in trainable]},
        {"params": [p for p in rest if p.ndim >= 2], "weight_decay": cfg.weight_decay, "adamw": True},
        {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0, "adamw": True},
    ]
    return SubsetNormSM(groups, master_weights=cfg.master_weights, proj_type=cfg.snsm_proj, **kwargs)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes this process's optimizer state holds (local shards under FSDP2)."""
    total = 0
    for st in optimizer.state.values():
        for t in st.values():
            if isinstance(t, torch.Tensor):
                t = dt_local(t)
                total += t.numel() * t.element_size()
    return total


def dt_local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def lm_loss(model: torch.nn.Module, batch: torch.Tensor, autocast: AbstractContextManager) -> torch.Tensor:
    """Mean next-token cross-entropy of a (B, T+1) batch, computed in fp32 by the model's own loss
    path (Hugging Face's, or coat's fused LM head + loss on a converted model: no full logits).

    A (B, 3, T) batch is packed chat data (coat.cli.chat_data): input ids, targets (-100: no loss)
    and position ids that restart at 0 for each example, from which transformers masks attention
    between the packed examples (only without a KV cache: hence ``use_cache=False``); the mean is
    over the targets that count."""
    if batch.ndim == 3:
        ids, targets, positions = (t.contiguous() for t in batch.unbind(1))
        with autocast:
            return model(input_ids=ids, position_ids=positions, labels=targets, shift_labels=targets,
                         use_cache=False).loss
    targets = batch[:, 1:].contiguous()
    with autocast:
        return model(input_ids=batch[:, :-1], labels=targets, shift_labels=targets, use_cache=False).loss


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[torch.Tensor], device: torch.device,
             autocast: AbstractContextManager, d: dt.Dist = dt.Dist()) -> list[float]:
    """The loss of each held-out batch, in order: this rank scores its share ``batches`` (batches
    rank, rank + world, ... of the set); under torchrun the others come from the other ranks."""
    model.eval()
    losses = torch.zeros(len(batches) * d.world, dtype=torch.float64, device=device)
    for i, b in enumerate(batches):
        losses[d.rank + i * d.world] = lm_loss(model, b.to(device), autocast).double()
    model.train()
    d.all_reduce(losses)
    return losses.tolist()


def eval_batch_count(cfg: TrainConfig, world: int) -> int:
    """Batches each evaluation scores (all ranks): --eval-batches rounded up to a multiple of the ranks."""
    return -(-cfg.eval_batches // world) * world


def held_out_sets(corpus: Corpus, cfg: TrainConfig, d: dt.Dist) -> dict[str, list[torch.Tensor]]:
    """This rank's share of each held-out set's fixed windows: "val" (the validation split) and
    each of ``corpus.heldout`` large enough for one window."""
    sets = {"val": corpus.val} | {name: t for name, t in corpus.heldout.items() if len(t) > cfg.seq_len + 1}
    return {name: (chat_data.eval_rows if chat_data.is_packed(t) else eval_batches)(
                t, eval_batch_count(cfg, d.world), cfg.batch_size, cfg.seq_len)[d.rank :: d.world]
            for name, t in sets.items()}


def metric_name(held_out: str) -> str:
    """The metrics key of a held-out set's loss: val_loss, val_prose_loss, ..."""
    return "val_loss" if held_out == "val" else f"val_{held_out}_loss"


def final_held_out(scores: dict[str, list[float]] | None) -> dict[str, Any]:
    """Summary figures of the last evaluation: each further held-out set's loss, the standard
    error of each mean over its batches (how well this fixed set pins its text's loss down), and
    the batch losses themselves (a comparison pairs them batch by batch)."""
    if not scores:
        return {}
    out: dict[str, Any] = {f"final_{metric_name(n)}": sum(v) / len(v) for n, v in scores.items() if n != "val"}
    out["final_val_loss_se"] = {n: mean_se(v)[1] for n, v in scores.items()}
    out["final_eval_batch_losses"] = scores
    return out


def wdt_of(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the trained weights (the first floating-point parameter that trains)."""
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point():
            return p.dtype
    return next(model.parameters()).dtype


def describe_precision(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> dict[str, Any]:
    """Which parts of the step ran in FP8 and which did not, read from the model and optimizer."""
    layers = fsdp.decoder_layers(model.base if cfg.side_tuning else model)
    # coat.convert gives each converted layer a class named Fp8<Original>; FSDP2 subclasses it again.
    fp8_layers = sum(any(c.__name__.startswith("Fp8") for c in type(m).__mro__) for m in layers)
    high = "bf16 (autocast)" if cfg.dtype == "bf16" else "fp32"
    fp8, other = [], []
    if fp8_layers and cfg.side_tuning:  # the base runs forward only, under no_grad: it saves nothing
        fp8.append(f"forward GEMMs of the frozen base's {fp8_layers}/{len(layers)} decoder layers (E4M3 "
                   "activations, fp32 accumulation), run without gradients")
        fp8.append("frozen base weights (E4M3 codes, one scale per fused group)")
    elif fp8_layers:
        rec = fp8_recipe(cfg)
        scales = {"tensor": "one scale per tensor", "row": "one scale per token and per weight channel",
                  "block": "1x128 activation/gradient and 128x128 weight scales"}[rec.granularity]
        fp8.append(f"GEMMs of {fp8_layers}/{len(layers)} decoder layers (q/k/v, o, gate/up, down projections: "
                   f"E4M3 activations and weights, {rec.grad_format.upper()} gradients, {scales}, "
                   f"{'forward GEMMs with fast accumulation, ' if rec.fast_accum_fwd and rec.granularity != 'block' else ''}"
                   "fp32 accumulation)")
        fp8.append("activations the decoder layers save for backward (E4M3, one scale per 1x16 group)")
    else:
        other.append(f"decoder-layer GEMMs and saved activations ({high})")
    if cfg.optim == "coat":
        g = optimizer.param_groups[0]
        fp8.append(f"AdamW states: m {g['m_format'].upper()}, v {g['v_format'].upper()}, per 128-element group "
                   + ("with Dynamic Range Expansion" if g["expansion"] else "(no Dynamic Range Expansion)"))
    elif cfg.optim == "snsm":
        other.append("Subset-Norm + Subspace-Momentum states on the matrices (fp32 row/column norms, rank-"
                     f"{optimizer.param_groups[0]['rank']} momentum and projection); FP8 AdamW states on embeddings, "
                     "norms and biases")
    elif cfg.optim == "coat4bit":
        v_scales = ("rank-1 (row and column) scales on matrices, 128-element ones elsewhere"
                    if optimizer.v_scaling == "rank1" else "128-element scales")
        other.append(f"AdamW states in 4 bits (m: dynamic-exponent map, v: linear map without zero, {v_scales}; "
                     "tensors of <= 4096 elements fp32)")
    else:
        other.append("AdamW states (fp32 m and v)")
    if cfg.lora:
        base = "frozen base weights (E4M3 codes, one scale per fused group)" if cfg.frozen_fp8 else None
        if base:
            fp8.append(base)
        other.append(f"LoRA adapters (rank {cfg.lora}, computed beside the base GEMMs in their own dtype, "
                     f"{str(wdt_of(model)).removeprefix('torch.')})")
    if cfg.side_tuning:
        other.append(f"side network (width hidden / {cfg.side_tuning}: downsamplers, gates, {len(layers)} Llama "
                     f"layers, upsample; {str(wdt_of(model)).removeprefix('torch.')}), the base's saved hidden states")
    other.append(f"embeddings, final norm, LM head, attention math (softmax(QK^T)V), residual stream ({high})")
    wdt = wdt_of(model)
    if wdt == torch.float32:
        weights = "weights and gradients (fp32; the weights are their own master copy)"
    elif cfg.master_weights == "bf16_sr":
        weights = "weights and gradients (bf16, no master copy: updates rounded stochastically)"
    else:
        weights = f"weights and gradients ({str(wdt).removeprefix('torch.')}, fp32 master copy)"
    other.append(weights)
    return {"fp8": fp8, "not_fp8": other}
