"""The settings of a ``coat train`` run: defaults, resolution and validation (no side effects)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Callable

import torch

from coat import recipes
from coat.cli.data import TOKENIZERS

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "fp32", "bf16")
# Precision recipes, as (activations, optimizer): bf16 is plain PyTorch; fp8 converts the decoder
# layers to the FP8 precision flow (FP8 GEMMs, FP8 saved activations); coat is fp8 plus FP8
# optimizer states. These are the runs (and the folders of a comparison); --recipe also takes the
# setup names of coat.recipes, which ``expand_setup`` turns into one of these plus flags, and a
# run is recorded under its setup name (``setup_name``).
RECIPE_PARTS = {"bf16": ("bf16", "torch"), "fp8": ("fp8", "torch"), "coat": ("fp8", "coat"),
                "coat4bit": ("fp8", "coat4bit"), "snsm": ("fp8", "snsm")}
RECIPES = tuple(RECIPE_PARTS)
DEFAULT_RECIPE = "coat"
BASELINE_RECIPE = "bf16"
ACTIVATIONS = ("bf16", "fp8")
#: torch: torch.optim.AdamW; coat: coat.optim.AdamW (FP8 states); coat4bit: coat.optim.AdamW4bit (4-bit states);
#: snsm: coat.optim.SubsetNormSM (Subset-Norm + Subspace-Momentum on the matrices, FP8 AdamW on the rest).
OPTIMIZERS = ("torch", "coat", "coat4bit", "snsm")
#: The optimizers of coat: --master-weights and --release-grads apply to them.
COAT_OPTIMIZERS = ("coat", "coat4bit", "snsm")
MASTER_WEIGHTS = ("fp32", "bf16_sr")
#: --optim snsm's projection refresh (coat.optim.SubsetNormSM's proj_type).
SNSM_PROJ = ("svd", "randomized")
from coat.nn.recipe import GRANULARITIES as FP8_GRANULARITIES  # noqa: E402  (the FP8 layers' scaling choices)
from coat.nn.recipe import Fp8Recipe  # noqa: E402
from coat.optim._state4 import V_SCALINGS  # noqa: E402  (--v-scaling: coat.optim.AdamW4bit's v_scaling)

#: The FP8 layers' output-gradient formats (--fp8-grad-format).
FP8_GRAD_FORMATS = ("e5m2", "e4m3")
SCHEDULES = ("cosine", "linear", "constant")
MAX_SEED = 2**32 - 1
#: Flags that may differ from the original run when resuming it (any other flag given must
#: repeat the run's value). A new --steps of a cosine or linear schedule continues the decay from
#: the lr at the resume point (coat.cli.train's ``_continue_schedule``).
RESUME_OVERRIDES = ("steps", "save_every", "keep_last", "save", "quiet", "threads", "cache_dir", "fp8_stats",
                    "fsdp_unit", "fp8_all_gather")
#: What a checkpoint's state belongs to, beyond its run id and model (coat.cli.checkpoint.run_identity):
#: these flags, and the later ones only where away from their default (older checkpoints lack them).
IDENTITY_FLAGS = ("recipe", "activations", "optim", "master_weights", "lora", "lora_targets", "release_grads")
LATER_IDENTITY_FLAGS = ("side_tuning", "snsm_proj", "fp8_granularity", "fp8_grad_format", "fp8_fast_accum", "dre",
                        "v_scaling")
MODEL_FLAGS = ("model", "hidden_size", "layers", "heads", "intermediate_size", "max_positions")

MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, layers=2, heads=2, intermediate_size=176, max_positions=512),
    "mini": dict(hidden_size=256, layers=4, heads=4, intermediate_size=688, max_positions=1024),
    "small": dict(hidden_size=384, layers=6, heads=6, intermediate_size=1024, max_positions=1024),
    "base": dict(hidden_size=768, layers=12, heads=12, intermediate_size=3072, max_positions=2048),
    # 354M parameters: the quality study's setup C (benchmarks/RESULTS.md section 26)
    "medium": dict(hidden_size=1536, layers=12, heads=12, intermediate_size=4352, max_positions=2048),
    "large": dict(hidden_size=2048, layers=12, heads=16, intermediate_size=5632, max_positions=2048),
}

# CPU: both recipes of the default --compare run finish in a few minutes on 2 cores (the FP8
# path runs the C++ reference kernels there, ~3x slower than BF16). GPU: a 0.6B model with
# 16k-token steps, where FP8 GEMMs pay off; 600 steps are 9.8M tokens per recipe, under a tenth
# of one pass over the built-in corpus, so the validation loss measures generalization, not
# memorization; estimated at 2-3 minutes per recipe on one H100.
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": dict(model="mini", steps=150, batch_size=8, seq_len=128, lr=2e-3, warmup_steps=15, eval_batches=4),
    "cuda": dict(model="large", steps=600, batch_size=8, seq_len=2048, lr=3e-4, warmup_steps=60, eval_batches=8),
}
# Weight decay and beta2 by optimizer: AdamW's (the usual LM pretraining values) for torch, coat
# and coat4bit; SubsetNormSM's own paper and reference code train with no weight decay and beta2
# 0.999 (its learning rate, ~10x AdamW's, is --lr's to give). AdamW's decay at SN-SM's 10x rate
# would pull weights toward zero 10x harder.
OPTIM_DEFAULTS: dict[str, dict[str, float]] = {
    "adamw": dict(weight_decay=0.1, beta2=0.95),
    "snsm": dict(weight_decay=0.0, beta2=0.999),
}
# Fine-tuning a pretrained model (--init) wants a far smaller step size than training from scratch.
INIT_LR = 3e-5
# LoRA (--lora) trains a few small matrices from zero: the usual PEFT rate, not a full fine-tune's.
LORA_LR = 2e-4
# Side tuning (--side-tuning) trains a small network from scratch beside the frozen base: LoRA's rate
# (QST trains with QLoRA's settings), not tuned for side tuning.
SIDE_LR = LORA_LR
#: --side-tuning without R: QST's reduction factor (the side network's width is hidden / R).
SIDE_R = 16


class ConfigError(ValueError):
    """An invalid setting, reported against the command-line flag that sets it."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag


