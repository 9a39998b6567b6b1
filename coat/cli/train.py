"""coat train: train a Llama-family model with COAT's FP8 recipe, side by side with BF16.

With no arguments it trains a small Llama from scratch twice, with the coat recipe (FP8 GEMMs,
FP8 saved activations, FP8 optimizer states) and with the plain BF16 baseline, on the same
data in the same order, and ends with one comparison table and one plot. The built-in corpus
is Python source present on every machine (no download), tokenized at byte level. --init PATH
fine-tunes a Hugging Face checkpoint (Llama, Mistral, Qwen2, Qwen3) instead. Under torchrun
(torchrun --nproc_per_node N -m coat train ...) it trains with FSDP2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Callable

from coat.cli import chat_data
from coat.cli import checkpoint as ckpt
from coat.cli import distributed_train as dt
from coat.cli.config import (ACTIVATIONS, COAT_OPTIMIZERS, DEVICE_DEFAULTS, DEVICES, DTYPES, INIT_LR, LORA_LR,
                             MASTER_WEIGHTS, MODEL_PRESETS, OPTIMIZERS, SCHEDULES, SIDE_LR, SIDE_R, SNSM_PROJ, FP8_GRANULARITIES,
                             TRAIN_SETUPS,
                             ConfigError, TrainConfig, artifact, check_init_flags, expand_setup, explicit_fields,
                             flag, lr_lambda, resolve_config, validate)
from coat.cli.data import MAX_TOKEN_ID, TOKENIZERS, default_cache_dir, load_corpus
from coat.cli.plan import RunPlan
from coat.cli.model import build_model, build_optimizer, evaluate, lm_loss

__all__ = ["TrainConfig", "ConfigError", "resolve_config", "validate", "lr_lambda", "build_model",
           "build_optimizer", "lm_loss", "evaluate", "train", "prepare", "register"]

#: Flags that may differ from the original run when resuming it (any other flag given must
#: repeat the run's value). A new --steps of a cosine or linear schedule continues the decay from
#: the lr at the resume point (see ``_continue_schedule``).
RESUME_OVERRIDES = ("steps", "save_every", "keep_last", "save", "quiet", "threads", "cache_dir", "fp8_stats")


def _check_imports(cfg: TrainConfig) -> None:
    if cfg.optim in (*COAT_OPTIMIZERS, "snsm"):
        cls = {"coat4bit": "AdamW4bit", "snsm": "SubsetNormSM"}.get(cfg.optim, "AdamW")
        try:
            from coat.optim import AdamW, AdamW4bit  # noqa: F401
        except ImportError as e:  # the compiled extension may be missing or not built yet
            raise ConfigError("--optim", f"{cfg.optim!r} needs coat.optim.{cls}, which failed to import ({e}); "
                              "build/install coat's extension or use --recipe bf16") from e
    if cfg.activations == "fp8":
        try:
            import coat  # noqa: F401
        except ImportError as e:
            raise ConfigError("--activations", f"'fp8' needs coat.convert, which failed to import ({e})") from e
    if cfg.lora:
        try:
            import peft  # noqa: F401
        except ImportError as e:
            raise ConfigError("--lora", f"needs peft ({e}): pip install peft") from e


def resume_config(cfg: TrainConfig, explicit: set[str] | None = None) -> tuple[TrainConfig, TrainConfig]:
    """The settings of the run in ``cfg.resume``, with the few flags a resume may change, and the
    run's own resolved settings. ``explicit``: the flags given (default: those away from their
    defaults); each one outside ``RESUME_OVERRIDES`` must repeat the run's value."""
    import json

    explicit = explicit_fields(cfg) if explicit is None else explicit
    folder = Path(cfg.resume)
    if not folder.is_dir():
        raise ConfigError("--resume", f"{folder} is not a folder")
    saved_file = folder / "compare.json" if (folder / "compare.json").is_file() else folder / "config.json"
    if not saved_file.is_file():
        raise ConfigError("--resume", f"{folder} is not a coat train output folder (no config.json)")
    try:
        saved = json.loads(saved_file.read_text())
        known = {f.name for f in fields(TrainConfig)}
        ran = TrainConfig(**{k: v for k, v in saved["train"].items() if k in known})
        flags = TrainConfig(**{k: v for k, v in saved.get("flags", saved["train"]).items() if k in known})
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError("--resume", f"{saved_file} is not a coat train config ({e})") from None
    if cfg.out is not None and Path(cfg.out).resolve() != folder.resolve():
        raise ConfigError("--out", f"a resumed run writes into its own folder ({folder}); drop --out")
    for name in sorted(explicit - {"resume", "out", "from_step", *RESUME_OVERRIDES}):
        if getattr(cfg, name) not in (getattr(ran, name), getattr(flags, name)):
            raise ConfigError(flag(name), f"cannot change when resuming (the run in {folder} used "
                              f"{getattr(ran, name)!r}); drop the flag")
    overrides = {k: getattr(cfg, k) for k in RESUME_OVERRIDES if k in explicit}
    # The run's own flags, resolved again; what was derived from the machine or from --steps is
    # pinned to what the run used, so a resume on another machine or to more steps continues it.
    pinned = {k: getattr(ran, k) for k in ("device", "dtype", "warmup_steps", "eval_every", "min_lr", "lr_anchor")}
    return replace(flags, **pinned, **overrides, out=str(folder), resume=str(folder), from_step=cfg.from_step), ran


