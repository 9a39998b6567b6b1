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
from contextlib import nullcontext
from dataclasses import asdict
from typing import Any, Callable

import numpy as np
import torch
from tqdm import tqdm

from coat.cli import chat_data
from coat.cli import checkpoint as ckpt
from coat.cli import distributed_train as dt
from coat.cli.config import COAT_OPTIMIZERS, ConfigError, fp8_recipe, lr_lambda, setup_name
from coat.cli.data import sample_batch
from coat.cli.model import (add_lora, add_side, build_model, build_optimizer, describe_precision, evaluate, final_held_out,
                            held_out_sets, lm_loss, metric_name, optimizer_state_bytes)
from coat.cli.export import export
from coat.cli.plan import RunPlan
from coat.cli.plot import plot_loss
from coat.integrations import fp8_gather


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
        training = _Training(plan, d, log, t0, device)
        log_start(training)
        stopped_by, diverged_at = training.loop(stop)
        return training.finish(stopped_by, diverged_at, rss_start, rss_reset)
    finally:
        stop.__exit__(None, None, None)


def log_start(t: "_Training") -> None:
    cfg, corpus = t.cfg, t.plan.corpus
    t.log(f"[{cfg.recipe}] {t.n_params / 1e6:.1f}M parameters on {t.d.world} x {t.device.type} ({cfg.dtype}); "
          f"corpus: {chat_data.n_tokens(corpus.train):,} train / {chat_data.n_tokens(corpus.val):,} val tokens; "
          f"{cfg.steps} steps of {t.tokens_per_step:,} tokens"
          + (f"; FSDP2 with {t.fsdp_unit} decoder layer{'s' if t.fsdp_unit != 1 else ''} per unit"
             + (", FP8 all-gather" if fp8_gather.installed_units(t.model) else "") if t.d.enabled else "")
          + (f"; resuming at step {t.state['step']}" if t.resumed else ""))
    t.log(f"[{cfg.recipe}] FP8: " + ("; ".join(t.precision["fp8"]) or "nothing"))
    t.log(f"[{cfg.recipe}] not FP8: " + "; ".join(t.precision["not_fp8"]))