@dataclass
class TrainConfig:
    """Everything a run depends on. ``None`` means "default" (see ``resolve_config``)."""

    model: str | None = None
    hidden_size: int | None = None
    layers: int | None = None
    heads: int | None = None
    intermediate_size: int | None = None
    max_positions: int | None = None
    init: str | None = None
    steps: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    lr: float | None = None
    min_lr: float | None = None
    warmup_steps: int | None = None
    schedule: str = "cosine"
    weight_decay: float | None = None  # OPTIM_DEFAULTS
    beta1: float = 0.9
    beta2: float | None = None  # OPTIM_DEFAULTS
    grad_clip: float = 1.0
    data: str | None = None
    tokenizer: str | None = None
    vocab_size: int | None = None
    val_fraction: float = 0.05
    eval_every: int | None = None
    eval_batches: int | None = None
    log_every: int = 10
    out: str | None = None
    save: bool | None = None
    save_every: int | None = None
    keep_last: int = 2
    resume: str | None = None
    from_step: int | None = None  # --resume from this checkpoint instead of the latest
    cache_dir: str | None = None
    seed: int = 0
    seeds: int = 1  # with the comparison: paired runs of seeds seed .. seed + seeds - 1 (coat.cli.seeds)
    device: str = "auto"
    dtype: str = "auto"
    recipe: str | None = None
    compare: bool | None = None
    activations: str | None = None
    optim: str | None = None
    master_weights: str = "fp32"
    snsm_proj: str = "svd"
    fp8_granularity: str = "tensor"  # the FP8 layers' scaling (coat.nn.recipe.GRANULARITIES)
    fp8_grad_format: str | None = None  # the FP8 layers' output-gradient format; None: the recipe's default
    fp8_fast_accum: bool = True  # the FP8 forward GEMMs' fast accumulation (Fp8Recipe.fast_accum_fwd)
    dre: bool = True  # coat.optim.AdamW's Dynamic Range Expansion of the FP8 states (its ``expansion``)
    v_scaling: str = "rank1"  # coat.optim.AdamW4bit's normalization of v on matrices (its ``v_scaling``)
    release_grads: bool = False
    # under torchrun: decoder layers per fully_shard unit (coat.integrations.fsdp.shard); "auto":
    # coat.memory.auto_fsdp_unit for the model, batch and GPU (distributed_train.shard resolves it)
    fsdp_unit: int | str = "auto"
    # under torchrun: the FP8 layers' weights gathered as FP8 codes (bit for bit the same training)
    fp8_all_gather: bool = False
    lora: int = 0  # LoRA rank; 0: full fine-tuning
    lora_alpha: int = 8
    lora_dropout: float = 0.0
    lora_targets: str | None = None  # comma-separated module names; None: PEFT's default for the model type
    frozen_fp8: bool = False  # keep the frozen (LoRA base) weights only in FP8
    side_tuning: int = 0  # side network reduction factor R (coat.SideTuned, width hidden / R); 0: off
    compile: bool = False
    cuda_graph: bool = False  # each step replayed from CUDA graphs (coat.CudaGraphStep)
    fp8_stats: bool = False  # FP8 operand statistics of each log interval's last step (coat.fp8_stats)
    threads: int | None = None
    quiet: bool = False
    # Not a flag: set by a resume that changed --steps of a decaying schedule, [step, lr factor]:
    # from that step the decay continues from that factor (no jump) and reaches --min-lr at --steps.
    lr_anchor: list | None = None


