"""One configuration (setup, model, batch) of the whole-model benchmark, in a process of its own.

``coat bench`` and ``benchmarks/bench_e2e.py`` start this module once per configuration
(``python -m coat.cli.bench_worker CONFIG_JSON``, or under torchrun for ``--fsdp``), so every
measurement starts from an empty allocator and an out-of-memory ends only its own configuration.
It writes its result as JSON to ``CONFIG["result"]`` (``.rank<r>`` appended under torchrun).

What one configuration measures (a step = forward with labels -> loss, backward, optimizer step,
``zero_grad(set_to_none=True)``, on random token ids):
- ``warmup`` steps (they create the optimizer states; torchao compiles here), then on a GPU:
  three steps each issued on an idle GPU, for the host figures: ``host_ms`` is the wall time of the
  Python step call (the built-in steps never synchronize, so it returns once every kernel is
  queued; once the host is a full launch queue ahead of the GPU it waits for the GPU, so this is
  an upper bound of the host's own work), ``cpu_ms`` the process's CPU time over it; then one
  untimed step and ``steps`` steps back to back, as a training loop runs them, with a CUDA event
  between consecutive steps and no synchronisation until the end: ``step_ms`` is the median event
  interval, tokens/s = tokens of those steps / their total time, ``spread`` = (max - min) / median
  interval. On a CPU the timed steps are wall-timed one by one;
- ``COAT_BENCH_GPU_GIB=40`` caps the process at that much GPU memory
  (``torch.cuda.set_per_process_memory_fraction``), to show what fits a smaller card;
- ``peak_gib``: ``torch.cuda.max_memory_allocated`` over the timed steps (reset after warm-up);
  ``resident_gib``: ``memory_allocated`` after the last ``zero_grad``. On a CPU both come from a
  tracker of live tensor storages (same meaning: bytes of tensors alive), over one step after warm-up.

A setup is one entry of ``SETUPS``: a function of the freshly built model that returns the step function.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
import weakref
from contextlib import nullcontext, suppress
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from coat import memory, models, recipes
from coat.integrations import fp8_gather, fsdp as coat_fsdp
from coat.memory_side import SIDE_R  # the coat+side setup: side width hidden / SIDE_R (QST default)

GiB = memory.GiB
StepFn = Callable[[torch.Tensor], None]


@dataclass
class Context:
    device: torch.device
    mesh: Any  # a DeviceMesh under --fsdp, else None
    lr: float = 1e-5
    layers_per_unit: int = 1  # decoder layers per fully_shard unit (--fsdp-unit)
    fp8_all_gather: bool = False  # the FP8 layers' weights gathered as FP8 codes (--fp8-all-gather)


@dataclass(frozen=True)
class Setup:
    name: str  # in coat.recipes' vocabulary, as coat train and coat estimate name the same setup
    summary: str
    param_dtype: torch.dtype  # the dtype the model is built in
    prepare: Callable[[torch.nn.Module, Context], StepFn]
    needs: tuple[str, ...] = ()  # modules that must import; else the setup is skipped
    cuda_only: bool = False
    fsdp: bool = True  # runs under --fsdp
    graphed: bool = False  # the step is a coat.CudaGraphStep (its capture is part of the peak)
    build: Callable[..., torch.nn.Module] | None = None  # how the model is made (default: ``build_model``)

    @property
    def recipe(self) -> str | None:
        """The memory plan printed beside the measurement: coat.memory's plan of this setup's
        name, None where it has none (peers)."""
        try:
            return memory.recipe(self.name).name
        except ValueError:
            return None


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, autocast, graphed: bool = False) -> StepFn:
    if graphed:  # warm-up eager steps, then the captured step (coat.CudaGraphStep), in the bench's warm-up
        import coat

        graph = coat.CudaGraphStep(model, opt, warmup_steps=1)
        return lambda ids: graph(input_ids=ids, labels=ids, use_cache=False)

    losses: list[torch.Tensor] = []  # every step's loss, on the device: read once, after the timing

    def step(ids: torch.Tensor) -> None:
        with autocast:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    step.losses = losses
    return step


def _shard(model: torch.nn.Module, ctx: Context, mp_policy=None) -> None:
    """FSDP2: one ``fully_shard`` per ``ctx.layers_per_unit`` decoder layers, then the root."""
    coat_fsdp.shard(model, ctx.mesh, ctx.device, mp_policy, ctx.layers_per_unit, ctx.fp8_all_gather)


def _torch_adamw(model: torch.nn.Module, ctx: Context) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=ctx.lr, fused=True)


def _prep_amp(model, ctx):
    if ctx.mesh is not None:  # fp32 sharded weights, bf16 compute, fp32 gradient reduction
        from torch.distributed.fsdp import MixedPrecisionPolicy

        _shard(model, ctx, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        return _train_step(model, _torch_adamw(model, ctx), nullcontext())
    return _train_step(model, _torch_adamw(model, ctx), torch.autocast(ctx.device.type, dtype=torch.bfloat16))


def _prep_bf16(model, ctx):
    if ctx.mesh is not None:
        _shard(model, ctx)
    return _train_step(model, _torch_adamw(model, ctx), nullcontext())


def _prep_coat(master: str, release: bool = False, fused_loss: bool = True, graphed: bool = False,
               optim: str = "AdamW", granularity: str = "tensor", **opt_kw):
    # coat.convert's defaults (FP8 layers, fused LM head + loss); ``release``: the optimizer steps
    # inside backward (coat.optim.step_in_backward); ``fused_loss=False``: Hugging Face's loss path;
    # ``graphed``: the step replayed from CUDA graphs (coat.CudaGraphStep); ``optim``: the class in
    # coat.optim (AdamW: FP8 states, AdamW4bit: 4-bit states, SubsetNormSM); ``granularity``: the
    # FP8 layers' scaling (Fp8Recipe.granularity); ``opt_kw``: more of the optimizer's arguments.
    def prepare(model, ctx):
        import coat
        import coat.optim

        coat.convert(model, recipe=coat.Fp8Recipe(granularity=granularity), fused_loss=fused_loss)
        if ctx.mesh is not None:
            _shard(model, ctx)
        # SubsetNormSM: Subset-Norm + Subspace-Momentum on the projection matrices, FP8 AdamW on the rest
        params = coat.optim.snsm_param_groups(model) if optim == "SubsetNormSM" else model.parameters()
        opt = getattr(coat.optim, optim)(params, lr=ctx.lr, master_weights=master, **opt_kw)
        if release:
            coat.optim.step_in_backward(opt, model)
        return _train_step(model, opt, nullcontext(), graphed)

    return prepare


def _prep_torchao(model, ctx):
    # The torchao peer recipe: torchao float8 training (tensorwise scaling) on every linear whose
    # dims suit FP8 GEMMs (the LM head stays bf16), each decoder layer compiled (torchtitan's
    # practice; one compiled graph serves every layer), and torchao's 8-bit AdamW with bf16
    # stochastic rounding (no master weights).
    from torchao.float8 import convert_to_float8_training
    from torchao.optim import AdamW8bit

    def keep(mod: torch.nn.Module, fqn: str) -> bool:
        return isinstance(mod, torch.nn.Linear) and fqn != "lm_head" and mod.in_features % 16 == 0 \
            and mod.out_features % 16 == 0

    convert_to_float8_training(model, module_filter_fn=keep)
    # A layer whose guards differ from the first compiled one would recompile; never fall back to eager.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in model.model.layers:
        layer.compile()
    opt = AdamW8bit(model.parameters(), lr=ctx.lr, bf16_stochastic_round=True)
    return _train_step(model, opt, nullcontext())


LORA_TARGETS = list(models.PROJECTIONS)


def _prep_lora(on_coat: bool, graphed: bool = False):
    # Issue 17: rank-16 LoRA on every linear layer of the decoder (PEFT's defaults otherwise), the
    # base frozen; torch fused AdamW over the adapters. coat: FP8 GEMMs with the frozen base kept
    # only in FP8 (coat.convert(..., frozen_weights="fp8")), adapters in BF16 beside them.
    def prepare(model, ctx):
        import peft

        if on_coat:
            import coat

            coat.convert(model, recipe="coat")
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
        if on_coat:
            coat.convert(model, recipe="coat", frozen_weights="fp8")
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=ctx.lr, fused=True,
                                capturable=graphed)
        return _train_step(model, opt, nullcontext(), graphed)

    return prepare




def _build_frozen(shape, dtype, device):
    from coat.cli.bench_frozen import build_frozen_fp8  # the layers stored in FP8 one at a time (70B on one GPU)

    return build_frozen_fp8(shape, dtype, device)


def _prep_side(graphed: bool = False):
    return lambda model, ctx: _side_step(model, ctx, graphed)


def _side_step(model, ctx, graphed: bool):
    # Issue 31: Quantized Side Tuning (coat.SideTuned) on coat's FP8 layers: the base frozen and
    # stored in FP8 (frozen_weights="fp8"), run under no_grad; a side network of width hidden / 16
    # trains with coat.optim.AdamW (FP8 states, fp32 master), the base's fused LM head + loss. The model
    # comes from _build_frozen: its layers already frozen in FP8 (convert again: the fused loss, the recipe).
    import coat
    import coat.optim

    coat.convert(model, recipe="coat")
    side = coat.SideTuned(model, r=SIDE_R)
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()  # the bf16 weights the FP8 codes replaced
    opt = coat.optim.AdamW(side.side_parameters(), lr=ctx.lr, master_weights="fp32")
    step = _train_step(side, opt, nullcontext(), graphed)
    step.tensors = side.side_parameters()  # built outside the model: counted by the CPU tracker too
    return step


def _prep_qlora(model, ctx):
    # The QLoRA recipe (Dettmers et al.; PEFT's documented path): every decoder linear as a
    # bitsandbytes 4-bit NF4 layer with double quantization and bf16 compute, then
    # peft.prepare_model_for_kbit_training (it keeps the remaining non-quantized weights in fp32)
    # and rank-16 LoRA on every decoder linear; torch fused AdamW over the adapters.
    import bitsandbytes as bnb
    import peft

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if type(lin) is not torch.nn.Linear:
                    continue
                q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                      compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4")
                q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, compress_statistics=True,
                                             quant_type="nf4")
                if lin.bias is not None:
                    q.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
                setattr(parent, name, q.to(ctx.device))  # quantizes the weight on the GPU
    torch.cuda.empty_cache()
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=ctx.lr, fused=True)
    return _train_step(model, opt, nullcontext())


# SN-SM refreshes with the randomized range finder: a full SVD of a 7B model's 225 matrices takes
# ~4 minutes at the first step (benchmarks/RESULTS.md section 19), longer than a bench.
_SNSM = dict(optim="SubsetNormSM", proj_type="randomized")
SETUPS: dict[str, Setup] = {s.name: s for s in (
    Setup("amp", "fp32 weights, bf16 autocast, torch fused AdamW (FSDP2: MixedPrecisionPolicy bf16/fp32)",
          torch.float32, _prep_amp),
    Setup("bf16", "bf16 weights, torch fused AdamW", torch.bfloat16, _prep_bf16),
    Setup("coat", "bf16 weights, coat.convert, coat.optim.AdamW (fp32 master)", torch.bfloat16, _prep_coat("fp32")),
    Setup("coat-lean", "bf16 weights, coat.convert, coat.optim.AdamW(master_weights='bf16_sr')", torch.bfloat16,
          _prep_coat("bf16_sr")),
    Setup("coat+release", "coat with the optimizer step inside backward (coat.optim.step_in_backward)",
          torch.bfloat16, _prep_coat("fp32", release=True)),
    Setup("coat-lean+release", "coat-lean with the optimizer step inside backward", torch.bfloat16,
          _prep_coat("bf16_sr", release=True)),
    Setup("coat4bit", "bf16 weights, coat.convert, coat.optim.AdamW4bit (4-bit states, fp32 master)",
          torch.bfloat16, _prep_coat("fp32", optim="AdamW4bit")),
    Setup("coat4bit-lean", "bf16 weights, coat.convert, coat.optim.AdamW4bit(master_weights='bf16_sr')",
          torch.bfloat16, _prep_coat("bf16_sr", optim="AdamW4bit")),
    Setup("coat4bit-lean+release", "coat4bit-lean with the optimizer step inside backward", torch.bfloat16,
          _prep_coat("bf16_sr", release=True, optim="AdamW4bit")),
    Setup("coat4bit-lean+v-block+release", "coat4bit-lean+release, v in blocks of 128 (AdamW4bit(v_scaling='block'))",
          torch.bfloat16, _prep_coat("bf16_sr", release=True, optim="AdamW4bit", v_scaling="block")),
    Setup("snsm", "bf16 weights, coat.convert, coat.optim.SubsetNormSM (SN-SM rank 128 on the matrices, randomized "
          "refresh, FP8 AdamW on the rest, fp32 master)", torch.bfloat16, _prep_coat("fp32", **_SNSM), fsdp=False),
    Setup("snsm-lean", "bf16 weights, coat.convert, coat.optim.SubsetNormSM(master_weights='bf16_sr')", torch.bfloat16,
          _prep_coat("bf16_sr", **_SNSM), fsdp=False),
    Setup("snsm-lean+release", "snsm-lean with the optimizer step inside backward", torch.bfloat16,
          _prep_coat("bf16_sr", release=True, **_SNSM), fsdp=False),
    Setup("coat+row", "coat with row scaling (per token, per weight channel)", torch.bfloat16,
          _prep_coat("fp32", granularity="row")),
    Setup("coat+block", "coat with block scaling (1x128 activations and gradients, 128x128 weights)", torch.bfloat16,
          _prep_coat("fp32", granularity="block")),
    Setup("coat-lean+block+release", "coat-lean with block scaling and the optimizer step inside backward",
          torch.bfloat16, _prep_coat("bf16_sr", release=True, granularity="block")),
    Setup("coat+graph", "coat, the step replayed from CUDA graphs (coat.CudaGraphStep)", torch.bfloat16,
          _prep_coat("fp32", graphed=True), cuda_only=True, fsdp=False, graphed=True),
    Setup("coat-lean+graph", "coat-lean, the step replayed from CUDA graphs (coat.CudaGraphStep)", torch.bfloat16,
          _prep_coat("bf16_sr", graphed=True), cuda_only=True, fsdp=False, graphed=True),
    Setup("coat-lean+hf-loss", "coat-lean with Hugging Face's loss path (convert(fused_loss=False))",
          torch.bfloat16, _prep_coat("bf16_sr", fused_loss=False)),
    Setup("torchao", "peer: torchao float8 training + per-layer torch.compile + AdamW8bit(bf16_stochastic_round)",
          torch.bfloat16, _prep_torchao, needs=("torchao",), cuda_only=True, fsdp=False),
    Setup("bf16+lora", "PEFT LoRA r=16 on all decoder linears, bf16 frozen base, torch fused AdamW",
          torch.bfloat16, _prep_lora(False), needs=("peft",), fsdp=False),
    Setup("coat+lora", "coat.convert + PEFT LoRA r=16 on all decoder linears, base frozen in FP8, torch fused AdamW",
          torch.bfloat16, _prep_lora(True), needs=("peft",), fsdp=False),
    Setup("qlora", "PEFT QLoRA: bitsandbytes 4-bit NF4 decoder linears + LoRA r=16 on all of them, torch fused AdamW",
          torch.bfloat16, _prep_qlora, needs=("peft", "bitsandbytes"), cuda_only=True, fsdp=False),
    Setup("coat+side", f"coat.convert + coat.SideTuned(r={SIDE_R}): base frozen in FP8 under no_grad, side network "
          "of width hidden/16, coat.optim.AdamW", torch.bfloat16, _prep_side(), fsdp=False, build=_build_frozen),
    Setup("coat+side+graph", "coat+side, the step replayed from CUDA graphs (coat.CudaGraphStep)", torch.bfloat16,
          _prep_side(graphed=True), cuda_only=True, fsdp=False, build=_build_frozen, graphed=True),
    Setup("coat+lora+graph", "coat+lora, the step replayed from CUDA graphs (coat.CudaGraphStep)",
          torch.bfloat16, _prep_lora(True, graphed=True), needs=("peft",), cuda_only=True, fsdp=False, graphed=True),
)}


def unavailable(setup: Setup, device: str, fsdp: bool) -> str | None:
    """Why ``setup`` cannot run here (None: it can)."""
    if setup.cuda_only and device != "cuda":
        return f"{setup.name} needs a CUDA GPU"
    if fsdp and not setup.fsdp:
        return f"{setup.name} has no --fsdp variant"
    import importlib.util

    for mod in setup.needs:
        if importlib.util.find_spec(mod) is None:
            return f"{setup.name} needs {mod}, which is not installed (pip install {mod})"
    return None


# ---- model -------------------------------------------------------------------------------------------


def build_model(shape: memory.ModelShape, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A randomly initialized Hugging Face causal LM of ``shape``, built directly on ``device`` in ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**shape.hf_config())
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in dtype: no fp32 copy of a bf16 model
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(prev)
    return model.train()


# ---- host memory tracker (CPU runs) ------------------------------------------------------------------


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages alive: the storages of ``tensors`` (the model's, alive throughout)
    plus every storage an op creates while the mode is on, until it is freed. The CPU's
    ``max_memory_allocated``."""

    def __init__(self, tensors=()) -> None:
        super().__init__()
        # Keyed by the storage's address, not its Python object: an in-place op on a parameter
        # returns a tensor whose storage object may be a new wrapper of the same memory.
        self._live: dict[int, Any] = {}
        for t in tensors:
            st = t.untyped_storage()
            self._live[st.data_ptr()] = st.nbytes()  # never freed while the model lives
        self.current = self.peak = sum(self._live.values())

    def reset_peak(self) -> None:
        self.peak = self.current

    def _free(self, key: int, ref: Any, nbytes: int) -> None:
        if self._live.get(key) is ref:
            del self._live[key]
            self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                n, key = st.nbytes(), st.data_ptr()
                if n and key not in self._live:
                    self._live[key] = weakref.ref(st, lambda r, k=key, n=n: self._free(k, r, n))
                    self.current += n
                    self.peak = max(self.peak, self.current)
        return out


