"""One training run of one recipe: model, optimizer, the step loop, evaluation, metrics,
checkpoints and clean stops on SIGINT/SIGTERM. Single process or one rank under torchrun."""

from __future__ import annotations

import json
import math
import platform
import random
import signal
import sys
import time
import uuid
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict
from typing import Any, Callable

import numpy as np
import torch
from tqdm import tqdm

from coat.cli import chat_data
from coat.cli import checkpoint as ckpt
from coat.cli import distributed_train as dt
from coat.cli.config import ConfigError, TrainConfig, lr_lambda, setup_name
from coat.cli.data import BYTE_VOCAB_SIZE, Corpus, eval_batches, sample_batch
from coat.cli.stats import mean_se
from coat.cli.export import export
from coat.cli.plan import RunPlan
from coat.cli.plot import plot_loss


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


def _add_lora(model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
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

        coat.convert(model, recipe="fp8", frozen_weights="fp8" if cfg.frozen_fp8 else "keep")
    return model


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the model; norms and biases are exempt from weight decay, as usual for LMs."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    if cfg.optim == "coat":
        return _coat_adamw()(groups, master_weights=cfg.master_weights, **kwargs)
    # capturable: a CUDA graph replays the step (--cuda-graph), reading its step count on the device
    return torch.optim.AdamW(groups, fused=params[0].is_cuda, capturable=cfg.cuda_graph, **kwargs)


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


def held_out_sets(corpus: Corpus, cfg: TrainConfig, d: dt.Dist) -> dict[str, list[torch.Tensor]]:
    """This rank's share of each held-out set's fixed windows: "val" (the validation split) and
    each of ``corpus.heldout`` large enough for one window."""
    per_rank = -(-cfg.eval_batches // d.world)
    sets = {"val": corpus.val} | {name: t for name, t in corpus.heldout.items() if len(t) > cfg.seq_len + 1}
    return {name: (chat_data.eval_rows if chat_data.is_packed(t) else eval_batches)(
                t, per_rank * d.world, cfg.batch_size, cfg.seq_len)[d.rank :: d.world]
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
    layers = dt.decoder_layers(model)
    # coat.convert gives each converted layer a class named Fp8<Original>; FSDP2 subclasses it again.
    fp8_layers = sum(any(c.__name__.startswith("Fp8") for c in type(m).__mro__) for m in layers)
    high = "bf16 (autocast)" if cfg.dtype == "bf16" else "fp32"
    fp8, other = [], []
    if fp8_layers:
        fp8.append(f"GEMMs of {fp8_layers}/{len(layers)} decoder layers (q/k/v, o, gate/up, down projections: "
                   "E4M3 activations and weights, E5M2 gradients, fp32 accumulation)")
        fp8.append("activations the decoder layers save for backward (E4M3, one scale per 1x16 group)")
    else:
        other.append(f"decoder-layer GEMMs and saved activations ({high})")
    if cfg.optim == "coat":
        g = optimizer.param_groups[0]
        fp8.append(f"AdamW states: m {g['m_format'].upper()}, v {g['v_format'].upper()}, per 128-element group "
                   "with Dynamic Range Expansion")
    else:
        other.append("AdamW states (fp32 m and v)")
    if cfg.lora:
        base = "frozen base weights (E4M3 codes, one scale per fused group)" if cfg.frozen_fp8 else None
        if base:
            fp8.append(base)
        other.append(f"LoRA adapters (rank {cfg.lora}, computed beside the base GEMMs in their own dtype, "
                     f"{str(wdt_of(model)).removeprefix('torch.')})")
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


def _environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
           "transformers": transformers.__version__, "numpy": np.__version__,
           "coat": getattr(sys.modules.get("coat"), "__version__", None)}
    try:
        import os

        env["cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    if device.type == "cuda":
        env |= {"cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(device)}
    return env


# ---- clean stops --------------------------------------------------------------------------------


class StopSignals:
    """SIGINT/SIGTERM ask the loop to stop after the current step (and write a checkpoint); a
    second signal while it stops gets the default behaviour (Ctrl-C twice aborts at once)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            signal.signal(signum, signal.SIG_DFL)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.raise_signal(signum)
            return
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this step and writing a checkpoint "
              "(send it again to abort at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> "StopSignals":
        for s in (signal.SIGINT, signal.SIGTERM):
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)


# ---- the run ------------------------------------------------------------------------------------


def _rng_state(rng: np.random.Generator, device: torch.device) -> dict[str, Any]:
    state = {"numpy": rng.bit_generator.state, "torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(rng: np.random.Generator, state: dict[str, Any], device: torch.device) -> None:
    rng.bit_generator.state = state["numpy"]
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def peak_memory(device: torch.device, d: dt.Dist, rss_start: int, rss_reset: bool) -> dict[str, Any]:
    """The run's peak (max over ranks): CUDA peak allocated on a GPU; on a CPU, the process's peak
    RSS since the run started (the interpreter and libraries included) and the part of it above
    the RSS at the start (what the model, optimizer and activations added)."""
    if device.type == "cuda":
        value, kind, above = torch.cuda.max_memory_allocated(device), "cuda_max_allocated", None
    else:
        value = dt.rss_peak_bytes()
        kind = "peak_rss" if rss_reset else "peak_rss_process_lifetime"
        above = max(0, value - rss_start)
    t = d.all_reduce(torch.tensor([value, above or 0], dtype=torch.float64, device=device), "max")
    return {"bytes": int(t[0].item()), "kind": kind, "above_start_bytes": None if above is None else int(t[1].item())}


def run(plan: RunPlan, d: dt.Dist, log: Callable[[str], None]) -> dict[str, Any]:
    """Trains ``plan``; returns the summary (also written to summary.json by rank 0).

    ``result["stopped_by"]`` names the signal that stopped the run early (a checkpoint was
    written); ``result["diverged_at"]`` the step where the loss became non-finite."""
    cfg = plan.cfg
    t0 = time.perf_counter()
    device = d.device(cfg.device)
    if device.type == "cpu":
        torch.set_num_threads(cfg.threads)
    else:
        torch.set_float32_matmul_precision("high")  # TF32 for whatever autocast leaves in fp32
        torch.empty(0, device=device)  # the caching allocator exists only after a first CUDA tensor
        torch.cuda.reset_peak_memory_stats(device)
    # Libraries the run loads lazily (model code, plotting) are loaded first, so that the RSS the
    # run adds above its start counts the model, optimizer, activations and allocator, not imports.
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

    rss_start, rss_reset = dt.rss_bytes(), dt.reset_rss_peak()
    stop = StopSignals().__enter__()
    try:
        return _run(plan, d, log, stop, t0, device, rss_start, rss_reset)
    finally:
        stop.__exit__(None, None, None)


def _run(plan: RunPlan, d: dt.Dist, log: Callable[[str], None], stop: StopSignals, t0: float,
         device: torch.device, rss_start: int, rss_reset: bool) -> dict[str, Any]:
    cfg, corpus, out = plan.cfg, plan.corpus, plan.out
    main = d.is_main
    torch.manual_seed(cfg.seed)
    param_dtype = torch.bfloat16 if cfg.optim == "coat" and cfg.master_weights == "bf16_sr" else torch.float32
    if plan.init is not None:
        from coat.cli.pretrained import load_model

        model = load_model(plan.init, param_dtype).to(device)
    else:
        with device:  # initialized where it trains: seconds instead of minutes for a large model on a GPU
            model = build_model(cfg, corpus.vocab_size, corpus.eos_id)
        model.to(param_dtype)
    if cfg.activations == "fp8":
        import coat

        coat.convert(model, recipe="fp8")
    if cfg.lora:
        model = _add_lora(model, cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if d.enabled:
        dt.shard(model, d, device)
    optimizer = build_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    step_model = torch.compile(model) if cfg.compile else model
    # A graph replays the casts it captured: autocast's cache of cast weights would go stale.
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=not cfg.cuda_graph) \
        if cfg.dtype == "bf16" else nullcontext()
    precision = describe_precision(model, optimizer, cfg)

    # Each rank samples windows from its own contiguous shard of the training tokens.
    lo, hi = len(corpus.train) * d.rank // d.world, len(corpus.train) * (d.rank + 1) // d.world
    train_tokens = corpus.train[lo:hi]
    packed = chat_data.is_packed(train_tokens)  # rows of packed chat examples, not a token stream
    rng = np.random.default_rng(cfg.seed if not d.enabled else [cfg.seed, d.rank])
    held_out = held_out_sets(corpus, cfg, d)

    def evaluate_all() -> dict[str, list[float]]:
        return {name: evaluate(step_model, batches, device, autocast, d) for name, batches in held_out.items()}

    def losses_of(scores: dict[str, list[float]]) -> dict[str, float]:
        return {metric_name(name): sum(v) / len(v) for name, v in scores.items()}
    tokens_per_step = cfg.batch_size * cfg.seq_len * d.world
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf  # inf: measure the norm, never clip
    release = None
    if cfg.release_grads:  # each layer stepped inside backward; clipping by a running norm estimate
        import coat.optim

        release = coat.optim.step_in_backward(optimizer, model, max_grad_norm=max_norm)
    graph_step = None
    if cfg.cuda_graph:
        import coat

        if device.type != "cuda" or d.enabled:
            raise ConfigError("--cuda-graph", "runs on one CUDA device (not on the CPU, not under torchrun)")
        graph_step = coat.CudaGraphStep(model, optimizer, lambda m, batch: lm_loss(m, batch, autocast),
                                        max_grad_norm=max_norm)
    fp8_stats, last_stats = None, None  # --fp8-stats: recorded in each log interval's last step
    if cfg.fp8_stats:
        import coat

        if d.enabled:  # FSDP2 computes with unsharded copies of the parameters: no names, one rank's share
            raise ConfigError("--fp8-stats", "runs in one process (not under torchrun)")
        fp8_stats = coat.fp8_stats(model)
    paths = {"metrics": out / "metrics.jsonl", "config": out / "config.json", "plot": out / "loss.png",
             "summary": out / "summary.json"}

    # train_time and wall_time count from step 0 across resumes (a checkpoint carries them), so the
    # summary's two times cover the same steps; wall_time: the earlier processes' share, to the checkpoint.
    state: dict[str, Any] = {"step": 0, "pending": [], "train_time": 0.0, "wall_time": 0.0, "initial_val": None,
                             "last_val": None, "measured_tokens": 0, "measured_time": 0.0}
    if plan.resume is not None:
        try:
            train_state, rank_state = ckpt.load(plan.resume, model, optimizer, d)
        except ckpt.CheckpointError as e:
            offer = ckpt.offer_earlier(out, int(plan.resume.name.removeprefix("step_")), d.world, ckpt.run_identity(
                json.loads((out / "config.json").read_text()))) if main else ""
            raise ConfigError("--resume", f"checkpoint {plan.resume} cannot be resumed: {e}.{offer}") from e
        scheduler.load_state_dict(train_state.pop("scheduler"))
        release_state = train_state.pop("release", None)
        if release is not None and release_state is not None:
            release.load_state_dict(release_state)
        state |= train_state
        _set_rng_state(rng, rank_state, device)
    resumed = plan.resume is not None
    if main:
        # One id per run, kept across resumes: a checkpoint of any other run is refused on resume.
        run_id = json.loads(paths["config"].read_text()).get("run_id") if resumed else None
        run_info = {"run_id": run_id or uuid.uuid4().hex, "setup": setup_name(cfg), "train": asdict(cfg),
                    "flags": asdict(plan.flags or cfg),
                    "model": model.config.to_dict(),
                    "n_params": n_params, "world_size": d.world, "precision": precision,
                    "init": plan.init.summary() if plan.init else None,
                    "corpus": corpus.info | {"train_tokens": chat_data.n_tokens(corpus.train),
                                             "val_tokens": chat_data.n_tokens(corpus.val),
                                             "vocab_size": corpus.vocab_size},
                    "environment": _environment(device)}
        # Rewritten on resume too: a later resume must see the flags this one changed (--steps).
        ckpt.write_json_atomic(paths["config"], run_info)
        identity = ckpt.run_identity(run_info)  # recorded in each checkpoint; a resume checks it
        metrics = ckpt.MetricsLog(paths["metrics"], upto=state["step"] if resumed else None)
    name = "{:.1f}M".format(n_params / 1e6)
    log(f"[{cfg.recipe}] {name} parameters on {d.world} x {device.type} ({cfg.dtype}); corpus: "
        f"{chat_data.n_tokens(corpus.train):,} train / {chat_data.n_tokens(corpus.val):,} val tokens; "
        f"{cfg.steps} steps of "
        f"{tokens_per_step:,} tokens" + (f"; resuming at step {state['step']}" if resumed else ""))
    log(f"[{cfg.recipe}] FP8: " + ("; ".join(precision["fp8"]) or "nothing"))
    log(f"[{cfg.recipe}] not FP8: " + "; ".join(precision["not_fp8"]))

    def stopped_at(step: int) -> str:
        kept = ckpt.latest(out)
        return f"; the run stopped at step {step}: " + (
            f"free space, then continue it from {kept.name} with: coat train --resume {out}" if kept
            else "it wrote no checkpoint to continue from")

    def record(rec: dict[str, Any]) -> None:
        if main:
            try:
                metrics.write(rec)
            except ckpt.WriteError as e:
                raise ckpt.WriteError(str(e) + stopped_at(rec["step"])) from e

    def save_checkpoint(step: int) -> None:
        pending = torch.stack(state["pending"]).tolist() if state["pending"] else []
        train_state = {k: v for k, v in state.items() if k != "pending"} | {
            "step": step, "pending": pending, "scheduler": scheduler.state_dict(),
            "wall_time": state["wall_time"] + time.perf_counter() - t0,
            "release": release.state_dict() if release is not None else None}
        try:
            path = ckpt.save(out, step, model, optimizer, train_state, _rng_state(rng, device), d, cfg.keep_last,
                             identity if main else None)
        except ckpt.WriteError as e:
            raise ckpt.WriteError(str(e) + stopped_at(step)) from e
        state["pending"] = [torch.tensor(p, device=device) for p in pending]
        log(f"[{cfg.recipe}] checkpoint {path}")

    state["pending"] = [torch.tensor(p, device=device) for p in state["pending"]]
    export_only = resumed and state["step"] >= cfg.steps  # `--resume OUT --save` of a finished run
    if state["initial_val"] is None:
        state["last_scores"] = evaluate_all()
        first = losses_of(state["last_scores"])
        state["initial_val"] = state["last_val"] = first["val_loss"]
        record({"step": 0, "tokens": 0, "lr": scheduler.get_last_lr()[0]} | first)
    stopped_by = diverged_at = None
    rec: dict[str, Any] = {}
    first_step = state["step"] + 1
    first_window: tuple[int, float] | None = None  # this process's first log window: warm-up, not timed
    bar = tqdm(total=cfg.steps, initial=state["step"], disable=cfg.quiet or not main, unit="step",
               dynamic_ncols=True, desc=f"train {cfg.recipe}")
    # Training time runs between marks; evaluation and checkpoints happen outside it.
    seg_time, t_mark = 0.0, time.perf_counter()
    for step in range(first_step, cfg.steps + 1):
        batch = (chat_data.sample_rows(train_tokens, cfg.batch_size, step, [cfg.seed, d.rank]) if packed
                 else sample_batch(train_tokens, cfg.batch_size, cfg.seq_len, rng)).to(device)
        if graph_step is not None:  # the same step: fresh gradients, clipped by their norm, AdamW
            loss = graph_step(batch=batch)
            grad_norm = graph_step.grad_norm
        else:
            logged = step % cfg.log_every == 0 or step % cfg.eval_every == 0 or step == cfg.steps
            with fp8_stats if fp8_stats is not None and logged else nullcontext():
                loss = lm_loss(step_model, batch, autocast)
                loss.backward()
            if release is None:
                params = [p for p in model.parameters() if p.grad is not None]
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
                grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, grad_norm)
            optimizer.step()
            if release is not None:
                grad_norm = release.grad_norm
            optimizer.zero_grad(set_to_none=True)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        state["pending"].append(torch.stack([loss.detach().float(), grad_norm.detach().float()]))
        state["step"] = step
        bar.update()
        is_eval = step % cfg.eval_every == 0 or step == cfg.steps
        if step % cfg.log_every == 0 or is_eval:
            vals = d.all_reduce(torch.stack(state["pending"]).mean(0).double())  # syncs with the device
            train_loss, norm = (vals / d.world).tolist()
            seg_time += time.perf_counter() - t_mark
            window = (len(state["pending"]) * tokens_per_step, seg_time)
            state["train_time"] += seg_time
            if first_window is None:
                first_window = window
            else:
                state["measured_tokens"] += window[0]
                state["measured_time"] += window[1]
            rec = {"step": step, "tokens": step * tokens_per_step, "loss": train_loss, "lr": lr,
                   "grad_norm": norm, "tokens_per_s": window[0] / window[1], "elapsed_s": state["train_time"]}
            if fp8_stats is not None:
                rec["fp8_stats"] = last_stats = fp8_stats.read(reset=True)
            state["last_train"] = train_loss
            if not math.isfinite(train_loss):
                diverged_at = step
                record(rec)
                break
            if is_eval:
                state["last_scores"] = evaluate_all()
                rec |= losses_of(state["last_scores"])
                state["last_val"] = rec["val_loss"]
            record(rec)
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}",
                            val=f"{state['last_val']:.3f}", refresh=False)
            state["pending"] = []
            seg_time, t_mark = 0.0, time.perf_counter()
        periodic = cfg.save_every is not None and (step % cfg.save_every == 0 or step == cfg.steps)
        # A stop during the last step changes nothing: the run is complete.
        stopping = d.any(stop.signum is not None, device) and step < cfg.steps
        if periodic or stopping:
            if state["pending"]:
                torch.stack(state["pending"]).tolist()  # waits for the device: steps end here
            seg_time += time.perf_counter() - t_mark
            save_checkpoint(step)
            t_mark = time.perf_counter()
        if stopping:
            stopped_by = signal.Signals(stop.signum).name if stop.signum else "a signal to another rank"
            break
    if state["measured_time"] == 0 and first_window is not None:  # a single window: it is all there is
        state["measured_tokens"], state["measured_time"] = first_window
    bar.close()

    finished = stopped_by is None and diverged_at is None
    memory = peak_memory(device, d, rss_start, rss_reset)  # of the training, before --save copies the weights
    saved_model = export(plan, model, d, device, log, save_checkpoint, state["step"]) \
        if finished and cfg.save else None
    opt_bytes = d.all_reduce(torch.tensor([optimizer_state_bytes(optimizer)], dtype=torch.float64,
                                          device=device)).item()
    results = {
        "recipe": cfg.recipe, "setup": setup_name(cfg),  # setup: coat estimate / bench --recipe take it as is
        "initial_val_loss": state["initial_val"], "final_val_loss": state["last_val"],
        **final_held_out(state.get("last_scores")),
        "final_train_loss": state.get("last_train", rec.get("loss")), "steps": state["step"], "planned_steps": cfg.steps,
        "tokens": state["step"] * tokens_per_step, "n_params": n_params, "world_size": d.world,
        "tokens_per_s": state["measured_tokens"] / state["measured_time"] if state["measured_time"] else None,
        "peak_memory_bytes": memory["bytes"], "peak_memory_kind": memory["kind"],
        "peak_memory_above_start_bytes": memory["above_start_bytes"],
        "optimizer_state_bytes": int(opt_bytes), "precision": precision, "device": device.type, "dtype": cfg.dtype,
        "train_time_s": state["train_time"], "wall_time_s": state["wall_time"] + time.perf_counter() - t0,
        "wall_time_this_process_s": time.perf_counter() - t0, "finished": finished,
        "stopped_by": stopped_by, "diverged_at": diverged_at, "model_dir": saved_model, "out_dir": str(out),
    } | ({"fp8_stats": last_stats} if fp8_stats is not None else {}) | {k: str(p) for k, p in paths.items()}
    if main:
        metrics.close()
        try:
            plot_loss(paths["metrics"], paths["plot"],
                      title=f"{name} {model.config.model_type}, {cfg.recipe}, {device.type} {cfg.dtype}")
        except OSError as e:
            raise ckpt.WriteError(f"could not write {paths['plot']}: {ckpt.why_failed(e)}") from e
        if export_only and paths["summary"].is_file():  # the training's own figures stay
            results = json.loads(paths["summary"].read_text()) | {"model_dir": saved_model, "finished": True}
        ckpt.write_json_atomic(paths["summary"], results)
    if export_only:
        log(f"[{cfg.recipe}] exported the model of {plan.resume}")
    elif diverged_at is not None:
        log(f"[{cfg.recipe}] the loss became non-finite at step {diverged_at} (training diverged); "
            "lower --lr or raise --warmup-steps")
    elif stopped_by is not None:
        log(f"[{cfg.recipe}] stopped by {stopped_by} at step {state['step']}; continue with: "
            f"coat train --resume {out}")
    else:
        log(f"[{cfg.recipe}] done in {results['wall_time_s']:.0f}s ({results['train_time_s']:.0f}s training)"
            + (f" since step 0, {results['wall_time_this_process_s']:.0f}s in this process" if resumed else "") + ": "
            f"val loss {state['initial_val']:.3f} -> {state['last_val']:.3f}, {results['tokens']:,} tokens")
    if last_stats is not None:
        log(f"[{cfg.recipe}] FP8 operands of the last recorded step, largest losses first (all in summary.json):\n"
            + fp8_stats.table(last_stats, top=10))
    written = [p.name for p in paths.values()] + [n + "/" for n in ("model", ckpt.CHECKPOINTS) if (out / n).is_dir()]
    log(f"[{cfg.recipe}] in {out}: {', '.join(written)}")
    return results
