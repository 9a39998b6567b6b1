"""coat train: train a small Llama from scratch and record its loss curves.

With no arguments it trains on the Python standard library of the running interpreter,
tokenized at byte level, so it works offline on any machine. Sizes default to a run of a
few minutes: a ~10M-parameter model on CPU, a ~110M-parameter one on a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from coat.cli.data import BYTE_VOCAB_SIZE, TOKENIZERS, eval_batches, load_corpus, sample_batch
from coat.cli.plot import plot_loss

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "fp32", "bf16")
# Precision recipe: bf16 is plain PyTorch; fp8 converts the decoder layers to the FP8 precision flow
# (FP8 GEMMs, FP8 saved activations); coat is fp8 plus FP8 optimizer states (--optim coat).
RECIPES = ("bf16", "fp8", "coat")
ACTIVATIONS = ("bf16", "fp8")
OPTIMIZERS = ("torch", "coat")
MASTER_WEIGHTS = ("fp32", "bf16_sr")
SCHEDULES = ("cosine", "linear", "constant")

MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, layers=2, heads=2, intermediate_size=176, max_positions=512),
    "small": dict(hidden_size=384, layers=6, heads=6, intermediate_size=1024, max_positions=1024),
    "base": dict(hidden_size=768, layers=12, heads=12, intermediate_size=3072, max_positions=2048),
}

# A CPU run has to finish in minutes on a laptop; a GPU run can afford a model large
# enough for throughput and memory numbers to mean something, in about the same time.
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": dict(model="small", steps=250, batch_size=8, seq_len=128, lr=2e-3, warmup_steps=25, eval_batches=8),
    "cuda": dict(model="base", steps=1000, batch_size=32, seq_len=1024, lr=6e-4, warmup_steps=100, eval_batches=8),
}


class ConfigError(ValueError):
    """An invalid setting, reported against the command-line flag that sets it."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag


@dataclass
class TrainConfig:
    """Everything a run depends on. ``None`` means "device default" (see ``resolve_config``)."""

    model: str | None = None
    hidden_size: int | None = None
    layers: int | None = None
    heads: int | None = None
    intermediate_size: int | None = None
    max_positions: int | None = None
    steps: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    lr: float | None = None
    min_lr: float | None = None
    warmup_steps: int | None = None
    schedule: str = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    data: str | None = None
    tokenizer: str = "byte"
    vocab_size: int = 4096
    val_fraction: float = 0.05
    eval_every: int | None = None
    eval_batches: int | None = None
    log_every: int = 10
    out: str | None = None
    cache_dir: str | None = None
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    recipe: str = "bf16"
    activations: str = "bf16"
    optim: str = "torch"
    master_weights: str = "fp32"
    compile: bool = False
    threads: int | None = None
    quiet: bool = False


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default_threads() -> int:
    # torch's default ignores the affinity mask (taskset, cpusets): running more threads
    # than usable CPUs makes every step wait on descheduled threads.
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(torch.get_num_threads(), allowed)