def _continue_schedule(cfg: TrainConfig, ran: TrainConfig, step: int, log: Callable[[str], None]) -> list | None:
    """The ``lr_anchor`` of a resume at ``step`` with a new --steps: None when the lr the run
    continues with is unchanged (a constant schedule, or inside the warmup); else [step, the run's
    own factor there], from which the decay continues to --min-lr at the new total."""
    before, plain = lr_lambda(ran)(step), lr_lambda(cfg)(step)
    if cfg.steps == ran.steps or math.isclose(before, plain, rel_tol=1e-12):
        return cfg.lr_anchor
    floor = cfg.min_lr / cfg.lr
    how = (f"stays at --min-lr {cfg.min_lr:.4g}, which it had reached," if math.isclose(before, floor) else
           f"continues from lr {cfg.lr * before:.4g} at step {step} and now decays to --min-lr {cfg.min_lr:.4g}")
    log(f"--steps {ran.steps} -> {cfg.steps}: the {cfg.schedule} schedule {how} until step {cfg.steps} (without "
        f"this the lr would jump to {cfg.lr * plain:.4g} at step {step + 1})")
    return [step, before]


def _rank0_first(d: dt.Dist, fn: Callable[[], Any]) -> Any:
    """``fn`` on rank 0, then (if it succeeded there) on the other ranks: e.g. tokenizing into the
    shared cache once. A ConfigError on rank 0 is raised on every rank, so none waits forever."""
    if not d.enabled:
        return fn()
    err = None
    if d.is_main:
        try:
            result = fn()
        except ConfigError as e:
            err = (e.flag, str(e).split(": ", 1)[1])
    err = d.broadcast(err)
    if err is not None:
        raise ConfigError(*err)
    return result if d.is_main else fn()


def prepare(cfg: TrainConfig, d: dt.Dist = dt.Dist(), log: Callable[[str], None] = print,
            explicit: set[str] | None = None) -> RunPlan:
    """Validates everything that depends on user input: flags, --init, --data, the output folder,
    --resume. Nothing is written to the output folder before all of it passed; then the folder
    is reserved (created and locked). Raises ``ConfigError`` naming the flag. ``explicit``: the
    flags given on the command line (default: the fields away from their defaults)."""
    from coat.cli import pretrained

    explicit = explicit_fields(cfg) if explicit is None else explicit
    # A setup name as --recipe (coat-lean, coat+release): the recipe and the flags it sets, as if given.
    cfg, implied = expand_setup(cfg)
    explicit = explicit | implied
    ran = None
    if cfg.resume is not None:
        cfg, ran = resume_config(cfg, explicit)
    flags = cfg
    cfg, init = _check_settings(cfg, d)
    tokenizer = pretrained.load_tokenizer(init) if init else None
    corpus = _load_data(cfg, d, log, init, tokenizer)
    resume_from = None
    if cfg.resume is not None:
        resume_from, step = _check_resume(cfg, corpus, d, "save" in explicit)
        if resume_from is not None and ran is not None:
            anchor = _continue_schedule(cfg, resolve_config(ran), step, log)
            # --from-step is used up here: a later resume starts from the latest checkpoint again.
            cfg, flags = (replace(c, lr_anchor=anchor, from_step=None) for c in (cfg, flags))
    out = _reserve(cfg, d, resume_from)
    return RunPlan(cfg, corpus, out, init, tokenizer, resume_from, flags)