# ---- measurement -------------------------------------------------------------------------------------


def is_oom(e: BaseException) -> bool:
    msg = str(e)
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in msg.lower() or "ALLOC_FAILED" in msg


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(step: StepFn, ids: torch.Tensor, warmup: int, steps: int, dev: torch.device,
            model: torch.nn.Module, deadline: float | None = None, track_cpu: bool = True,
            graphed: bool = False) -> dict[str, Any]:
    """Warm-up, then timed steps; memory as described in the module docstring. ``graphed``: the
    warm-up captures CUDA graphs, whose replays allocate nothing, so the peak is not reset after it
    (it then covers the eager warm-up steps and the capture). ``track_cpu=False``
    (FSDP2 on CPU ranks: it frees gathered weights by resizing storages, which no op reports) leaves
    the CPU memory figures out."""
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    if dev.type == "cpu" and not track_cpu:
        for _ in range(warmup):
            step(ids)
    elif dev.type == "cpu":
        tracker = LiveBytes(list(model.parameters()) + list(model.buffers()) + list(getattr(step, "tensors", [])))
        with tracker:
            for _ in range(warmup):
                step(ids)
            tracker.reset_peak()
            step(ids)  # the step whose peak is reported
        out["peak_gib"] = tracker.peak / GiB
        out["resident_gib"] = tracker.current / GiB
    else:
        _sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)  # not the model's build and conversion
        for _ in range(warmup):
            step(ids)
        _sync(dev)
        if not graphed:
            torch.cuda.reset_peak_memory_stats(dev)
    out["warmup_s"] = time.perf_counter() - t0
    if dev.type == "cuda":
        out.update(_measure_cuda(step, ids, steps, dev, deadline))
        return out
    host, cpu = [], []
    for i in range(steps):
        if deadline is not None and i >= 2 and time.time() > deadline:
            out["steps_cut"] = f"{i} of {steps} timed steps (time budget)"
            break
        c0, w0 = time.process_time(), time.perf_counter()
        step(ids)
        w1, c1 = time.perf_counter(), time.process_time()
        host.append((w1 - w0) * 1e3)
        cpu.append((c1 - c0) * 1e3)
    med = statistics.median(host)
    out.update(step_ms=med, step_ms_all=[round(x, 3) for x in host], spread=(max(host) - min(host)) / med,
               host_ms=med, cpu_ms=statistics.median(cpu), tokens_per_s=ids.numel() / med * 1e3,
               timed_steps=len(host))
    return out