class _Training:
    """One run's pieces and its state between steps. Built in ``__init__`` (model, optimizer, the
    step's variants, a resumed checkpoint, config.json); ``loop`` trains; ``finish`` exports and
    writes the summary. ``state`` is what a checkpoint carries (train_time and wall_time count from
    step 0 across resumes, so the summary's two times cover the same steps)."""

    def __init__(self, plan: RunPlan, d: dt.Dist, log: Callable[[str], None], t0: float, device: torch.device) -> None:
        self.plan, self.cfg, self.d, self.log, self.t0, self.device = plan, plan.cfg, d, log, t0, device
        self.out = plan.out
        self.paths = {"metrics": self.out / "metrics.jsonl", "config": self.out / "config.json",
                      "plot": self.out / "loss.png", "summary": self.out / "summary.json"}
        self._build_model()
        self._build_step()
        cfg, corpus = self.cfg, plan.corpus
        # Each rank samples windows from its own contiguous shard of the training tokens.
        lo, hi = len(corpus.train) * d.rank // d.world, len(corpus.train) * (d.rank + 1) // d.world
        self.train_tokens = corpus.train[lo:hi]
        self.packed = chat_data.is_packed(self.train_tokens)  # rows of packed chat examples, not a token stream
        self.rng = np.random.default_rng(cfg.seed if not d.enabled else [cfg.seed, d.rank])
        self.held_out = held_out_sets(corpus, cfg, d)
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * d.world
        self.state: dict[str, Any] = {"step": 0, "pending": [], "train_time": 0.0, "wall_time": 0.0,
                                      "initial_val": None, "last_val": None, "measured_tokens": 0, "measured_time": 0.0}
        self.resumed = plan.resume is not None
        if self.resumed:
            self._restore()
        if d.is_main:
            self._write_run_info()
        self.last_stats = None  # --fp8-stats: the last recorded step's statistics

    # ---- building ----------------------------------------------------------------------------

    def _build_model(self) -> None:
        cfg, plan, device = self.cfg, self.plan, self.device
        torch.manual_seed(cfg.seed)
        param_dtype = torch.bfloat16 if cfg.optim in COAT_OPTIMIZERS and cfg.master_weights == "bf16_sr" else torch.float32
        if plan.init is not None:
            from coat.cli.pretrained import load_model

            model = load_model(plan.init, param_dtype).to(device)
        else:
            with device:  # initialized where it trains: seconds instead of minutes for a large model on a GPU
                model = build_model(cfg, plan.corpus.vocab_size, plan.corpus.eos_id)
            model.to(param_dtype)
        if cfg.activations == "fp8":
            import coat

            coat.convert(model, recipe=fp8_recipe(cfg))
        if cfg.lora:
            model = add_lora(model, cfg)
        if cfg.side_tuning:  # the frozen base in FP8 beside the side network (coat.SideTuned)
            model = add_side(model, cfg)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.fsdp_unit = None  # decoder layers per FSDP2 unit, as resolved (--fsdp-unit auto)
        if self.d.enabled:
            if cfg.optim == "snsm":  # refused before sharding: SubsetNormSM refuses DTensor parameters
                raise ConfigError("--optim", "snsm does not support FSDP2 (a shard's rows or columns are not the "
                                  "matrix's: its subset norms and SVD would be the shard's); use --optim coat there")
            self.fsdp_unit = cfg.fsdp_unit if cfg.fsdp_unit != "auto" else \
                dt.auto_unit(model, setup_name(cfg), (cfg.batch_size, cfg.seq_len), device, cfg.fp8_all_gather)
            dt.shard(model, self.d, device, self.fsdp_unit, cfg.fp8_all_gather)
        self.model = model
        self.optimizer = build_optimizer(model, cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.step_model = torch.compile(model) if cfg.compile else model
        # A graph replays the casts it captured: autocast's cache of cast weights would go stale.
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=not cfg.cuda_graph) \
            if cfg.dtype == "bf16" else nullcontext()
        self.precision = describe_precision(model, self.optimizer, cfg)

    def _build_step(self) -> None:
        """The step's variants: gradient release, a CUDA-graph step, FP8 statistics."""
        cfg, model = self.cfg, self.model
        self.max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf  # inf: measure the norm, never clip
        self.release = self.graph_step = self.fp8_stats = None
        if cfg.release_grads:  # each layer stepped inside backward; clipping by a running norm estimate
            import coat.optim

            try:
                self.release = coat.optim.step_in_backward(self.optimizer, model, max_grad_norm=self.max_norm)
            except ValueError as e:  # e.g. DDP, FSDP1, nonfinite='raise'
                raise ConfigError("--release-grads", str(e)) from None
        if cfg.cuda_graph:
            import coat

            if self.device.type != "cuda" or self.d.enabled:
                raise ConfigError("--cuda-graph", "runs on one CUDA device (not on the CPU, not under torchrun)")
            # unpadded: (B, T+1) token batches; packed chat data (refused with --cuda-graph) masks across examples
            self.graph_step = coat.CudaGraphStep(model, self.optimizer,
                                                 lambda m, batch: lm_loss(m, batch, self.autocast),
                                                 max_grad_norm=self.max_norm,
                                                 unpadded=not chat_data.is_packed(self.plan.corpus.train))
        if cfg.fp8_stats:
            import coat

            if self.d.enabled:  # FSDP2 computes with unsharded copies of the parameters: no names, one rank's share
                raise ConfigError("--fp8-stats", "runs in one process (not under torchrun)")
            self.fp8_stats = coat.fp8_stats(model)

    def _restore(self) -> None:
        plan, d = self.plan, self.d
        try:
            train_state, rank_state = ckpt.load(plan.resume, self.model, self.optimizer, d)
        except ckpt.CheckpointError as e:
            offer = ckpt.offer_earlier(self.out, int(plan.resume.name.removeprefix("step_")), d.world, ckpt.run_identity(
                json.loads(self.paths["config"].read_text()))) if d.is_main else ""
            raise ConfigError("--resume", f"checkpoint {plan.resume} cannot be resumed: {e}.{offer}") from e
        self.scheduler.load_state_dict(train_state.pop("scheduler"))
        release_state = train_state.pop("release", None)
        if self.release is not None and release_state is not None:
            self.release.load_state_dict(release_state)
        self.state |= train_state
        _set_rng_state(self.rng, rank_state, self.device)

    def _write_run_info(self) -> None:
        cfg, plan, corpus = self.cfg, self.plan, self.plan.corpus
        # One id per run, kept across resumes: a checkpoint of any other run is refused on resume.
        run_id = json.loads(self.paths["config"].read_text()).get("run_id") if self.resumed else None
        run_info = {"run_id": run_id or uuid.uuid4().hex, "setup": setup_name(cfg), "train": asdict(cfg),
                    "flags": asdict(plan.flags or cfg), "model": self.model.config.to_dict(),
                    "n_params": self.n_params, "world_size": self.d.world, "fsdp_unit": self.fsdp_unit,
                    "precision": self.precision,
                    "init": plan.init.summary() if plan.init else None,
                    "corpus": corpus.info | {"train_tokens": chat_data.n_tokens(corpus.train),
                                             "val_tokens": chat_data.n_tokens(corpus.val),
                                             "vocab_size": corpus.vocab_size},
                    "environment": _environment(self.device)}
        # Rewritten on resume too: a later resume must see the flags this one changed (--steps).
        ckpt.write_json_atomic(self.paths["config"], run_info)
        self.identity = ckpt.run_identity(run_info)  # recorded in each checkpoint; a resume checks it
        self.metrics = ckpt.MetricsLog(self.paths["metrics"], upto=self.state["step"] if self.resumed else None)

    # ---- what steps and evaluations leave behind ---------------------------------------------------

    def evaluate_all(self) -> dict[str, list[float]]:
        return {name: evaluate(self.step_model, batches, self.device, self.autocast, self.d)
                for name, batches in self.held_out.items()}

    def _stopped_at(self, step: int) -> str:
        kept = ckpt.latest(self.out)
        return f"; the run stopped at step {step}: " + (
            f"free space, then continue it from {kept.name} with: coat train --resume {self.out}" if kept
            else "it wrote no checkpoint to continue from")

    def record(self, rec: dict[str, Any]) -> None:
        if self.d.is_main:
            try:
                self.metrics.write(rec)
            except ckpt.WriteError as e:
                raise ckpt.WriteError(str(e) + self._stopped_at(rec["step"])) from e

    def save_checkpoint(self, step: int) -> None:
        state = self.state
        pending = torch.stack(state["pending"]).tolist() if state["pending"] else []
        train_state = {k: v for k, v in state.items() if k != "pending"} | {
            "step": step, "pending": pending, "scheduler": self.scheduler.state_dict(),
            "wall_time": state["wall_time"] + time.perf_counter() - self.t0,
            "release": self.release.state_dict() if self.release is not None else None}
        try:
            path = ckpt.save(self.out, step, self.model, self.optimizer, train_state, _rng_state(self.rng, self.device),
                             self.d, self.cfg.keep_last, self.identity if self.d.is_main else None)
        except ckpt.WriteError as e:
            raise ckpt.WriteError(str(e) + self._stopped_at(step)) from e
        state["pending"] = [torch.tensor(p, device=self.device) for p in pending]
        self.log(f"[{self.cfg.recipe}] checkpoint {path}")

    # ---- training ----------------------------------------------------------------------------

    def step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; the loss and the gradient norm, on the device (not synced)."""
        cfg, d = self.cfg, self.d
        batch = (chat_data.sample_rows(self.train_tokens, cfg.batch_size, step, [cfg.seed, d.rank]) if self.packed
                 else sample_batch(self.train_tokens, cfg.batch_size, cfg.seq_len, self.rng)).to(self.device)
        if self.graph_step is not None:  # the same step: fresh gradients, clipped by their norm, AdamW
            return self.graph_step(batch=batch), self.graph_step.grad_norm
        logged = step % cfg.log_every == 0 or step % cfg.eval_every == 0 or step == cfg.steps
        with self.fp8_stats if self.fp8_stats is not None and logged else nullcontext():
            loss = lm_loss(self.step_model, batch, self.autocast)
            loss.backward()
        if self.release is None:
            params = [p for p in self.model.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, grad_norm)
        self.optimizer.step()
        if self.release is not None:
            grad_norm = self.release.grad_norm
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm

    def _log_window(self, step: int, lr: float, seg_time: float, is_eval: bool) -> dict[str, Any]:
        """The metrics record of the steps since the last one (syncs with the device)."""
        state, d = self.state, self.d
        vals = d.all_reduce(torch.stack(state["pending"]).mean(0).double())
        train_loss, norm = (vals / d.world).tolist()
        window = (len(state["pending"]) * self.tokens_per_step, seg_time)
        state["train_time"] += seg_time
        if self.first_window is None:  # this process's first log window: warm-up, not timed
            self.first_window = window
        else:
            state["measured_tokens"] += window[0]
            state["measured_time"] += window[1]
        rec = {"step": step, "tokens": step * self.tokens_per_step, "loss": train_loss, "lr": lr,
               "grad_norm": norm, "tokens_per_s": window[0] / window[1], "elapsed_s": state["train_time"]}
        if self.fp8_stats is not None:
            rec["fp8_stats"] = self.last_stats = self.fp8_stats.read(reset=True)
        state["last_train"] = train_loss
        if is_eval and math.isfinite(train_loss):
            state["last_scores"] = self.evaluate_all()
            rec |= _losses_of(state["last_scores"])
            state["last_val"] = rec["val_loss"]
        return rec

    def loop(self, stop: StopSignals) -> tuple[str | None, int | None]:
        """Trains to --steps; returns what stopped it early: (the signal's name, the step the loss
        became non-finite), both None for a finished run."""
        cfg, state, d = self.cfg, self.state, self.d
        state["pending"] = [torch.tensor(p, device=self.device) for p in state["pending"]]
        self.export_only = self.resumed and state["step"] >= cfg.steps  # `--resume OUT --save` of a finished run
        if state["initial_val"] is None:
            state["last_scores"] = self.evaluate_all()
            first = _losses_of(state["last_scores"])
            state["initial_val"] = state["last_val"] = first["val_loss"]
            self.record({"step": 0, "tokens": 0, "lr": self.scheduler.get_last_lr()[0]} | first)
        self.first_window = None
        self.last_rec: dict[str, Any] = {}
        bar = tqdm(total=cfg.steps, initial=state["step"], disable=cfg.quiet or not d.is_main, unit="step",
                   dynamic_ncols=True, desc=f"train {cfg.recipe}")
        # Training time runs between marks; evaluation and checkpoints happen outside it.
        seg_time, t_mark = 0.0, time.perf_counter()
        try:
            for step in range(state["step"] + 1, cfg.steps + 1):
                loss, grad_norm = self.step(step)
                lr = self.scheduler.get_last_lr()[0]
                self.scheduler.step()
                state["pending"].append(torch.stack([loss.detach().float(), grad_norm.detach().float()]))
                state["step"] = step
                bar.update()
                is_eval = step % cfg.eval_every == 0 or step == cfg.steps
                if step % cfg.log_every == 0 or is_eval:
                    seg_time += time.perf_counter() - t_mark
                    rec = self.last_rec = self._log_window(step, lr, seg_time, is_eval)
                    self.record(rec)
                    if not all(math.isfinite(v) for k, v in rec.items() if k == "loss" or k.startswith("val_")):
                        return None, step  # the train loss, or a held-out loss after this step's update
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}",
                                    val=f"{state['last_val']:.3f}", refresh=False)
                    state["pending"] = []
                    seg_time, t_mark = 0.0, time.perf_counter()
                periodic = cfg.save_every is not None and (step % cfg.save_every == 0 or step == cfg.steps)
                # A stop during the last step changes nothing: the run is complete.
                stopping = d.any(stop.signum is not None, self.device) and step < cfg.steps
                if periodic or stopping:
                    if state["pending"]:
                        torch.stack(state["pending"]).tolist()  # waits for the device: steps end here
                    seg_time += time.perf_counter() - t_mark
                    self.save_checkpoint(step)
                    t_mark = time.perf_counter()
                if stopping:
                    return (signal.Signals(stop.signum).name if stop.signum else "a signal to another rank"), None
            return None, None
        finally:
            if state["measured_time"] == 0 and self.first_window is not None:  # a single window: all there is
                state["measured_tokens"], state["measured_time"] = self.first_window
            bar.close()

    # ---- the end -----------------------------------------------------------------------------

    def finish(self, stopped_by: str | None, diverged_at: int | None, rss_start: int,
               rss_reset: bool) -> dict[str, Any]:
        """Exports a finished run (--save), writes summary.json and the plot, logs how it ended."""
        cfg, state, d, device = self.cfg, self.state, self.d, self.device
        finished = stopped_by is None and diverged_at is None
        export_only = self.export_only
        memory = peak_memory(device, d, rss_start, rss_reset)  # of the training, before --save copies the weights
        saved_model = export(self.plan, self.model, d, device, self.log, self.save_checkpoint, state["step"]) \
            if finished and cfg.save else None
        opt_bytes = d.all_reduce(torch.tensor([optimizer_state_bytes(self.optimizer)], dtype=torch.float64,
                                              device=device)).item()
        now = time.perf_counter()
        results = {
            "recipe": cfg.recipe, "setup": setup_name(cfg),  # setup: coat estimate / bench --recipe take it as is
            "initial_val_loss": state["initial_val"], "final_val_loss": state["last_val"],
            **final_held_out(state.get("last_scores")),
            "final_train_loss": state.get("last_train", self.last_rec.get("loss")), "steps": state["step"],
            "planned_steps": cfg.steps, "tokens": state["step"] * self.tokens_per_step, "n_params": self.n_params,
            "world_size": d.world,
            "tokens_per_s": state["measured_tokens"] / state["measured_time"] if state["measured_time"] else None,
            "peak_memory_bytes": memory["bytes"], "peak_memory_kind": memory["kind"],
            "peak_memory_above_start_bytes": memory["above_start_bytes"],
            "optimizer_state_bytes": int(opt_bytes), "precision": self.precision, "device": device.type,
            "dtype": cfg.dtype, "train_time_s": state["train_time"], "wall_time_s": state["wall_time"] + now - self.t0,
            "wall_time_this_process_s": now - self.t0, "finished": finished,
            "stopped_by": stopped_by, "diverged_at": diverged_at, "model_dir": saved_model, "out_dir": str(self.out),
        } | ({"fp8_stats": self.last_stats} if self.fp8_stats is not None else {}) \
            | {k: str(p) for k, p in self.paths.items()}
        if d.is_main:
            results = self._write_summary(results, export_only, saved_model)
        self._log_end(results, export_only)
        return results

    def _write_summary(self, results: dict[str, Any], export_only: bool, saved_model: str | None) -> dict[str, Any]:
        self.metrics.close()
        paths, cfg = self.paths, self.cfg
        try:
            plot_loss(paths["metrics"], paths["plot"], title=f"{self.n_params / 1e6:.1f}M "
                      f"{self.model.config.model_type}, {cfg.recipe}, {self.device.type} {cfg.dtype}")
        except OSError as e:
            raise ckpt.WriteError(f"could not write {paths['plot']}: {ckpt.why_failed(e)}") from e
        if export_only and paths["summary"].is_file():  # the training's own figures stay
            results = json.loads(paths["summary"].read_text()) | {"model_dir": saved_model, "finished": True}
        ckpt.write_json_atomic(paths["summary"], results)
        return results

    def _log_end(self, results: dict[str, Any], export_only: bool) -> None:
        cfg, state, log, out = self.cfg, self.state, self.log, self.out
        if export_only:
            log(f"[{cfg.recipe}] exported the model of {self.plan.resume}")
        elif results["diverged_at"] is not None:
            log(f"[{cfg.recipe}] the loss became non-finite at step {results['diverged_at']} (training diverged); "
                "lower --lr or raise --warmup-steps")
        elif results["stopped_by"] is not None:
            log(f"[{cfg.recipe}] stopped by {results['stopped_by']} at step {state['step']}; continue with: "
                f"coat train --resume {out}")
        else:
            log(f"[{cfg.recipe}] done in {results['wall_time_s']:.0f}s ({results['train_time_s']:.0f}s training)"
                + (f" since step 0, {results['wall_time_this_process_s']:.0f}s in this process" if self.resumed
                   else "") + ": "
                f"val loss {state['initial_val']:.3f} -> {state['last_val']:.3f}, {results['tokens']:,} tokens")
        if self.last_stats is not None:
            log(f"[{cfg.recipe}] FP8 operands of the last recorded step, largest losses first (all in summary.json):\n"
                + self.fp8_stats.table(self.last_stats, top=10))
        written = [p.name for p in self.paths.values()] + [n + "/" for n in ("model", "adapter", "side", ckpt.CHECKPOINTS)
                                                          if (out / n).is_dir()]
        log(f"[{cfg.recipe}] in {out}: {', '.join(written)}")


def _losses_of(scores: dict[str, list[float]]) -> dict[str, float]:
    return {metric_name(name): sum(v) / len(v) for name, v in scores.items()}