def _check_settings(cfg: TrainConfig, d: dt.Dist) -> tuple[TrainConfig, Any]:
    """The flags resolved and checked against each other, --init (inspected, not loaded), the
    imports the run needs, --data's existence and the output folder; returns the resolved
    settings and what --init holds (None without --init)."""
    from coat.cli import pretrained

    check_init_flags(cfg)
    init = None
    if cfg.init is not None:
        try:
            init = pretrained.inspect_init(cfg.init)
        except ValueError as e:
            raise ConfigError("--init", str(e)) from None
        if cfg.tokenizer is not None and init.has_tokenizer:
            raise ConfigError("--tokenizer", f"--init {cfg.init} brings its own tokenizer; drop --tokenizer")
    cfg = resolve_config(cfg, init.max_positions if init else None)
    validate(cfg, init.max_positions if init else None)
    if cfg.lora and cfg.lora_targets and init is not None:  # here, before a compare child starts
        missing, linear = pretrained.missing_modules(init, [t.strip() for t in cfg.lora_targets.split(",")])
        if missing:
            raise ConfigError("--lora-targets", f"the --init model has no module named {', '.join(missing)}; its "
                              f"Linear layers are {', '.join(linear)}")
    if cfg.lora and d.enabled:
        raise ConfigError("--lora", "LoRA under torchrun (FSDP2 of a PEFT model) is not supported yet; "
                                    "run it in one process")
    if cfg.side_tuning:
        _check_side_tuning(cfg, d, init)
    _check_imports(cfg)
    if cfg.data is not None and not Path(cfg.data).exists():
        raise ConfigError("--data", f"path does not exist: {cfg.data}")
    if cfg.resume is None:
        try:
            if cfg.out:
                ckpt.check_new_out(Path(cfg.out))
            else:
                ckpt.check_default_root(Path("runs"))
        except ckpt.OutputError as e:
            raise ConfigError("--out", str(e)) from None
    return cfg, init