def _measure_cuda(step: StepFn, ids: torch.Tensor, steps: int, dev: torch.device,
                  deadline: float | None) -> dict[str, Any]:
    """Two passes. Host: a few steps each issued on an idle GPU, so the wall time of the Python call
    is the host's work until every kernel is queued -> host_ms, cpu_ms (an upper bound of the host's
    own work: once the host is a full launch queue ahead of the GPU it waits for it;
    benchmarks/bench_host.py times the host's own work on a narrow copy of the model).
    Throughput: one untimed step, then ``steps`` steps back to back, as a training loop runs them
    (the host issues the next step while the GPU finishes the last), one CUDA event between
    consecutive steps and no synchronisation until the end -> step_ms (median of the per-step event
    intervals), tokens/s (tokens of all timed steps over their total time), spread ((max - min) /
    median of the intervals)."""
    host, cpu = [], []
    for _ in range(min(3, steps)):
        _sync(dev)
        c0, w0 = time.process_time(), time.perf_counter()
        step(ids)
        host.append((time.perf_counter() - w0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    _sync(dev)
    out: dict[str, Any] = {}
    # One untimed step first: the first step after a synchronization starts with an empty launch
    # queue and pays for the host's head start, which steps run back to back never do.
    step(ids)
    events = [torch.cuda.Event(enable_timing=True)]
    events[0].record()
    for i in range(steps):
        if deadline is not None and i >= 2 and time.time() > deadline:
            out["steps_cut"] = f"{i} of {steps} timed steps (time budget)"
            break
        step(ids)
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()
    events[-1].synchronize()
    gpu = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
    total = events[0].elapsed_time(events[-1])
    med = statistics.median(gpu)
    out.update(peak_gib=torch.cuda.max_memory_allocated(dev) / GiB, resident_gib=torch.cuda.memory_allocated(dev) / GiB,
               reserved_gib=torch.cuda.max_memory_reserved(dev) / GiB,
               step_ms=med, step_ms_all=[round(x, 3) for x in gpu], spread=(max(gpu) - min(gpu)) / med,
               host_ms=statistics.median(host), cpu_ms=statistics.median(cpu),
               tokens_per_s=ids.numel() * len(gpu) / total * 1e3, timed_steps=len(gpu))
    return out


def _versions() -> dict[str, Any]:
    import importlib.metadata as md

    v: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for pkg in ("transformers", "torchao", "coat"):
        with suppress(md.PackageNotFoundError):
            v[pkg] = md.version(pkg)
    return v


def run_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration; returns its result (never raises for out-of-memory)."""
    setup = SETUPS[recipes.canonical(cfg["setup"])]
    shape = memory.ModelShape(**cfg["shape"])
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    fsdp = bool(cfg.get("fsdp"))
    dev_type = cfg.get("device", "auto").replace("auto", "cuda" if torch.cuda.is_available() else "cpu")
    res: dict[str, Any] = {"setup": setup.name, "model": shape.name, "shape": asdict(shape), "batch": cfg["batch"],
                           "seq": cfg["seq"], "world": world if fsdp else 1, "rank": rank, "run_id": cfg.get("run_id"),
                           "commit": cfg.get("commit"), "warmup": cfg["warmup"], "steps": cfg["steps"],
                           "recipe": setup.recipe, **_versions()} | ({"fsdp_unit": cfg.get("fsdp_unit", 1)} if fsdp else {})
    mesh = None
    if fsdp:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dev_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if dev_type == "cuda" else "gloo")
        mesh = init_device_mesh(dev_type, (world,))
    dev = torch.device(dev_type, torch.cuda.current_device()) if dev_type == "cuda" else torch.device("cpu")
    res["device"] = torch.cuda.get_device_name(dev) if dev_type == "cuda" else "cpu"
    if dev_type == "cuda":
        res["gpu_memory_gib"] = torch.cuda.get_device_properties(dev).total_memory / GiB
        cap = os.environ.get("COAT_BENCH_GPU_GIB")  # act as a smaller card: e.g. 40 for a 40 GB GPU
        if cap:
            torch.cuda.set_per_process_memory_fraction(min(1.0, float(cap) * GiB / (res["gpu_memory_gib"] * GiB)), dev)
            res["gpu_memory_cap_gib"] = float(cap)
    why = unavailable(setup, dev_type, fsdp)
    if why:
        return res | {"status": "skipped", "reason": why}
    phase = "build"
    try:
        torch.manual_seed(cfg.get("seed", 0))
        t0 = time.perf_counter()
        # Under FSDP the matrices wait on the meta device until _shard: a rank holds its shards only.
        with coat_fsdp.matrices_on_meta() if fsdp and setup.build is None else nullcontext():
            model = (setup.build or build_model)(shape, setup.param_dtype, dev)
        ctx = Context(dev, mesh, Context.lr, cfg.get("fsdp_unit", 1), cfg.get("fp8_all_gather", False))
        step = setup.prepare(model, ctx)
        ag = fp8_gather.state(coat_fsdp.decoder_layers(model)) if fsdp else None
        res |= {"fp8_all_gather": ag} if ag is not None else {}
        res["init_s"] = time.perf_counter() - t0
        g = torch.Generator(device=dev).manual_seed(1234 + rank)
        ids = torch.randint(0, shape.vocab, (cfg["batch"], cfg["seq"]), device=dev, generator=g)
        phase = "steps"
        res.update(measure(step, ids, cfg["warmup"], cfg["steps"], dev, model, cfg.get("deadline"), track_cpu=not fsdp,
                           graphed=setup.graphed))
        if getattr(step, "losses", None):  # the same batch every step: a loss that falls shows the step trains
            res["losses"] = [round(x, 4) for x in torch.stack(step.losses).float().tolist()]
        res["status"] = "ok"
        if fsdp:  # every rank's peak, so rank 0 alone can report the group
            import torch.distributed as dist

            peaks: list[Any] = [None] * world
            dist.all_gather_object(peaks, res.get("peak_gib"))
            res["rank_peak_gib"] = peaks
    except Exception as e:  # noqa: BLE001 - every failure becomes this configuration's result
        if not is_oom(e):
            raise
        res.update(status="oom", phase=phase, error=str(e).splitlines()[0][:300])
        if dev_type == "cuda":
            res["peak_gib"] = torch.cuda.max_memory_allocated(dev) / GiB
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m coat.cli.bench_worker CONFIG_JSON (started by coat bench)", file=sys.stderr)
        return 2
    cfg = json.loads(argv[0])
    path = cfg["result"]
    if "RANK" in os.environ and cfg.get("fsdp"):
        path += f".rank{os.environ['RANK']}"
    try:
        res = run_config(cfg)
    except Exception as e:  # noqa: BLE001
        res = {"setup": cfg.get("setup"), "batch": cfg.get("batch"), "status": "error",
               "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    with open(path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(path + ".tmp", path)  # the orchestrator never reads half a file
    ok = res.get("status") in ("ok", "skipped")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if not ok:
            # Peers may wait in a collective this rank will never join, and tearing the group down
            # would wait with them: leave at once; the non-zero exit makes torchrun stop the group.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(3)
        dist.barrier()  # no rank tears its group down while a peer still writes its result
        dist.destroy_process_group()
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
