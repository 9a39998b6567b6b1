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
from coat.cli.config import (COAT_OPTIMIZERS, RESUME_OVERRIDES, ConfigError, TrainConfig, artifact, check_init_flags,
                             expand_setup, explicit_fields, flag, lr_lambda, resolve_config, validate)
from coat.cli.data import MAX_TOKEN_ID, corpus_digest, default_cache_dir, load_corpus
from coat.cli.plan import RunPlan
from coat.cli.train_flags import add_flags
from coat.cli.model import build_model, build_optimizer, eval_batch_count, evaluate, lm_loss

__all__ = ["TrainConfig", "ConfigError", "resolve_config", "validate", "lr_lambda", "build_model",
           "build_optimizer", "lm_loss", "evaluate", "train", "prepare", "register"]



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
    if cfg.from_step is not None and ran.lr_anchor and cfg.from_step < ran.lr_anchor[0]:
        raise ConfigError("--from-step", f"step {cfg.from_step} comes before step {ran.lr_anchor[0]}, where the run in "
                          f"{folder} was extended to --steps {ran.steps}: its lr schedule before that step is not "
                          "recorded, so the resumed lr would jump. Resume from a checkpoint of step "
                          f">= {ran.lr_anchor[0]}")
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
        _check_frozen_base(cfg, init)
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
    if cfg.fsdp_unit not in (1, "auto") and not d.enabled:
        raise ConfigError("--fsdp-unit", "applies to FSDP2 runs: start coat train under torchrun "
                                         "(torchrun --nproc_per_node N -m coat train ...)")
    if cfg.fp8_all_gather and (cfg.compile or cfg.fp8_granularity != "tensor"):
        raise ConfigError("--fp8-all-gather", "gives per-tensor weight codes to eager layers: not with --compile or "
                          f"--fp8-granularity {cfg.fp8_granularity}")
    if cfg.fp8_all_gather and not d.enabled and cfg.resume is None:  # a resume of a torchrun run is refused below
        raise ConfigError("--fp8-all-gather", "applies to FSDP2 runs: start coat train under torchrun")
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
    corpus.info["digest"] = corpus_digest(corpus)
    for split, tokens in (("train", corpus.train), ("validation", corpus.val)):
        if chat_data.is_packed(tokens):  # whole examples in rows of --seq-len: one row per rank is enough
            if len(tokens) < (d.world if split == "train" else 1):
                raise ConfigError("--data", f"the {split} split packs into {len(tokens)} rows of --seq-len "
                                  f"{cfg.seq_len} tokens, fewer than the {d.world} ranks")
        elif len(tokens) // d.world <= cfg.seq_len + 1:
            raise ConfigError("--seq-len", f"{cfg.seq_len} is too long for the {split} split ({len(tokens)} tokens"
                              + (f" over {d.world} ranks" if d.enabled else "") + ")")
    scored = eval_batch_count(cfg, d.world) * cfg.batch_size * cfg.seq_len  # predicted tokens
    if not chat_data.is_packed(corpus.val) and scored > len(corpus.val) - 1:  # evenly spaced windows then overlap
        corpus.info["val_tokens_scored_per_token"] = round(scored / (len(corpus.val) - 1), 2)
        note = (f"note: the validation split has {len(corpus.val):,} tokens, and each evaluation predicts {scored:,} "
                f"(--eval-batches {cfg.eval_batches} x --batch-size {cfg.batch_size} x --seq-len {cfg.seq_len}): its "
                f"windows overlap, so its loss rests on those {len(corpus.val):,} tokens only (more held-out text: "
                "--val-fraction; fewer windows: --eval-batches)")
        if d.is_main:
            log(note)
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
    if saved.get("corpus", {}).get("split") == "tokens" and corpus.info.get("split") == "text":
        raise ConfigError("--data", f"the run in {folder} held out the last tokens of its data after training its "
                          "BPE tokenizer on all of it, held-out text included; coat now holds out the text's tail "
                          "first and trains the tokenizer on the rest, so that run's tokens are not made again: "
                          "start it afresh")
    counts = (saved.get("corpus", {}).get("train_tokens"), saved.get("corpus", {}).get("val_tokens"))
    now = (chat_data.n_tokens(corpus.train), chat_data.n_tokens(corpus.val))
    if counts != now:
        raise ConfigError("--data", f"the data changed since the run in {folder} started ({counts[0]} train / "
                          f"{counts[1]} val tokens then, {now[0]} / {now[1]} now)")
    then = saved.get("corpus", {}).get("digest")  # absent in runs from before it was recorded
    if then is not None and then != corpus.info["digest"]:
        raise ConfigError("--data", f"the data changed since the run in {folder} started: as many tokens, but "
                          f"not the same ones (digest {then[:12]} then, {corpus.info['digest'][:12]} now); resume "
                          "with the data the run started with, or start a new run")
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


def _check_frozen_base(cfg: TrainConfig, init: Any) -> None:
    """A LoRA or side-tuning run's checkpoints hold only what trains: its resume must find the same
    --init weights (a base re-saved in place would be trained on silently)."""
    import json

    from coat.cli import pretrained

    if init is None or cfg.compare or not (cfg.lora or cfg.side_tuning):
        return
    then = (json.loads((Path(cfg.resume) / "config.json").read_text()).get("init") or {}).get("weights")
    if then is None:  # older runs recorded no stamp
        return
    now = pretrained.weights_stamp(init.path)
    if now != then:
        raise ConfigError("--init", f"the weight files of {init.path} changed since the run in {cfg.resume} started "
                          f"(stamp {then} then, {now} now); its checkpoints hold only the trained "
                          f"{'LoRA adapters' if cfg.lora else 'side network'}, so it resumes on the same base only")


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
    add_flags(p)
    p.set_defaults(handler=lambda args: _run(args, p))


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