def _check_side_tuning(cfg: TrainConfig, d: dt.Dist, init: Any) -> None:
    """--side-tuning R: one process, and an R that divides the --init model's hidden size into an even width."""
    if d.enabled:
        raise ConfigError("--side-tuning", "side tuning under torchrun (FSDP2) is not supported; run it in one process")
    try:
        hidden = json.loads((init.path / "config.json").read_text()).get("hidden_size")
    except (OSError, ValueError):
        hidden = None
    r = cfg.side_tuning
    if isinstance(hidden, int) and (hidden % r or (hidden // r) % 2):
        raise ConfigError("--side-tuning", f"{r} must divide the --init model's hidden size {hidden} into an even "
                                           "side width (hidden / R)")


def _load_data(cfg: TrainConfig, d: dt.Dist, log: Callable[[str], None], init: Any, tokenizer: Any) -> Any:
    """--data tokenized (on rank 0 first: into the shared cache once), checked against --seq-len,
    the ranks and the --init model's vocabulary."""
    max_id = init.vocab_size - 1 if init else MAX_TOKEN_ID
    chat = _check_chat_data(cfg, tokenizer)

    def load() -> Any:
        try:
            if chat is not None:
                return chat_data.load_chat_corpus(cfg.data, chat, tokenizer, cfg.seq_len, cfg.val_fraction,
                                                  Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir(),
                                                  log if d.is_main else (lambda _: None))
            return load_corpus(cfg.data, cfg.tokenizer, cfg.vocab_size, cfg.val_fraction, cfg.cache_dir,
                               log if d.is_main else (lambda _: None), tokenizer, max_id)
        except (FileNotFoundError, ValueError) as e:  # missing or unusable --data
            raise ConfigError("--data", str(e)) from e

    corpus = _rank0_first(d, load)
    for split, tokens in (("train", corpus.train), ("validation", corpus.val)):
        if chat_data.is_packed(tokens):  # whole examples in rows of --seq-len: one row per rank is enough
            if len(tokens) < (d.world if split == "train" else 1):
                raise ConfigError("--data", f"the {split} split packs into {len(tokens)} rows of --seq-len "
                                  f"{cfg.seq_len} tokens, fewer than the {d.world} ranks")
        elif len(tokens) // d.world <= cfg.seq_len + 1:
            raise ConfigError("--seq-len", f"{cfg.seq_len} is too long for the {split} split ({len(tokens)} tokens"
                              + (f" over {d.world} ranks" if d.enabled else "") + ")")
    if init is not None and corpus.vocab_size > init.vocab_size:
        raise ConfigError("--data", f"the tokenized data needs {corpus.vocab_size} token ids, more than the "
                          f"--init model's vocab_size {init.vocab_size}")
    if init is not None and tokenizer is None and corpus.info.get("tokenizer") != "pretokenized":
        log(f"note: {cfg.init} has no tokenizer; text is tokenized with --tokenizer {cfg.tokenizer} "
            f"({corpus.vocab_size} ids of the model's {init.vocab_size})")
    return corpus


def _check_chat_data(cfg: TrainConfig, tokenizer: Any) -> str | None:
    """What coat.cli.chat_data reads at --data (None: text or token arrays, for load_corpus).
    Chat records are rendered with a checkpoint's own tokenizer and chat template: --init is needed."""
    chat = chat_data.detect(cfg.data) if cfg.data is not None else None
    if chat is None:
        return None
    what = {"datasets": "a datasets folder", "parquet": "parquet data"}.get(chat, "chat / prompt-completion records")
    if cfg.init is None:
        raise ConfigError("--data", f"{cfg.data} holds {what}, which are tokenized with a checkpoint's tokenizer "
                          "and chat template: give --init PATH (a Hugging Face checkpoint folder with its tokenizer)")
    if tokenizer is None:
        raise ConfigError("--init", f"{cfg.init} has no tokenizer, and --data {cfg.data} holds {what}, which are "
                          "tokenized with the checkpoint's own tokenizer and chat template")
    if cfg.side_tuning:  # the side layers' SDPA is causal over the whole row, across packed examples
        raise ConfigError("--side-tuning", f"does not run on packed chat data yet (--data {cfg.data}): the side "
                          "network's attention would cross the packed examples' boundaries")
    if cfg.cuda_graph:  # transformers reads the packed positions on the host: no graph capture
        raise ConfigError("--cuda-graph", f"does not run on packed chat data (--data {cfg.data}): transformers "
                          "finds the example boundaries from the position ids on the host")
    return chat


def _check_resume(cfg: TrainConfig, corpus: Any, d: dt.Dist, export: bool) -> tuple[Path | None, int]:
    """The checkpoint to resume from (the latest, or --from-step's) and its step, verified whole
    and of this run (on rank 0: its files are hashed once). A damaged or foreign one is refused,
    naming the newest earlier checkpoint that is whole. ``export``: --save was given, so a
    finished run may be "resumed" to export its final checkpoint."""
    import json

    folder = Path(cfg.resume)
    if cfg.compare:  # each recipe's sub-run resumes on its own (coat.cli.compare)
        if cfg.from_step is not None:
            raise ConfigError("--from-step", f"{folder} holds a comparison; resume one recipe's folder instead: "
                              f"--resume {folder}/<recipe> --from-step N")
        return None, 0
    saved = json.loads((folder / "config.json").read_text())
    counts = (saved.get("corpus", {}).get("train_tokens"), saved.get("corpus", {}).get("val_tokens"))
    now = (chat_data.n_tokens(corpus.train), chat_data.n_tokens(corpus.val))
    if counts != now:
        raise ConfigError("--data", f"the data changed since the run in {folder} started ({counts[0]} train / "
                          f"{counts[1]} val tokens then, {now[0]} / {now[1]} now)")
    found = dict(ckpt.checkpoints(folder))
    if not found:
        raise ConfigError("--resume", f"{folder} holds no whole checkpoint (a run writes them with --save-every N, "
                          "and when Ctrl-C or SIGTERM stops it)")
    if cfg.from_step is not None and cfg.from_step not in found:
        raise ConfigError("--from-step", f"{folder} has no checkpoint of step {cfg.from_step} (it has steps "
                          f"{', '.join(map(str, found))})")
    target = cfg.from_step if cfg.from_step is not None else max(found)
    verdict = ckpt.verify_or_offer(folder, target, d.world, ckpt.run_identity(saved)) if d.is_main else None
    verdict = d.broadcast(verdict)
    if verdict is not None:
        raise ConfigError("--from-step" if cfg.from_step is not None else "--resume", verdict)
    if target > cfg.steps:
        raise ConfigError("--steps", f"{cfg.steps} is before the checkpoint to resume from (step {target}); "
                          "give a larger total")
    if target == cfg.steps and not export:
        raise ConfigError("--resume", f"the run in {folder} already finished its {cfg.steps} steps; pass --steps "
                          "with a larger total to train further, or --save to export its trained model")
    if target == cfg.steps and (folder / artifact(cfg)).exists():
        raise ConfigError("--save", f"{folder / artifact(cfg)} already exists")
    return found[target], target


def _reserve(cfg: TrainConfig, d: dt.Dist, resume_from: Path | None = None) -> Path:
    """Creates and locks the output folder on rank 0 and tells every rank where it is."""
    result: Any = None
    if d.is_main:
        try:
            if cfg.resume is not None:
                out = Path(cfg.resume)
                ckpt.lock(out)
                if resume_from is not None:
                    ckpt.set_aside_after(out, resume_from)
            else:
                out = ckpt.reserve_out(Path(cfg.out) if cfg.out else None)
            result = ("ok", str(out))
        except (ckpt.OutputError, ckpt.WriteError, OSError) as e:
            result = ("error", "--resume" if cfg.resume else "--out", str(e))
    result = d.broadcast(result)
    if result[0] == "error":
        raise ConfigError(result[1], result[2])
    return Path(result[1])


def train(cfg: TrainConfig, d: dt.Dist | None = None, explicit: set[str] | None = None) -> dict[str, Any]:
    """Runs ``coat train`` with ``cfg`` in this process (and, for --compare, child processes).

    Returns the run's summary; with --compare, ``{"runs": {recipe: summary}, "table": ...}``; with
    --seeds N > 1, ``{"runs": {"seed_<s>/<recipe>": summary}, "table": ...}`` (coat.cli.seeds).
    Raises ``ConfigError`` for settings that cannot work, before anything is written, and
    ``checkpoint.WriteError`` when the run cannot write what it must (a full disk).
    ``explicit``: the flags given on the command line (default: the fields away from their defaults)."""
    from coat.cli import compare, runner, seeds

    d = d or dt.Dist()
    log: Callable[[str], None] = (lambda _: None) if cfg.quiet or not d.is_main else print
    plan = prepare(cfg, d, log, explicit)
    new = plan.resume is None and not plan.cfg.resume
    try:
        if plan.cfg.compare and plan.cfg.seeds > 1:
            result = seeds.run_seeds(plan, d, log)
        elif plan.cfg.compare:
            result = compare.run_compare(plan, d, log)
        else:
            result = runner.run(plan, d, log)
    except BaseException:
        if d.is_main and new:  # a start that failed or was aborted before its first step leaves no folder
            ckpt.release_if_unused(plan.out)
        raise
    if d.is_main and new and plan.cfg.compare:  # both recipes stopped before writing anything
        ckpt.release_if_unused(plan.out)
    return result


def exit_code(result: dict[str, Any]) -> int:
    """0 for a finished run; 128 + signal for a stopped one (the shell's convention); 1 if it diverged."""
    runs = result["runs"].values() if "runs" in result else [result]
    for r in [*runs, *([result] if "runs" in result and result.get("stopped_by") else [])]:
        if r.get("diverged_at") is not None:
            return 1
        if r.get("exit_status") and not r.get("stopped_by"):
            return 1
        if r.get("stopped_by"):
            return 143 if r["stopped_by"] == "SIGTERM" else 130
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``train`` subcommand to the ``coat`` parser."""
    p = subparsers.add_parser("train", help="train with COAT's FP8 recipe beside BF16 (or fine-tune with --init)",
                              description=__doc__, argument_default=argparse.SUPPRESS)
    for add_group in (_model_flags, _data_flags, _optimization_flags, _runtime_flags, _output_flags):
        add_group(p)
    p.set_defaults(handler=lambda args: _run(args, p))


_N, _X = dict(type=int, metavar="N"), dict(type=float, metavar="X")


def _default(name: str) -> str:  # flags default to "not given"; TrainConfig holds the value
    return f" (default: {getattr(TrainConfig, name)})"


def _by_device(name: str) -> str:
    return f"(default: {DEVICE_DEFAULTS['cpu'][name]} on CPU, {DEVICE_DEFAULTS['cuda'][name]} on GPU)"


def _from_preset(name: str) -> str:
    return "(default: from --model: " + ", ".join(f"{k} {v[name]}" for k, v in MODEL_PRESETS.items()) + ")"


def _model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=list(MODEL_PRESETS), help="model size preset " + _by_device("model"))
    g.add_argument("--hidden-size", **_N, help=_from_preset("hidden_size"))
    g.add_argument("--layers", **_N, help=_from_preset("layers"))
    g.add_argument("--heads", **_N, help=_from_preset("heads"))
    g.add_argument("--intermediate-size", **_N, help="MLP width " + _from_preset("intermediate_size"))
    g.add_argument("--max-positions", **_N, help="longest sequence " + _from_preset("max_positions"))
    g.add_argument("--init", metavar="PATH", help="start from this Hugging Face checkpoint folder (Llama, Mistral, "
                   f"Qwen2, Qwen3, Gemma 3) and its tokenizer; implies --save and a default --lr of {INIT_LR} "
                   f"({LORA_LR} with --lora, {SIDE_LR} with --side-tuning)")


def _data_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="PATH", help="a text file, a JSONL file of {\"text\": ...} records, a folder of "
                   "those, or a token array (.npy, or .bin of uint16) (default: Python source on this machine: "
                   "the standard library, torch, transformers, numpy). With --init also chat data: JSONL/JSON/"
                   "parquet records of {\"messages\": [{\"role\", \"content\"}, ...]}, ShareGPT "
                   "{\"conversations\": [{\"from\", \"value\"}, ...]} or {\"prompt\", \"completion\"}, or a "
                   "datasets save_to_disk folder: rendered with the checkpoint's chat template, the loss on "
                   "assistant tokens only, examples packed into --seq-len rows without attending to each other")
    g.add_argument("--tokenizer", choices=TOKENIZERS, help="byte: 256 byte values + EOS (default); bpe: byte-level "
                   "BPE trained on the training text. With --init, the checkpoint's own tokenizer")
    g.add_argument("--vocab-size", **_N, help="vocabulary size of --tokenizer bpe (default: 4096)")
    g.add_argument("--val-fraction", **_X,
                   help="held-out share (last documents, else last tokens)" + _default("val_fraction"))
    g.add_argument("--cache-dir", metavar="DIR", help="tokenized corpus cache (default: ~/.cache/coat/corpus)")


def _optimization_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", **_N, help="optimizer steps " + _by_device("steps"))
    g.add_argument("--batch-size", **_N, help="sequences per step and process " + _by_device("batch_size"))
    g.add_argument("--seq-len", **_N, help="tokens per sequence " + _by_device("seq_len"))
    g.add_argument("--lr", **_X, help="peak learning rate " + _by_device("lr"))
    g.add_argument("--min-lr", **_X, help="final learning rate (default: lr / 10)")
    g.add_argument("--warmup-steps", **_N, help="linear warmup steps (default: steps / 10, at most "
                   f"{DEVICE_DEFAULTS['cpu']['warmup_steps']} on CPU, "
                   f"{DEVICE_DEFAULTS['cuda']['warmup_steps']} on GPU)")
    g.add_argument("--schedule", choices=SCHEDULES, help="decay after warmup" + _default("schedule"))
    g.add_argument("--weight-decay", **_X, help="AdamW weight decay (matrices only)" + _default("weight_decay"))
    g.add_argument("--beta1", **_X, help="AdamW beta1" + _default("beta1"))
    g.add_argument("--beta2", **_X, help="AdamW beta2" + _default("beta2"))
    g.add_argument("--grad-clip", **_X, help="max gradient norm (0 disables clipping)" + _default("grad_clip"))
    g.add_argument("--optim", choices=OPTIMIZERS, help="torch: torch.optim.AdamW; coat: coat.optim.AdamW with FP8 "
                   "states; coat4bit: coat.optim.AdamW4bit with 4-bit states; snsm: coat.optim.SubsetNormSM (Subset-Norm + "
                   "Subspace-Momentum on the matrices, rank 128, refresh every 100 steps; its paper's lr is ~10x "
                   "Adam's) (default: from --recipe)")
    g.add_argument("--master-weights", choices=MASTER_WEIGHTS, help="master weight format of --optim coat, coat4bit or snsm "
                   "(bf16_sr: bf16 with stochastic rounding)" + _default("master_weights"))
    g.add_argument("--snsm-proj", choices=SNSM_PROJ, help="how --optim snsm refreshes its projections: svd (a full "
                   "SVD of each matrix's gradient, the paper's) or randomized (a randomized range finder: ~50-100x "
                   "faster on 7B matrices)" + _default("snsm_proj"))
    g.add_argument("--lora", type=int, metavar="RANK",
                   help="fine-tune PEFT LoRA adapters of this rank instead of every weight (needs --init); "
                        f"--save then writes the adapter; the default --lr is then {LORA_LR} "
                        "(default: 0, no LoRA)")
    g.add_argument("--lora-alpha", **_N, help="LoRA alpha (PEFT's default)" + _default("lora_alpha"))
    g.add_argument("--lora-dropout", **_X, help="LoRA dropout (PEFT's default)" + _default("lora_dropout"))
    g.add_argument("--lora-targets", metavar="NAMES", help="comma-separated module names to adapt, e.g. "
                   "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj (default: PEFT's for the model type)")
    g.add_argument("--side-tuning", type=int, nargs="?", const=SIDE_R, metavar="R",
                   help="Quantized Side Tuning (coat.SideTuned, docs/side_tuning.md) instead of every weight "
                        "(needs --init and the FP8 layers: --recipe coat, coat-lean or fp8): the base is frozen, "
                        "kept only as FP8 codes and run without gradients; a side network R times narrower than "
                        f"the base (width hidden / R; R defaults to {SIDE_R}, QST's) trains beside it. --save then "
                        f"writes only the side network to OUT/side; the default --lr is then {SIDE_LR}; --compare "
                        "also trains LoRA (rank 16, alpha 32, every projection) on the same FP8 base (default: 0, "
                        "no side tuning)")
    g.add_argument("--fp8-granularity", choices=FP8_GRANULARITIES,
                   help="how the FP8 layers scale their GEMM operands: tensor (one scale each), row (per token and "
                        "per output channel) or block (DeepSeek-V3's 1x128 activation and gradient groups, 128x128 "
                        "weight tiles, E4M3 gradients); row and block need an sm_90 GPU (Hopper) or the CPU "
                        "(docs/scaling.md)" + _default("fp8_granularity"))
    g.add_argument("--frozen-fp8", action="store_true", help="with --lora and the FP8 layers: keep the frozen "
                   "base weights only as FP8 codes (1 byte per parameter instead of 2)")
    g.add_argument("--release-grads", action="store_true",
                   help="gradient release (--optim coat, coat4bit or snsm): each decoder layer is stepped inside backward and its "
                        "gradients freed, so a full set of gradients never exists; --grad-clip then clips each layer by a "
                        "running estimate of the step's norm (this step's layers so far + the previous step's for "
                        "the rest; the first step only measures it)")


def _runtime_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("precision and runtime")
    g.add_argument("--recipe", metavar="NAME", help="coat (default): FP8 GEMMs and saved activations in the "
                   "decoder layers, FP8 optimizer states; coat-lean: coat with --master-weights bf16_sr; fp8: the "
                   "FP8 layers without FP8 optimizer states; bf16: the plain PyTorch baseline (fp32 weights, "
                   "autocast from --dtype), amp / fp32: that baseline with / without bf16 autocast. Modes after "
                   "'+': +release (= --release-grads), +graph (= --cuda-graph), +lora (with --lora RANK), +side (= "
                   "--side-tuning, R 16 unless given), e.g. "
                   "coat-lean+release. The run is recorded under its setup name "
                   "(setup in config.json and summary.json: amp for the baseline on a GPU), which coat estimate "
                   "--recipe and coat bench --recipe take as is (recipes: " + ", ".join(TRAIN_SETUPS) + ")")
    g.add_argument("--compare", action=argparse.BooleanOptionalAction, help="also train the bf16 baseline "
                   "(same seed and data order) and end with a comparison table and plot (default: on when "
                   "--recipe is not given)")
    g.add_argument("--activations", choices=ACTIVATIONS, help="fp8: decoder layers converted with coat.convert "
                   "(default: from --recipe)")
    g.add_argument("--dtype", choices=DTYPES,
                   help="autocast dtype (auto: bf16 on GPU, fp32 on CPU)" + _default("dtype"))
    g.add_argument("--device", choices=DEVICES, help="auto: cuda when available" + _default("device"))
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--cuda-graph", action="store_true", help="capture each training step (forward, backward, "
                   "clipping, optimizer step) in CUDA graphs after 3 eager steps and replay it "
                   "(coat.CudaGraphStep): much less host time per step, for small batches where the GPU waits "
                   "on Python; one GPU, no --release-grads / --compile")
    g.add_argument("--threads", **_N, help="CPU threads (default: torch's, capped at the CPUs this process may use)")
    g.add_argument("--seed", **_N, help="seeds model init and batch sampling" + _default("seed"))
    g.add_argument("--seeds", **_N, help="with the comparison: N paired comparisons, seeds --seed .. --seed + N - 1, "
                   "each in OUT/seed_<s>/, then the mean paired difference of final validation loss with its 95%% "
                   "confidence interval (Student t) and a plot of the mean curves with a min-max band; a seed that "
                   "fails does not stop the others, --resume OUT runs the missing ones" + _default("seeds"))


def _output_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("evaluation, output and checkpoints")
    g.add_argument("--eval-every", **_N, help="steps between validation evaluations (default: steps / 10)")
    g.add_argument("--eval-batches", **_N, help="validation batches per evaluation " + _by_device("eval_batches"))
    g.add_argument("--log-every", **_N, help="steps per metrics.jsonl record" + _default("log_every"))
    g.add_argument("--fp8-stats", action="store_true", help="record how much of each FP8 GEMM operand underflows "
                   "to zero or saturates (coat.fp8_stats) in the last step of each --log-every interval: printed, "
                   "in metrics.jsonl and summary.json (a recorded step costs ~10%% more)")
    g.add_argument("--out", metavar="DIR", help="output folder, new or empty (default: a new runs/<timestamp>)")
    g.add_argument("--save", action=argparse.BooleanOptionalAction, help="write the trained model with "
                   "save_pretrained (and the tokenizer) to OUT/model (default: on with --init)")
    g.add_argument("--save-every", **_N, help="write a checkpoint (model, optimizer, scheduler, RNG, data "
                   "position) every N steps and at the end")
    g.add_argument("--keep-last", **_N, help="checkpoints kept (older ones are deleted)" + _default("keep_last"))
    g.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint, "
                   "verified whole and of this run (may change only " + ", ".join(flag(k) for k in RESUME_OVERRIDES)
                   + "; any other flag given must repeat the run's value). A new --steps of a cosine or linear "
                   "schedule continues the decay from the lr at the resume point to --min-lr at the new total "
                   "(no jump). On a finished run, --save exports the model from its final checkpoint")
    g.add_argument("--from-step", **_N, help="with --resume: continue from the checkpoint of step N instead of the "
                   "latest (the later ones are set aside, renamed set-aside-step_*)")
    g.add_argument("--quiet", action="store_true", help="no progress bar or messages")


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # Every flag defaults to "not given" (argparse.SUPPRESS): what is in ``args`` was typed, so a
    # resume can tell "--seed 0" from no --seed.
    given = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    cfg = TrainConfig(**given)
    d = dt.from_env()
    if d.enabled:
        from coat.cli.distributed_train import init, shutdown

        import torch

        # The process group's backend follows the device type, decided the same way on every rank.
        device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
        init(d, device)
    clean = False
    try:
        result = train(cfg, d, set(given))
        clean = True
    except ConfigError as e:
        if d.is_main:
            parser.error(str(e))
        return 2
    except ckpt.WriteError as e:
        if d.is_main:
            print(f"coat train: error: {e}", file=sys.stderr)
        return 1
    except BaseException as e:
        from coat.cli.compare import ChildUsageError
        from coat.cli.main import interrupted

        if isinstance(e, ChildUsageError):  # the child printed its usage error; its folder is removed
            return 2
        if not interrupted(e):
            raise
        print("\naborted; the output folder keeps its whole checkpoints (continue with --resume), and is removed "
              "if the run had written none", file=sys.stderr)
        return 130
    finally:
        if d.enabled:
            shutdown(d, clean)
    return exit_code(result)


def child_main(arg: str) -> int:
    """One recipe of a comparison, in its own process (errors end it with a message, not a traceback)."""
    spec = json.loads(arg)
    cfg = TrainConfig(**spec["cfg"])
    explicit = set(spec["explicit"]) if spec["explicit"] is not None else None
    # Test hook (tests/python/test_cli_train_seeds.py): a fresh (not resumed) run of this --seed fails.
    if cfg.resume is None and os.environ.get("COAT_TEST_FAIL_SEED") == str(cfg.seed):
        print(f"coat train: error: COAT_TEST_FAIL_SEED={cfg.seed}: failing this run", file=sys.stderr)
        return 1
    try:
        return exit_code(train(cfg, explicit=explicit))
    except ConfigError as e:
        print(f"coat train: error: {e}", file=sys.stderr)
        return 2
    except ckpt.WriteError as e:
        print(f"coat train: error: {e}", file=sys.stderr)
        return 1
    except BaseException as e:
        from coat.cli.main import interrupted

        if interrupted(e):
            return 130
        raise