def fsdp_unit_arg(text: str) -> int | str:
    """argparse's type for --fsdp-unit (coat train, bench and estimate): auto or a positive integer."""
    import argparse

    from coat.memory import fsdp_unit_value

    try:
        return fsdp_unit_value(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def explicit_fields(cfg: TrainConfig) -> set[str]:
    """Fields set away from their defaults: what a user asked for, as far as a config built in
    Python tells (the command line records the flags given, defaults included)."""
    default = TrainConfig()
    return {f.name for f in fields(TrainConfig) if getattr(cfg, f.name) != getattr(default, f.name)}


def _default_threads() -> int:
    # torch's default ignores the affinity mask (taskset, cpusets): running more threads
    # than usable CPUs makes every step wait on descheduled threads.
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(torch.get_num_threads(), allowed)


def expand_setup(cfg: TrainConfig) -> tuple[TrainConfig, set[str]]:
    """``--recipe`` given as a setup name of coat.recipes (``coat-lean``, ``coat+release``, ``amp``,
    what a run's summary.json calls it): the run's recipe (bf16, fp8 or coat) and the flags the name
    sets, and the names of those flags (they count as given). Other configs are returned as they are.
    Raises ``ConfigError`` for a name that is unknown, that coat train cannot run, or that a flag
    contradicts."""
    if cfg.recipe is None or cfg.recipe in RECIPE_PARTS or (
            cfg.activations and cfg.optim and cfg.recipe == recipe_name(cfg.activations, cfg.optim)):
        return cfg, set()
    try:
        s = recipes.parse(cfg.recipe)
    except ValueError as e:
        raise ConfigError("--recipe", str(e).split(": ", 1)[1]) from None
    if s.recipe not in TRAIN_SETUPS:
        raise ConfigError("--recipe", f"{s.name}: coat train does not run {s.recipe} (it runs "
                          f"{', '.join(TRAIN_SETUPS)})")
    recipe, sets = TRAIN_SETUPS[s.recipe]
    sets = dict(sets)
    for mode in s.modes:
        if mode not in TRAIN_MODES:
            raise ConfigError("--recipe", f"{s.name}: coat train has no +{mode} (its modes: "
                              + ", ".join("+" + m for m in TRAIN_MODES) + ")")
        sets.update(TRAIN_MODES[mode])
    if s.has("lora") and not cfg.lora:
        raise ConfigError("--recipe", f"{s.name}: +lora needs the adapters' rank: add --lora RANK")
    if s.has("lora") and RECIPE_PARTS[recipe][0] == "fp8":
        sets["frozen_fp8"] = True  # coat+lora names the FP8 layers' LoRA with the base kept only in FP8
    if s.has("side") and not cfg.side_tuning:
        sets["side_tuning"] = SIDE_R  # coat+side without --side-tuning R: QST's r
    default = TrainConfig()
    for name, value in sets.items():
        given = getattr(cfg, name)
        if given not in (value, getattr(default, name)) and not (name == "dtype" and given == "auto"):
            raise ConfigError(flag(name), f"{given!r} contradicts --recipe {s.name} (which sets {flag(name)} "
                              f"{value}); drop one of the two")
    return replace(cfg, recipe=recipe, **sets), set(sets)


#: coat.recipes' recipes that coat train runs: its recipe, and the flags the name sets. amp is
#: the bf16 baseline with bf16 autocast (fp32 weights), fp32 the same without autocast; bf16 is
#: coat train's baseline as it always was, its autocast from --dtype (so amp on a GPU, fp32 on a
#: CPU), not coat.recipes' bf16 (bf16 weights), which coat train does not run.
TRAIN_SETUPS: dict[str, tuple[str, dict[str, Any]]] = {
    "bf16": ("bf16", {}), "amp": ("bf16", {"dtype": "bf16"}), "fp32": ("bf16", {"dtype": "fp32"}), "fp8": ("fp8", {}),
    "coat": ("coat", {}), "coat-lean": ("coat", {"master_weights": "bf16_sr"}),
    "coat4bit": ("coat4bit", {}), "coat4bit-lean": ("coat4bit", {"master_weights": "bf16_sr"}),
    "snsm": ("snsm", {}), "snsm-lean": ("snsm", {"master_weights": "bf16_sr"})}
#: coat.recipes' modes that coat train runs, and the flags they set (+lora: with --lora RANK, and
#: on the FP8 layers --frozen-fp8).
TRAIN_MODES: dict[str, dict[str, Any]] = {"row": {"fp8_granularity": "row"}, "block": {"fp8_granularity": "block"},
                                          "v-block": {"v_scaling": "block"}, "lora": {}, "side": {}, "release": {"release_grads": True},
                                          "graph": {"cuda_graph": True}}


def setup_name(cfg: TrainConfig) -> str:
    """What a resolved ``cfg`` runs, named in coat.recipes' vocabulary (``coat estimate --recipe``
    and ``coat bench --recipe`` take it as is): the bf16 baseline is amp with bf16 autocast (its
    weights are fp32), fp32 without; coat with --master-weights bf16_sr is coat-lean. A combination
    outside the vocabulary (bf16 layers with --optim coat) keeps its coat train name."""
    if (cfg.activations, cfg.optim) == RECIPE_PARTS["bf16"]:
        base = "amp" if cfg.dtype == "bf16" else "fp32"
    elif (cfg.activations, cfg.optim) == RECIPE_PARTS["fp8"]:
        base = "fp8"
    elif (cfg.activations, cfg.optim) in (RECIPE_PARTS["coat"], RECIPE_PARTS["coat4bit"], RECIPE_PARTS["snsm"]):
        base = cfg.optim + ("-lean" if cfg.master_weights == "bf16_sr" else "")
    else:
        return recipe_name(cfg.activations, cfg.optim)
    on = {"row": cfg.fp8_granularity == "row", "block": cfg.fp8_granularity == "block",
          "v-block": cfg.v_scaling == "block", "lora": bool(cfg.lora),
          "side": bool(cfg.side_tuning), "release": cfg.release_grads, "graph": cfg.cuda_graph}
    return recipes.Setup(base, tuple(m for m in recipes.MODES if on.get(m))).name


def recipe_name(activations: str, optim: str) -> str:
    for name, parts in RECIPE_PARTS.items():
        if parts == (activations, optim):
            return name
    return f"{activations}-activations+{optim}" + ("" if optim == "snsm" else "-adamw")


def _resolve_recipe(cfg: TrainConfig) -> TrainConfig:
    cfg = expand_setup(cfg)[0]
    if cfg.recipe is not None and cfg.recipe not in RECIPE_PARTS and cfg.activations and cfg.optim \
            and cfg.recipe == recipe_name(cfg.activations, cfg.optim):
        return cfg  # already resolved: a combination of parts outside the named recipes
    if cfg.recipe is not None:
        if cfg.recipe not in RECIPE_PARTS:
            raise ConfigError("--recipe", f"invalid choice {cfg.recipe!r} (choose from {', '.join(RECIPES)})")
        act, opt = RECIPE_PARTS[cfg.recipe]
        for name, want in (("activations", act), ("optim", opt)):
            given = getattr(cfg, name)
            if given is not None and given != want:
                raise ConfigError(flag(name), f"{given!r} contradicts --recipe {cfg.recipe} (which uses "
                                  f"{flag(name)} {want}); drop one of the two flags")
        compare = bool(cfg.compare)
        name = cfg.recipe
    else:
        # Parts not given come from the default recipe; with no recipe named, the run is
        # compared with the BF16 baseline unless it is the baseline itself. Side tuning (which has
        # no BF16 baseline) is compared with LoRA on the same FP8 base only when --compare asks.
        act = cfg.activations or RECIPE_PARTS[DEFAULT_RECIPE][0]
        opt = cfg.optim or RECIPE_PARTS[DEFAULT_RECIPE][1]
        name = recipe_name(act, opt)
        compare = (name != BASELINE_RECIPE and not cfg.side_tuning) if cfg.compare is None else cfg.compare
    if compare and name == BASELINE_RECIPE:
        raise ConfigError("--compare", f"trains the {BASELINE_RECIPE} baseline beside the recipe; the recipe "
                          f"here is {BASELINE_RECIPE} itself (use --recipe coat or fp8, or --no-compare)")
    return replace(cfg, recipe=name, activations=act, optim=opt, compare=compare)


def check_init_flags(cfg: TrainConfig) -> None:
    if cfg.init is not None:
        for name in MODEL_FLAGS:
            if getattr(cfg, name) is not None:
                raise ConfigError(flag(name), "cannot be combined with --init: the model's shape comes from "
                                  "the checkpoint's config.json")


def resolve_config(cfg: TrainConfig, init_max_positions: int | None = None) -> TrainConfig:
    """Fill every ``None`` from the defaults (idempotent). ``init_max_positions``: the --init
    model's context length (its shape comes from its config, not from the presets).

    Raises ``ConfigError`` for flags that contradict each other."""
    check_init_flags(cfg)
    cfg = _resolve_recipe(cfg)
    by_optim = OPTIM_DEFAULTS["snsm" if cfg.optim == "snsm" else "adamw"]
    cfg = replace(cfg, **{k: v for k, v in by_optim.items() if getattr(cfg, k) is None})
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    defaults = dict(DEVICE_DEFAULTS.get(device, DEVICE_DEFAULTS["cpu"]))
    if cfg.init is not None:
        defaults.pop("model")
        defaults["lr"] = LORA_LR if cfg.lora else SIDE_LR if cfg.side_tuning else INIT_LR
        if init_max_positions is not None:
            defaults["seq_len"] = min(defaults["seq_len"], init_max_positions)
    default_warmup = defaults.pop("warmup_steps")
    cfg = replace(cfg, device=device, **{k: v for k, v in defaults.items() if getattr(cfg, k) is None})
    if cfg.init is None:
        preset = MODEL_PRESETS.get(cfg.model, {})
        cfg = replace(cfg, **{k: v for k, v in preset.items() if getattr(cfg, k) is None})
    steps = cfg.steps if isinstance(cfg.steps, int) and cfg.steps > 0 else 1
    return replace(
        cfg,
        warmup_steps=min(default_warmup, steps // 10) if cfg.warmup_steps is None else cfg.warmup_steps,
        min_lr=cfg.lr * 0.1 if cfg.min_lr is None else cfg.min_lr,
        eval_every=max(1, steps // 10) if cfg.eval_every is None else cfg.eval_every,
        dtype=("bf16" if device == "cuda" else "fp32") if cfg.dtype == "auto" else cfg.dtype,
        threads=_default_threads() if cfg.threads is None else cfg.threads,
        tokenizer=cfg.tokenizer or "byte",
        vocab_size=4096 if cfg.vocab_size is None else cfg.vocab_size,
        save=(cfg.init is not None) if cfg.save is None else cfg.save,
    )


def _finite(name: str, value: float, lo: float | None = None, hi: float | None = None,
            hi_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(flag(name), f"must be a finite number, got {value}")
    if lo is not None and value < lo:
        raise ConfigError(flag(name), f"must be >= {lo}, got {value}")
    if hi is not None and (value >= hi if hi_open else value > hi):
        raise ConfigError(flag(name), f"must be {'<' if hi_open else '<='} {hi}, got {value}")


def validate(cfg: TrainConfig, init_max_positions: int | None = None) -> None:
    """Reject settings that cannot work, naming the flag; ``cfg`` must be resolved
    (``init_max_positions``: the --init model's context length). Pure:
    reads no data and writes nothing (the checks that need the data or the file system are in
    ``coat.cli.train``)."""
    choices = {"device": DEVICES[1:], "dtype": DTYPES[1:], "activations": ACTIVATIONS, "optim": OPTIMIZERS,
               "master_weights": MASTER_WEIGHTS, "snsm_proj": SNSM_PROJ, "fp8_granularity": FP8_GRANULARITIES,
               "schedule": SCHEDULES, "tokenizer": TOKENIZERS}
    if cfg.init is None:
        choices["model"] = tuple(MODEL_PRESETS)
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(flag(name), f"invalid choice {getattr(cfg, name)!r} (choose from {', '.join(allowed)})")
    ints = ["steps", "batch_size", "seq_len", "eval_every", "eval_batches", "log_every", "threads", "keep_last"]
    if cfg.fsdp_unit != "auto" and (not isinstance(cfg.fsdp_unit, int) or isinstance(cfg.fsdp_unit, bool)
                                    or cfg.fsdp_unit <= 0):
        raise ConfigError("--fsdp-unit", f"must be auto or a positive integer (decoder layers per FSDP2 unit), "
                                         f"got {cfg.fsdp_unit!r}")
    if cfg.init is None:
        ints += ["hidden_size", "layers", "heads", "intermediate_size", "max_positions"]
    if cfg.save_every is not None:
        ints.append("save_every")
    for name in ints:
        if not isinstance(getattr(cfg, name), int) or getattr(cfg, name) <= 0:
            raise ConfigError(flag(name), f"must be a positive integer, got {getattr(cfg, name)}")
    if cfg.init is None and cfg.fsdp_unit != "auto" and cfg.fsdp_unit > cfg.layers:
        raise ConfigError("--fsdp-unit", f"{cfg.fsdp_unit} is more than the model's {cfg.layers} decoder layers")
    if not isinstance(cfg.warmup_steps, int) or cfg.warmup_steps < 0:
        raise ConfigError("--warmup-steps", f"must be an integer >= 0, got {cfg.warmup_steps}")
    if cfg.warmup_steps > cfg.steps:
        raise ConfigError("--warmup-steps", f"{cfg.warmup_steps} is more than --steps {cfg.steps}")
    if not isinstance(cfg.seed, int) or not 0 <= cfg.seed <= MAX_SEED:
        raise ConfigError("--seed", f"must be an integer in [0, {MAX_SEED}], got {cfg.seed}")
    if not isinstance(cfg.seeds, int) or isinstance(cfg.seeds, bool) or cfg.seeds < 1:
        raise ConfigError("--seeds", f"must be an integer >= 1, got {cfg.seeds!r}")
    if cfg.seeds > 1 and not cfg.compare:
        raise ConfigError("--seeds", f"{cfg.seeds} paired seeds need the comparison with the {BASELINE_RECIPE} "
                          "baseline (leave out --recipe, or add --compare; drop --no-compare)")
    if cfg.seed + cfg.seeds - 1 > MAX_SEED:
        raise ConfigError("--seeds", f"--seed {cfg.seed} + --seeds {cfg.seeds} goes past the largest seed {MAX_SEED}")
    _finite("lr", cfg.lr, lo=0)
    _finite("min_lr", cfg.min_lr, lo=0)
    _finite("weight_decay", cfg.weight_decay, lo=0)
    _finite("grad_clip", cfg.grad_clip, lo=0)
    _finite("beta1", cfg.beta1, lo=0, hi=1, hi_open=True)
    _finite("beta2", cfg.beta2, lo=0, hi=1, hi_open=True)
    _finite("val_fraction", cfg.val_fraction)
    if cfg.lr == 0:
        raise ConfigError("--lr", "must be > 0 (a zero learning rate trains nothing)")
    if cfg.min_lr > cfg.lr:
        raise ConfigError("--min-lr", f"{cfg.min_lr} is larger than --lr {cfg.lr}")
    if not 0 < cfg.val_fraction < 1:
        raise ConfigError("--val-fraction", f"must be between 0 and 1, got {cfg.val_fraction}")
    if cfg.init is None and (cfg.hidden_size % cfg.heads or (cfg.hidden_size // cfg.heads) % 2):
        raise ConfigError("--heads", f"--hidden-size {cfg.hidden_size} must split into {cfg.heads} heads "
                          "of even size (needed by rotary embeddings)")
    max_positions = init_max_positions if cfg.init is not None else cfg.max_positions
    if max_positions is not None and cfg.seq_len > max_positions:
        raise ConfigError("--seq-len", f"{cfg.seq_len} exceeds the model's max positions ({max_positions}); "
                          "lower --seq-len" + ("" if cfg.init else " or raise --max-positions"))
    if cfg.tokenizer == "bpe" and not 512 <= cfg.vocab_size <= 65536:
        raise ConfigError("--vocab-size", f"must be in [512, 65536] for the bpe tokenizer, got {cfg.vocab_size}")
    if cfg.tokenizer != "bpe" and cfg.vocab_size != 4096:
        raise ConfigError("--vocab-size", f"only applies to --tokenizer bpe (the tokenizer is {cfg.tokenizer})")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", "cuda requested but torch sees no CUDA device")
    _validate_fine_tuning(cfg)
    _validate_side_tuning(cfg)
    _validate_step_variants(cfg)
    if cfg.keep_last < 1:
        raise ConfigError("--keep-last", f"must be >= 1, got {cfg.keep_last}")
    if cfg.from_step is not None and cfg.resume is None:
        raise ConfigError("--from-step", "only applies with --resume DIR")


def _validate_fine_tuning(cfg: TrainConfig) -> None:
    """The optimizer's weight flags and LoRA's."""
    if cfg.optim == "torch" and cfg.master_weights != "fp32":
        raise ConfigError("--master-weights", "only applies to --optim coat (torch.optim.AdamW keeps fp32 weights)")
    if cfg.optim != "snsm" and cfg.snsm_proj != "svd":
        raise ConfigError("--snsm-proj", f"only applies to --optim snsm (this run's optimizer is {cfg.optim})")
    if cfg.lora < 0:
        raise ConfigError("--lora", f"must be a rank >= 1 (or 0: no LoRA), got {cfg.lora}")
    if cfg.lora and cfg.init is None:
        raise ConfigError("--lora", "LoRA fine-tunes a pretrained model: give --init PATH")
    if not cfg.lora:
        for name, default in (("lora_alpha", 8), ("lora_dropout", 0.0), ("lora_targets", None), ("frozen_fp8", False)):
            if getattr(cfg, name) != default:
                raise ConfigError(flag(name), "only applies with --lora RANK")
    if cfg.lora_alpha <= 0:
        raise ConfigError("--lora-alpha", f"must be > 0, got {cfg.lora_alpha}")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        raise ConfigError("--lora-dropout", f"must be in [0, 1), got {cfg.lora_dropout}")
    if cfg.lora_targets is not None and not all(t.strip() for t in cfg.lora_targets.split(",")):
        raise ConfigError("--lora-targets", f"must be comma-separated module names, got {cfg.lora_targets!r}")
    _validate_recipe_flags(cfg)
    if cfg.fp8_granularity != "tensor" and cfg.activations != "fp8":
        raise ConfigError("--fp8-granularity", f"only applies to the FP8 layers (this run's activations are "
                                               f"{cfg.activations})")
    if cfg.fp8_granularity != "tensor" and (cfg.frozen_fp8 or cfg.side_tuning):
        raise ConfigError("--fp8-granularity", "row and block scaling quantize the weights in each call: the FP8-frozen "
                                               "base of --frozen-fp8 and --side-tuning needs 'tensor'")
    if cfg.frozen_fp8 and cfg.activations != "fp8":
        raise ConfigError("--frozen-fp8", "needs the FP8 layers (--recipe coat or fp8): it keeps the frozen base "
                                          "weights as FP8 codes those layers read")


def _validate_side_tuning(cfg: TrainConfig) -> None:
    """--side-tuning R and what it cannot be combined with."""
    r = cfg.side_tuning
    if not isinstance(r, int) or isinstance(r, bool) or r < 0:
        raise ConfigError("--side-tuning", f"must be a reduction factor >= 1 (or 0: no side tuning), got {r!r}")
    if not r:
        return
    if cfg.init is None:
        raise ConfigError("--side-tuning", "side tuning fine-tunes a pretrained model: give --init PATH")
    if cfg.lora:
        raise ConfigError("--side-tuning", "cannot be combined with --lora (each is a way to fine-tune the frozen "
                                           "base; --side-tuning R --compare trains both and compares them)")
    if cfg.activations != "fp8":
        raise ConfigError("--side-tuning", f"needs the FP8 frozen base (--recipe coat, coat-lean or fp8), not "
                                           f"--recipe {cfg.recipe}: the base is kept only as FP8 codes")
    for name, why in (("release_grads", "the side network's few layers gain nothing from it"),
                      ("compile", "not supported with side tuning yet"),
                      ("fp8_stats", "not supported with side tuning yet")):
        if getattr(cfg, name):
            raise ConfigError("--side-tuning", f"cannot be combined with {flag(name)} ({why})")


def _validate_recipe_flags(cfg: TrainConfig) -> None:
    """--fp8-grad-format, --fp8-fast-accum, --dre and --v-scaling: valid, and only where they change something."""
    if cfg.fp8_grad_format not in (None, *FP8_GRAD_FORMATS):
        raise ConfigError("--fp8-grad-format", f"invalid choice {cfg.fp8_grad_format!r} (choose from "
                                               f"{', '.join(FP8_GRAD_FORMATS)})")
    for name in ("fp8_fast_accum", "dre"):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(flag(name), f"must be True or False, got {getattr(cfg, name)!r}")
    changed = [n for n, off in (("--fp8-grad-format", cfg.fp8_grad_format is not None),
                                ("--no-fp8-fast-accum", not cfg.fp8_fast_accum)) if off]
    if changed and cfg.activations != "fp8":
        raise ConfigError(changed[0], f"only applies to the FP8 layers (this run's activations are {cfg.activations})")
    if not cfg.fp8_fast_accum and cfg.fp8_granularity == "block":
        raise ConfigError("--no-fp8-fast-accum", "block-scaled GEMMs always accumulate in split fp32 (cuBLASLt has "
                                                 "no fast accumulation for them): the flag would change nothing")
    if cfg.fp8_grad_format is not None and cfg.side_tuning:
        raise ConfigError("--fp8-grad-format", "side tuning runs the FP8 base without gradients: the flag would "
                                               "change nothing")
    if not cfg.dre and cfg.optim != "coat":
        raise ConfigError("--no-dre", f"Dynamic Range Expansion is coat.optim.AdamW's (--optim coat), not "
                                      f"--optim {cfg.optim}'s")
    if cfg.v_scaling not in V_SCALINGS:
        raise ConfigError("--v-scaling", f"invalid choice {cfg.v_scaling!r} (choose from {', '.join(V_SCALINGS)})")
    if cfg.v_scaling != "rank1" and cfg.optim != "coat4bit":
        raise ConfigError("--v-scaling", f"v's scaling is coat.optim.AdamW4bit's (--optim coat4bit), not "
                                         f"--optim {cfg.optim}'s")


def fp8_recipe(cfg: TrainConfig) -> Fp8Recipe:
    """The FP8 layers' recipe of a resolved ``cfg`` (--fp8-granularity, --fp8-grad-format,
    --fp8-fast-accum): the one place coat train makes it."""
    return Fp8Recipe(granularity=cfg.fp8_granularity, grad_format=cfg.fp8_grad_format,
                     fast_accum_fwd=cfg.fp8_fast_accum)


def artifact(cfg: TrainConfig) -> str:
    """The folder of OUT that --save writes: the LoRA adapter, the side network, or the model."""
    return "adapter" if cfg.lora else "side" if cfg.side_tuning else "model"


def _validate_step_variants(cfg: TrainConfig) -> None:
    """--fp8-stats, --release-grads and --cuda-graph, and what each cannot be combined with."""
    if cfg.fp8_stats:
        if cfg.activations != "fp8":
            raise ConfigError("--fp8-stats", "needs the FP8 layers (--recipe coat or fp8): it reports their GEMM operands")
        for name in ("compile", "cuda_graph"):
            if getattr(cfg, name):
                raise ConfigError("--fp8-stats", f"cannot be combined with {flag(name)} (compiled code and graph "
                                                 "replays record no statistics)")
    if cfg.release_grads and cfg.optim not in COAT_OPTIMIZERS:
        raise ConfigError("--release-grads", "needs --optim coat, coat4bit or snsm (the step inside backward is "
                                             "coat.optim's)")
    if cfg.cuda_graph and cfg.optim == "snsm":
        raise ConfigError("--cuda-graph", "cannot be combined with --optim snsm (its projection refresh is decided on "
                                          "the host; the step is not capturable)")
    if cfg.cuda_graph:
        for name in ("release_grads", "compile"):
            if getattr(cfg, name):
                raise ConfigError("--cuda-graph", f"cannot be combined with {flag(name)} (a graph replays a fixed "
                                                  "step; that flag runs Python hooks or compiled code in it)")
        if cfg.device == "cpu":
            raise ConfigError("--cuda-graph", "needs a CUDA device (--device cuda or auto on a GPU machine)")


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Multiplier of ``cfg.lr`` after ``step`` optimizer steps: linear warmup, then decay to min_lr
    (from ``cfg.lr_anchor`` on, the decay runs from the anchor's factor instead)."""
    floor = cfg.min_lr / cfg.lr if cfg.lr else 1.0

    def decay(progress: float) -> float:
        progress = min(1.0, progress)
        return 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress

    def factor(step: int) -> float:
        if cfg.lr_anchor is not None and cfg.schedule != "constant" and step >= cfg.lr_anchor[0]:
            start, f0 = cfg.lr_anchor
            return floor + (f0 - floor) * decay((step - start) / max(1, cfg.steps - start))
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        return floor + (1 - floor) * decay((step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))

    return factor
