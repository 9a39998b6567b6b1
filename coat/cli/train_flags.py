"""`coat train`'s command line: its flags, in the groups `--help` shows (model, data, optimization,
runtime, output). Every flag defaults to "not given" (argparse.SUPPRESS); TrainConfig holds the
values a run takes when a flag is not given, and the help texts say them."""

from __future__ import annotations

import argparse

from coat.cli.config import (ACTIVATIONS, DEVICE_DEFAULTS, DEVICES, DTYPES, FP8_GRAD_FORMATS, FP8_GRANULARITIES, INIT_LR, LORA_LR,
                             MASTER_WEIGHTS, MODEL_PRESETS, OPTIM_DEFAULTS, OPTIMIZERS, RESUME_OVERRIDES, SCHEDULES, SIDE_LR, SIDE_R,
                             SNSM_PROJ, TRAIN_SETUPS, V_SCALINGS, TrainConfig, flag, fsdp_unit_arg)
from coat.cli.data import TOKENIZERS


def add_flags(p: argparse.ArgumentParser) -> None:
    """Adds every `coat train` flag to p, group by group."""
    for add_group in (_model_flags, _data_flags, _optimization_flags, _runtime_flags, _output_flags):
        add_group(p)


_N, _X = dict(type=int, metavar="N"), dict(type=float, metavar="X")


def _default(name: str) -> str:  # flags default to "not given"; TrainConfig holds the value
    return f" (default: {getattr(TrainConfig, name)})"


def _by_optim(name: str) -> str:
    return f" (default: {OPTIM_DEFAULTS['adamw'][name]}; {OPTIM_DEFAULTS['snsm'][name]} with --optim snsm, its paper's)"


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
    g.add_argument("--weight-decay", **_X, help="AdamW weight decay (matrices only)" + _by_optim("weight_decay"))
    g.add_argument("--beta1", **_X, help="AdamW beta1" + _default("beta1"))
    g.add_argument("--beta2", **_X, help="AdamW beta2" + _by_optim("beta2"))
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
    g.add_argument("--fp8-grad-format", choices=FP8_GRAD_FORMATS,
                   help="the FP8 layers' output-gradient format: e5m2 (range) or e4m3 (precision) (default: e5m2; "
                        "e4m3 with --fp8-granularity block)")
    g.add_argument("--fp8-fast-accum", action=argparse.BooleanOptionalAction,
                   help="Hopper's fast accumulation in the FP8 layers' forward GEMMs, as TransformerEngine's fprop "
                        "(off: fp32 accumulation there too, a little slower)" + _default("fp8_fast_accum"))
    g.add_argument("--dre", action=argparse.BooleanOptionalAction,
                   help="with --optim coat: Dynamic Range Expansion of the FP8 optimizer states (off: plain "
                        "per-group FP8 scaling)" + _default("dre"))
    g.add_argument("--v-scaling", choices=V_SCALINGS,
                   help="with --optim coat4bit: how the 4-bit v of a matrix is normalized: rank1 (by the maxima of "
                        "its row and column, the paper's) or block (by the max of each 128 elements: no extra pass "
                        "over the gradients, a faster step; docs/optimizers.md)" + _default("v_scaling"))
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
                   "'+': +row / +block (= --fp8-granularity), +release (= --release-grads), +graph (= --cuda-graph), "
                   "+lora (with --lora RANK), +side (= --side-tuning, R 16 unless given), e.g. "
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
    g.add_argument("--fsdp-unit", type=fsdp_unit_arg, metavar="N", help="under torchrun: N consecutive decoder "
                   "layers per FSDP2 fully_shard unit: fewer, larger collectives and less host time per step, N "
                   "layers' weights gathered at a time; auto: the fewest layers whose GEMMs hide FSDP2's host work "
                   "per unit, as many as fit the GPU (coat estimate --fsdp-unit; may change on --resume)"
                   + _default("fsdp_unit"))
    g.add_argument("--fp8-all-gather", action="store_true", help="under torchrun: FSDP2 gathers the FP8 layers' "
                   "weights as FP8 codes, quantized on each rank's shard (half the bytes of a bf16 gather, the same "
                   "training bit for bit; per-tensor FP8 scaling; may change on --resume)")
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
                   "save_pretrained (and the --init model's tokenizer, where it has one) to OUT/model (default: "
                   "on with --init)")
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