def resolve_config(cfg: TrainConfig) -> TrainConfig:
    """Fill every ``None`` from the device defaults and the model preset (idempotent)."""
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    defaults = DEVICE_DEFAULTS.get(device, DEVICE_DEFAULTS["cpu"])
    filled = {k: v for k, v in defaults.items() if getattr(cfg, k) is None}
    cfg = replace(cfg, device=device, **filled)
    preset = MODEL_PRESETS.get(cfg.model, {})
    cfg = replace(cfg, **{k: v for k, v in preset.items() if getattr(cfg, k) is None})
    if cfg.recipe in ("fp8", "coat"):
        cfg = replace(cfg, activations="fp8")
    if cfg.recipe == "coat":
        cfg = replace(cfg, optim="coat")
    return replace(
        cfg,
        min_lr=cfg.lr * 0.1 if cfg.min_lr is None else cfg.min_lr,
        eval_every=max(1, cfg.steps // 10) if cfg.eval_every is None else cfg.eval_every,
        dtype=("bf16" if device == "cuda" else "fp32") if cfg.dtype == "auto" else cfg.dtype,
        threads=_default_threads() if cfg.threads is None else cfg.threads,
        out=cfg.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S")),
    )


def _coat_adamw() -> type:
    try:
        from coat.optim import AdamW
    except ImportError as e:  # the compiled extension may be missing or not built yet
        raise ConfigError("--optim", f"'coat' needs coat.optim.AdamW, which failed to import ({e}); "
                          "build/install coat's extension or use --optim torch") from e
    return AdamW


def validate(cfg: TrainConfig) -> None:
    """Reject settings that cannot work, naming the flag; ``cfg`` must be resolved."""
    choices = {"model": MODEL_PRESETS, "device": DEVICES[1:], "dtype": DTYPES[1:], "recipe": RECIPES,
               "activations": ACTIVATIONS,
               "optim": OPTIMIZERS, "master_weights": MASTER_WEIGHTS, "schedule": SCHEDULES,
               "tokenizer": TOKENIZERS}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(_flag(name), f"invalid choice {getattr(cfg, name)!r} (choose from {', '.join(allowed)})")
    for name in ("hidden_size", "layers", "heads", "intermediate_size", "max_positions", "steps", "batch_size",
                 "seq_len", "eval_every", "eval_batches", "log_every", "threads"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(_flag(name), f"must be a positive integer, got {getattr(cfg, name)}")
    for name in ("lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip"):
        if getattr(cfg, name) < 0:
            raise ConfigError(_flag(name), f"must be >= 0, got {getattr(cfg, name)}")
    if cfg.min_lr > cfg.lr:
        raise ConfigError("--min-lr", f"{cfg.min_lr} is larger than --lr {cfg.lr}")
    if not 0 < cfg.val_fraction < 1:
        raise ConfigError("--val-fraction", f"must be between 0 and 1, got {cfg.val_fraction}")
    if cfg.hidden_size % cfg.heads or (cfg.hidden_size // cfg.heads) % 2:
        raise ConfigError("--heads", f"--hidden-size {cfg.hidden_size} must split into {cfg.heads} heads "
                          "of even size (needed by rotary embeddings)")
    if cfg.seq_len > cfg.max_positions:
        raise ConfigError("--seq-len", f"{cfg.seq_len} exceeds the model's max positions ({cfg.max_positions}); "
                          "lower --seq-len or raise --max-positions")
    if cfg.tokenizer == "bpe" and not 512 <= cfg.vocab_size <= 65536:
        raise ConfigError("--vocab-size", f"must be in [512, 65536] for the bpe tokenizer, got {cfg.vocab_size}")
    if cfg.data is not None and not Path(cfg.data).exists():
        raise ConfigError("--data", f"path does not exist: {cfg.data}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", "cuda requested but torch sees no CUDA device")
    if cfg.optim == "torch" and cfg.master_weights != "fp32":
        raise ConfigError("--master-weights", "only applies to --optim coat (torch.optim.AdamW keeps fp32 weights)")
    if cfg.optim == "coat":
        _coat_adamw()


def build_model(cfg: TrainConfig, vocab_size: int = BYTE_VOCAB_SIZE, eos_id: int | None = None) -> torch.nn.Module:
    """A randomly initialized ``LlamaForCausalLM`` with the configured shape (no download)."""
    # Imported here because transformers takes seconds to import; `coat --help` stays fast.
    from transformers import LlamaConfig, LlamaForCausalLM

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
    return torch.optim.AdamW(groups, fused=params[0].is_cuda, **kwargs)


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Multiplier of ``cfg.lr`` after ``step`` optimizer steps: linear warmup, then decay to min_lr."""
    floor = cfg.min_lr / cfg.lr if cfg.lr else 1.0

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
        return floor + (1 - floor) * decay

    return factor


def lm_loss(model: torch.nn.Module, batch: torch.Tensor, autocast: AbstractContextManager) -> torch.Tensor:
    """Mean next-token cross-entropy of a (B, T+1) batch, computed in fp32."""
    with autocast:
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[torch.Tensor], device: torch.device,
             autocast: AbstractContextManager) -> float:
    model.eval()
    losses = [lm_loss(model, b.to(device), autocast) for b in batches]
    model.train()
    return torch.stack(losses).mean().item()


def _environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
           "transformers": transformers.__version__, "numpy": np.__version__, "cpu_count": os.cpu_count(),
           "coat": getattr(sys.modules.get("coat"), "__version__", None)}
    if device.type == "cuda":
        env |= {"cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(device)}
    return env


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run one training job; returns losses, timings and output paths.

    Raises ``ConfigError`` for settings that cannot work (the CLI turns it into a usage error).
    """
    cfg = resolve_config(cfg)
    validate(cfg)
    log: Callable[[str], None] = (lambda _: None) if cfg.quiet else print
    t0 = time.perf_counter()
    device = torch.device(cfg.device)
    if device.type == "cpu":
        torch.set_num_threads(cfg.threads)
    else:
        torch.set_float32_matmul_precision("high")  # TF32 for whatever autocast leaves in fp32
    try:
        corpus = load_corpus(cfg.data, cfg.tokenizer, cfg.vocab_size, cfg.val_fraction, cfg.cache_dir, log)
    except (FileNotFoundError, ValueError) as e:  # missing or unusable --data
        raise ConfigError("--data", str(e)) from e
    for split, tokens in (("train", corpus.train), ("validation", corpus.val)):
        if len(tokens) <= cfg.seq_len + 1:
            raise ConfigError("--seq-len", f"{cfg.seq_len} is too long for the {split} split ({len(tokens)} tokens)")

    torch.manual_seed(cfg.seed)
    model = build_model(cfg, corpus.vocab_size, corpus.eos_id).to(device)
    if cfg.optim == "coat" and cfg.master_weights == "bf16_sr":
        model = model.to(torch.bfloat16)  # bf16 weights, no master copy: the optimizer rounds stochastically
    if cfg.activations == "fp8":
        import coat

        coat.convert(model, recipe="fp8")
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = build_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    step_model = torch.compile(model) if cfg.compile else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cfg.dtype == "bf16" else nullcontext()

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"metrics": out / "metrics.jsonl", "config": out / "config.json", "plot": out / "loss.png",
             "summary": out / "summary.json"}
    run_info = {"train": asdict(cfg), "model": model.config.to_dict(), "n_params": n_params,
                "corpus": corpus.info | {"train_tokens": len(corpus.train), "val_tokens": len(corpus.val),
                                         "vocab_size": corpus.vocab_size},
                "environment": _environment(device)}
    paths["config"].write_text(json.dumps(run_info, indent=2, default=str) + "\n")
    log(f"Model: {n_params / 1e6:.1f}M parameters on {device} ({cfg.dtype}); "
        f"corpus: {len(corpus.train):,} train / {len(corpus.val):,} val tokens")

    val_set = eval_batches(corpus.val, cfg.eval_batches, cfg.batch_size, cfg.seq_len)
    rng = np.random.default_rng(cfg.seed)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf  # inf: measure the norm, never clip
    with open(paths["metrics"], "w") as metrics:

        def record(rec: dict[str, Any]) -> None:
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()  # a crashed or interrupted run still leaves its curve behind

        initial_val = evaluate(step_model, val_set, device, autocast)
        record({"step": 0, "tokens": 0, "lr": scheduler.get_last_lr()[0], "val_loss": initial_val})
        train_start = t_log = time.perf_counter()
        pending: list[torch.Tensor] = []  # per-step (loss, grad norm), synced only when logged
        rec: dict[str, Any] = {}
        last_val = initial_val
        bar = tqdm(total=cfg.steps, disable=cfg.quiet, unit="step", dynamic_ncols=True, desc="train")
        for step in range(1, cfg.steps + 1):
            loss = lm_loss(step_model, sample_batch(corpus.train, cfg.batch_size, cfg.seq_len, rng).to(device),
                           autocast)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            pending.append(torch.stack([loss.detach(), grad_norm.detach()]))
            bar.update()
            is_eval = step % cfg.eval_every == 0 or step == cfg.steps
            if step % cfg.log_every and not is_eval:
                continue
            train_loss, norm = torch.stack(pending).mean(0).tolist()
            now = time.perf_counter()
            rec = {"step": step, "tokens": step * tokens_per_step, "loss": train_loss, "lr": lr,
                   "grad_norm": norm, "tokens_per_s": len(pending) * tokens_per_step / (now - t_log),
                   "elapsed_s": now - train_start}
            if is_eval:
                rec["val_loss"] = last_val = evaluate(step_model, val_set, device, autocast)
            record(rec)
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}",
                            val=f"{last_val:.3f}", refresh=False)
            pending.clear()
            t_log = time.perf_counter()  # excludes evaluation from the next tokens/s figure
        bar.close()

    plot_loss(paths["metrics"], paths["plot"],
              title=f"{n_params / 1e6:.1f}M Llama, {device.type} {cfg.dtype}, {cfg.optim} AdamW")
    results = {"initial_val_loss": initial_val, "final_val_loss": rec["val_loss"], "final_train_loss": rec["loss"],
               "steps": cfg.steps, "tokens": cfg.steps * tokens_per_step, "n_params": n_params,
               "train_time_s": time.perf_counter() - train_start, "wall_time_s": time.perf_counter() - t0,
               "out_dir": str(out)} | {k: str(p) for k, p in paths.items()}
    paths["summary"].write_text(json.dumps(results, indent=2) + "\n")
    log(f"\nDone in {results['wall_time_s']:.0f}s ({results['train_time_s']:.0f}s training): "
        f"val loss {initial_val:.3f} -> {results['final_val_loss']:.3f} (train {results['final_train_loss']:.3f}), "
        f"{results['tokens']:,} tokens")
    for key in ("metrics", "config", "plot", "summary"):
        log(f"  {key + ':':9s}{paths[key]}")
    return results


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``train`` subcommand to the ``coat`` parser."""
    p = subparsers.add_parser("train", help="train a small Llama from scratch and plot its loss",
                              description=__doc__)
    cpu, gpu = DEVICE_DEFAULTS["cpu"], DEVICE_DEFAULTS["cuda"]
    n, x = dict(type=int, metavar="N"), dict(type=float, metavar="X")

    def by_device(name: str) -> str:
        return f"(default: {cpu[name]} on CPU, {gpu[name]} on GPU)"

    def from_preset(name: str) -> str:
        return "(default: from --model: " + ", ".join(f"{k} {v[name]}" for k, v in MODEL_PRESETS.items()) + ")"

    g = p.add_argument_group("model")
    g.add_argument("--model", choices=list(MODEL_PRESETS), help="model size preset " + by_device("model"))
    g.add_argument("--hidden-size", **n, help=from_preset("hidden_size"))
    g.add_argument("--layers", **n, help=from_preset("layers"))
    g.add_argument("--heads", **n, help=from_preset("heads"))
    g.add_argument("--intermediate-size", **n, help="MLP width " + from_preset("intermediate_size"))
    g.add_argument("--max-positions", **n, help="longest sequence " + from_preset("max_positions"))

    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="PATH", help="a text file, a folder of text files, or a token array (.npy, "
                   "or .bin of uint16) (default: the Python standard library source)")
    g.add_argument("--tokenizer", choices=TOKENIZERS, default="byte",
                   help="byte: 256 byte values + EOS; bpe: byte-level BPE trained on the training files")
    g.add_argument("--vocab-size", **n, default=4096, help="vocabulary size of --tokenizer bpe")
    g.add_argument("--val-fraction", **x, default=0.05, help="held-out share (last files, else last tokens)")
    g.add_argument("--cache-dir", metavar="DIR", help="tokenized corpus cache (default: ~/.cache/coat/corpus)")

    g = p.add_argument_group("optimization")
    g.add_argument("--steps", **n, help="optimizer steps " + by_device("steps"))
    g.add_argument("--batch-size", **n, help="sequences per step " + by_device("batch_size"))
    g.add_argument("--seq-len", **n, help="tokens per sequence " + by_device("seq_len"))
    g.add_argument("--lr", **x, help="peak learning rate " + by_device("lr"))
    g.add_argument("--min-lr", **x, help="final learning rate (default: lr / 10)")
    g.add_argument("--warmup-steps", **n, help="linear warmup steps " + by_device("warmup_steps"))
    g.add_argument("--schedule", choices=SCHEDULES, default="cosine", help="decay after warmup")
    g.add_argument("--weight-decay", **x, default=0.1, help="AdamW weight decay (matrices only)")
    g.add_argument("--beta1", **x, default=0.9, help="AdamW beta1")
    g.add_argument("--beta2", **x, default=0.95, help="AdamW beta2")
    g.add_argument("--grad-clip", **x, default=1.0, help="max gradient norm (0 disables clipping)")
    g.add_argument("--optim", choices=OPTIMIZERS, default="torch",
                   help="torch: torch.optim.AdamW; coat: coat.optim.AdamW (needs the built extension)")
    g.add_argument("--master-weights", choices=MASTER_WEIGHTS, default="fp32",
                   help="master weight format of --optim coat (bf16_sr: bf16 with stochastic rounding)")

    g = p.add_argument_group("precision and runtime")
    g.add_argument("--recipe", choices=RECIPES, default="bf16",
                   help="bf16: the plain PyTorch baseline; fp8: FP8 GEMMs and FP8 saved activations "
                        "(implies --activations fp8); coat: fp8 plus FP8 optimizer states (implies --optim coat)")
    g.add_argument("--activations", choices=ACTIVATIONS, default="bf16",
                   help="fp8: decoder layers converted with coat.convert (FP8 GEMMs, FP8 saved activations)")
    g.add_argument("--dtype", choices=DTYPES, default="auto", help="autocast dtype (auto: bf16 on GPU, fp32 on CPU)")
    g.add_argument("--device", choices=DEVICES, default="auto", help="auto: cuda when available")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--threads", **n, help="CPU threads (default: torch's, capped at the CPUs this process may use)")
    g.add_argument("--seed", **n, default=0, help="seeds model init and batch sampling")

    g = p.add_argument_group("evaluation and output")
    g.add_argument("--eval-every", **n, help="steps between validation evaluations (default: steps / 10)")
    g.add_argument("--eval-batches", **n, help="validation batches per evaluation " + by_device("eval_batches"))
    g.add_argument("--log-every", **n, default=10, help="steps per metrics.jsonl record")
    g.add_argument("--out", metavar="DIR", help="output folder (default: runs/<timestamp>)")
    g.add_argument("--quiet", action="store_true", help="no progress bar or messages")
    p.set_defaults(handler=lambda args: _run(args, p))


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    try:
        train(cfg)
    except ConfigError as e:
        parser.error(str(e))
    except KeyboardInterrupt:
        print("\ninterrupted; metrics written so far are kept", file=sys.stderr)
        return 130
    return 0
