"""coat estimate: will it fit? The peak memory of one training step per GPU, part by part, the
largest batch that fits, and a roofline floor of the step time, from the model's configuration
and the recipe's memory plan (``coat/memory.py``). Analytic: no GPU needed, microseconds.

The peak is what ``torch.cuda.max_memory_allocated`` reports over a full step (forward with
labels, backward, optimizer step, zero_grad); ``coat bench`` prints it beside every measured peak
and a test holds it within 10% of every peak in ``benchmarks/results/bench_e2e*.json``. A GPU
needs a little more than the peak (the CUDA context and the allocator's fragmentation): the
"needs" line, which decides the largest batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from coat import memory, models, recipes
from coat.cli.config import fsdp_unit_arg
from coat.memory import GiB, MiB

#: Memory torch reports for common GPUs (GiB), for --gpu / --gpu-memory without the GPU at hand.
GPU_MEMORY_GIB = {"h100": 79.2, "h200": 139.8, "a100-80gb": 79.1, "a100-40gb": 39.4, "l40s": 44.4, "rtx4090": 23.6}
DEFAULT_MEMORY_GIB = 80.0
#: Largest size a config field or flag may hold: far above any real model, far below float overflow.
MAX_SIZE = 2**31 - 1
_SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "head_dim")
#: Recipes whose optimizer is coat.optim's (AdamW, AdamW4bit, SubsetNormSM: the ones gradient release
#: steps inside backward).
_COAT_RECIPES = ("coat", "coat-lean", "coat4bit", "coat4bit-lean", "snsm", "snsm-lean")


def check_model(model: str, recipe: str) -> None:
    """What coat.memory's shape reader lets through but no estimate can use, as ``ValueError``
    naming the config field: a null ``text_config``, booleans or huge numbers as sizes, zero
    KV heads, a model that coat.convert refuses (its activation, soft-capping: ``Family.check``) under a
    recipe whose layers it converts."""
    from coat import memory

    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if model in memory.PRESETS or not os.path.isfile(path):
        return  # load_shape explains a bad path
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return
    if not isinstance(cfg, dict):
        return
    where = f"--model {model!r}" + (f" ({path})" if path != model else "")
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = cfg["text_config"]
        if not isinstance(cfg, dict):
            raise ValueError(f"{where}: text_config is {json.dumps(cfg)}, not the language model's config (an object)")
        where += " text_config"
    for key in _SIZE_FIELDS:
        v = cfg.get(key)
        if key == "head_dim" and v is None:
            continue
        if key in cfg and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SIZE):
            shown = json.dumps(v)
            raise ValueError(f"{where}: {key} must be an integer in [1, {MAX_SIZE}], got "
                             + (shown if len(shown) <= 24 else shown[:20] + "..."))
    fam = models.by_model_type(cfg.get("model_type"))
    if fam is None or recipes.parse(recipe).recipe not in recipes.FP8_RECIPES:
        return  # no family: load_shape refuses its model_type under every recipe; amp, bf16 keep HF's layers
    try:
        fam.check(_hf_config(cfg))  # coat.convert's own checks, on the config transformers makes of the file
    except ValueError as e:
        raise ValueError(f"{where}: recipe {recipe} converts the decoder layers with coat.convert, which refuses "
                         f"this model ({e}); estimate --recipe amp or bf16") from None


def _hf_config(cfg: dict[str, Any]):
    """The transformers config of a ``config.json`` dictionary, as loading the model makes it (its
    class's defaults for what the file leaves out)."""
    from transformers import AutoConfig

    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(cfg["model_type"], **kw)
    except Exception as e:  # noqa: BLE001  transformers raises what its config classes raise
        raise ValueError(f"transformers cannot build its config: {type(e).__name__}: {e}") from None


def check_recipe(recipe: str) -> None:
    s = recipes.parse(recipe)
    base = s.recipe
    if s.has("release") and base not in _COAT_RECIPES:
        raise ValueError(f"--recipe {recipe!r}: gradient release steps coat.optim.AdamW inside backward; recipe "
                         f"{base} uses torch.optim.AdamW (use {' or '.join(r + '+release' for r in _COAT_RECIPES)})")


def _gpu_here() -> tuple[str, float] | None:
    """Name and memory (GiB) of the current GPU, if torch sees one (torch is imported by coat anyway)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return p.name, p.total_memory / GiB


def measure_rates() -> dict[str, Any]:
    """This GPU's dense bf16 and FP8 GEMM rates and copy bandwidth (about a second)."""
    import torch

    def best_ms(fn, reps: int = 10) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return min(times)

    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    rates: dict[str, Any] = {"bf16": 2 * n**3 / best_ms(lambda: x @ x) * 1e3}
    if torch.cuda.get_device_capability() >= (8, 9) and hasattr(torch, "_scaled_mm"):
        x8 = x.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        rates["fp8"] = 2 * n**3 / best_ms(lambda: torch._scaled_mm(x8, x8.t(), scale_a=one, scale_b=one,
                                                                    out_dtype=torch.bfloat16)) * 1e3
    else:
        rates["fp8"] = rates["bf16"]
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    rates["bw"] = 2 * src.numel() / best_ms(lambda: dst.copy_(src)) * 1e3
    rates["source"] = f"measured now on {torch.cuda.get_device_name()}"
    return rates


def _count(n: int) -> str:
    """A parameter count at a scale that shows it: billions, millions, else the number itself."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    if n >= 1e6:
        return f"{n / 1e6:.2f} M"
    return f"{n:,}"


def _gib(b: float) -> str:
    return f"{b / GiB:8.2f} GiB"


def report(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``coat estimate`` prints, as one JSON-able dictionary."""
    shape = memory.load_shape(args.model)
    rec = memory.recipe(args.recipe)
    if args.fp8_granularity != "tensor":
        if rec.fp8_granularity not in ("tensor", args.fp8_granularity):
            raise ValueError(f"--fp8-granularity {args.fp8_granularity}: --recipe {rec.name} names "
                             f"{rec.fp8_granularity} scaling")
        rec = rec.with_granularity(args.fp8_granularity)
    here = _gpu_here()
    gpu = None  # the GPU the fit is sized for, when one is named or present
    if args.gpu_memory is not None:
        mem, mem_src = args.gpu_memory, "--gpu-memory"
    elif args.gpu:
        mem, mem_src, gpu = GPU_MEMORY_GIB[args.gpu], f"--gpu {args.gpu}", args.gpu
    elif here:
        mem, mem_src, gpu = here[1], here[0], here[0]
    else:
        mem, mem_src = DEFAULT_MEMORY_GIB, "default (no GPU here)"
    if args.fsdp_unit not in (1, "auto") and args.gpus == 1:
        raise ValueError("--fsdp-unit applies to FSDP2 plans: give --gpus 2 or more")
    if args.fsdp_unit != "auto" and args.fsdp_unit > shape.layers:
        raise ValueError(f"--fsdp-unit: {args.fsdp_unit} is more than {shape.name}'s {shape.layers} decoder layers")
    if args.fp8_all_gather and (args.gpus == 1 or not memory.fp8_gathered(rec)):
        raise ValueError("--fp8-all-gather applies to FSDP2 plans of FP8 layers with per-tensor scaling: give --gpus "
                         "2 or more and an FP8 recipe (not LoRA, side tuning or row/block granularity)")
    ag = args.fp8_all_gather
    unit = memory.auto_fsdp_unit(shape, rec, args.batch, args.seq, args.gpus, mem, ag) if args.fsdp_unit == "auto" \
        else args.fsdp_unit
    p = memory.plan(shape, rec, args.batch, args.seq, args.gpus, fsdp_unit=unit, fp8_all_gather=ag)
    out = p.to_json()
    # The plan always models a CUDA GPU: a "device" key read as where the estimate ran ("cuda" on
    # a machine without one). "gpu" names the GPU instead, when there is one to name.
    del out["device"]
    out["gpu"] = gpu
    # LoRA: the plan's own summary says what it models (rank, targets)
    modes = [recipes.MODES[m] for m in recipes.parse(rec.name).modes if m != "lora"]
    out.update(recipe_summary="; ".join([rec.summary, *modes]), gpu_memory_gib=mem, gpu_memory_source=mem_src,
               max_batch=memory.max_batch(shape, rec, args.seq, mem, args.gpus, fsdp_unit=args.fsdp_unit,
                                          fp8_all_gather=ag),
               fsdp_unit=unit, fsdp_unit_auto=args.fsdp_unit == "auto", fp8_all_gather=ag)
    rates = None
    if args.measure_rates:
        if not here:
            raise ValueError("--measure-rates needs a CUDA GPU")
        rates = measure_rates()
    elif args.gpu:
        rates = memory.GPU_RATES.get(args.gpu)
    elif here:
        rates = memory.rates_for(here[0])
    if rates:
        out["time"] = memory.step_time_floor(shape, rec, args.batch, args.seq, rates, args.gpus) | {
            "rates_source": rates["source"]}
    return out


def text(r: dict[str, Any], shape: memory.ModelShape) -> str:
    unit = f", {r['fsdp_unit']} layer{'s' if r['fsdp_unit'] > 1 else ''} per unit" + \
        (", chosen by --fsdp-unit auto" if r.get("fsdp_unit_auto") else "") + \
        (", FP8 all-gather" if r.get("fp8_all_gather") else "")
    per = f" per GPU (FSDP2 over {r['gpus']} GPUs{unit})" if r["gpus"] > 1 else ""
    lines = [f"{r['model']}: {_count(r['n_params'])} parameters, {shape.layers} layers, hidden {shape.hidden}, "
             f"vocabulary {shape.vocab}",
             f"recipe {r['recipe']}: {r['recipe_summary']}",
             f"batch {r['batch']} x {r['seq']} tokens{per}", ""]
    other = "start" if r["phase"] == "backward end" else "end"
    lines.append(f"peak memory{per}: {r['peak_gib']:.2f} GiB, at the {r['phase']} "
                 f"(the backward {other} needs {r['other_phase'] / GiB:.2f} GiB)")
    n = r["n_params"] / r["gpus"]
    for name, b in r["parts"].items():
        if b == 0:
            continue
        per_param = name in ("weights", "master weights", "optimizer states", "gradients")
        note = f"   {b / n:.2f} B/param" if per_param else ""
        lines.append(f"  {name:52s}{_gib(b)}{note}")
    per_layer = r["extra"]["saved_per_token_layer"] * r["batch"] * r["seq"]
    lines.append(f"saved activations per layer, by op ({per_layer / MiB:.1f} MiB per layer, "
                 f"{per_layer * shape.layers / GiB:.2f} GiB over {shape.layers} layers, alive at the backward start):")
    for op, ob in r["saved_per_layer_gib"].items():
        lines.append(f"  {op:52s}{ob * GiB / MiB:8.1f} MiB")
    lines.append(f"needs {r['required_gib']:.2f} GiB with the CUDA context and allocator fragmentation "
                 f"({memory.CUDA_CONTEXT / GiB:.1f} GiB + {memory.FRAGMENTATION:.0%})")
    mb = r["max_batch"]
    lines.append(f"largest batch that fits in {r['gpu_memory_gib']:.1f} GiB ({r['gpu_memory_source']}): "
                 + (f"{mb} x {r['seq']} tokens" if mb else "none: not even batch 1")
                 + (" (the search's limit: larger ones fit too)" if mb >= memory.MAX_BATCH_SEARCHED else ""))
    t = r.get("time")
    if t:
        lines.append(f"time per step >= {t['step_ms']:.0f} ms (GEMMs {t['gemm_ms']:.0f} ms + optimizer "
                     f"{t['optimizer_ms']:.0f} ms; {t['rates_source']}), so <= {t['tokens_per_s']:,.0f} tokens/s"
                     + (" per GPU" if r["gpus"] > 1 else ""))
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``estimate`` subcommand to the ``coat`` parser."""
    p = subparsers.add_parser("estimate", help="peak memory of a training step, largest batch that fits",
                              description=__doc__)
    p.add_argument("--model", required=True, metavar="M",
                   help="a preset (" + ", ".join(memory.PRESETS) + "), a Hugging Face config.json, or a checkpoint "
                   "folder")
    p.add_argument("--recipe", default="coat", metavar="R",
                   help="a setup name (coat/recipes.py), as coat train writes it (setup in its summary.json) "
                   "and coat bench runs it; modeled: the recipes " + ", ".join(memory.RECIPES) + " with the modes "
                   "+release, +fused-loss, +hf-loss, +graph (e.g. coat-lean+release); " + recipes.alias_help())
    from coat.nn.recipe import GRANULARITIES

    p.add_argument("--fp8-granularity", choices=GRANULARITIES, default="tensor",
                   help="the FP8 layers' scaling, as coat train's flag (block adds the o_proj input's 128x1 scales "
                        "to what each layer saves; default: tensor)")
    p.add_argument("--batch", type=int, default=1, metavar="B", help="sequences per GPU")
    p.add_argument("--seq", type=int, default=2048, metavar="S", help="tokens per sequence")
    p.add_argument("--gpus", type=int, default=1, metavar="N", help="FSDP2 over N GPUs (figures per GPU)")
    p.add_argument("--fsdp-unit", type=fsdp_unit_arg, default="auto", metavar="K", help="with --gpus N > 1: K decoder "
                   "layers per fully_shard unit, as coat train and coat bench take it (K layers' weights gathered at a "
                   "time); auto: the fewest layers whose GEMMs hide FSDP2's host work per unit, as many as fit "
                   "(default: auto)")
    p.add_argument("--fp8-all-gather", action="store_true", help="with --gpus N > 1: the FP8 layers' weights gathered "
                   "as FP8 codes, as coat train --fp8-all-gather (each gathered layer's linear weights at 1 byte)")
    p.add_argument("--gpu", choices=sorted(GPU_MEMORY_GIB), help="size the fit (and, for h100/h200, the roofline) for "
                   "this GPU")
    p.add_argument("--gpu-memory", type=float, metavar="GiB",
                   help=f"memory per GPU (default: the current GPU's, else {DEFAULT_MEMORY_GIB:g})")
    p.add_argument("--measure-rates", action="store_true", help="measure this GPU's GEMM and copy rates for the "
                   "roofline (default: rates measured before on an H100/H200)")
    p.add_argument("--json", action="store_true", help="print one JSON object (keys include peak_gib, max_batch; "
                   "the figures are for a CUDA GPU, "
                   "'gpu' names it when --gpu names one or one is present)")
    p.set_defaults(handler=lambda args: _run(args, p))


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    for flag, v in (("--batch", args.batch), ("--seq", args.seq), ("--gpus", args.gpus),
                    ("--fsdp-unit", 1 if args.fsdp_unit == "auto" else args.fsdp_unit)):
        if not 1 <= v <= MAX_SIZE:
            parser.error(f"argument {flag}: must be a positive integer up to {MAX_SIZE}, got {v}")
    if args.gpu_memory is not None and not (math.isfinite(args.gpu_memory) and args.gpu_memory > 0):
        parser.error(f"argument --gpu-memory: must be a positive number of GiB, got {args.gpu_memory:g}")
    try:
        check_recipe(args.recipe)
        check_model(args.model, args.recipe)
        r = report(args)
    except ValueError as e:  # coat.memory names the flag: "--model ...", "--recipe ..."
        msg = str(e)
        parser.error(f"argument {msg}" if msg.startswith("--") else msg)
    except OverflowError:  # sizes that pass every check but multiply past a float
        parser.error(f"argument --model: {args.model!r} at --batch {args.batch} x --seq {args.seq} is too large to "
                     "estimate (its byte counts overflow)")
    if args.json:
        json.dump(r, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(text(r, memory.load_shape(args.model)))
    return 0
