"""Names of training setups: one vocabulary for ``coat train``, ``coat estimate`` and ``coat bench``.

A setup name is a recipe, then modes, joined with '+': ``coat``, ``coat-lean+release``,
``coat+lora+graph``. The recipe says what the weights, the layers and the optimizer are; each
mode adds one thing to the step. What ``coat train`` ran is written under this name (``setup`` in
its config.json and summary.json) and can be handed as is to ``coat estimate --recipe`` (which
models the memory of most of them: ``coat.memory``) and ``coat bench --recipe`` (which runs the
ones in ``coat.cli.bench_worker.SETUPS``). Pure data, no torch import.
"""

from __future__ import annotations

from typing import NamedTuple

#: The recipes, each a one-line description.
RECIPES: dict[str, str] = {
    "amp": "fp32 weights, bf16 autocast, torch.optim.AdamW",
    "bf16": "bf16 weights, torch.optim.AdamW (bf16 states)",
    "fp32": "fp32 weights and compute, torch.optim.AdamW",
    "fp8": "FP8 layers (coat.convert), torch.optim.AdamW on fp32 weights",
    "coat": "FP8 layers (coat.convert), coat.optim.AdamW (FP8 states) with fp32 master weights",
    "coat-lean": "coat with master_weights='bf16_sr': bf16 weights and no fp32 copy",
    "coat4bit": "FP8 layers (coat.convert), coat.optim.AdamW4bit (4-bit states) with fp32 master weights",
    "coat4bit-lean": "coat4bit with master_weights='bf16_sr': bf16 weights and no fp32 copy",
    "snsm": "FP8 layers (coat.convert), coat.optim.SubsetNormSM (Subset-Norm + Subspace-Momentum on the matrices, "
            "FP8 AdamW on the rest) with fp32 master weights",
    "snsm-lean": "snsm with master_weights='bf16_sr': bf16 weights and no fp32 copy",
}

#: The modes, in the order they are written; each a one-line description.
MODES: dict[str, str] = {
    "row": "the FP8 layers scale per token and per weight channel (Fp8Recipe(granularity='row'))",
    "block": "the FP8 layers scale 1x128 activation/gradient groups and 128x128 weight tiles "
             "(Fp8Recipe(granularity='block'))",
    "v-block": "coat.optim.AdamW4bit's v in blocks of 128 on the matrices too (v_scaling='block'): no statistics "
               "pass, a faster step, 1/32 B/param more",
    "lora": "PEFT LoRA adapters, the base weights frozen",
    "side": "Quantized Side Tuning (coat.SideTuned): the base frozen in FP8 and run without grad, a side network "
            "of width hidden/16 trains beside it",
    "release": "gradient release: the optimizer steps each layer inside backward and frees its gradients",
    "fused-loss": "coat's fused LM head + loss, chunked, no full logits (the FP8 recipes have it already)",
    "hf-loss": "Hugging Face's loss path instead of coat's fused one",
    "graph": "the step replayed from CUDA graphs (coat.CudaGraphStep)",
}

#: Setups of other libraries that ``coat bench`` runs beside coat's (no modes).
PEERS: dict[str, str] = {
    "torchao": "torchao float8 training + per-layer torch.compile + AdamW8bit(bf16_stochastic_round)",
    "qlora": "PEFT QLoRA: bitsandbytes 4-bit NF4 base + LoRA adapters",
}

#: Names ``coat bench`` used before this vocabulary; still accepted, written in the new form.
ALIASES: dict[str, str] = {
    "coat-release": "coat+release",
    "coat-lean-release": "coat-lean+release",
    "coat-graph": "coat+graph",
    "coat-lean-graph": "coat-lean+graph",
    "coat-lean-hfloss": "coat-lean+hf-loss",
    "lora-bf16": "bf16+lora",
    "lora-coat": "coat+lora",
    "lora-coat-graph": "coat+lora+graph",
}


#: The recipes ``+side`` combines with: their layers keep a frozen base in FP8 (coat.convert).
SIDE_RECIPES = ("fp8", "coat", "coat-lean")
#: The recipes whose optimizer is coat.optim.AdamW4bit (``+v-block`` sets its v_scaling).
ADAMW4_RECIPES = ("coat4bit", "coat4bit-lean")
#: The recipes with FP8 layers, which ``+row`` and ``+block`` scale more finely.
FP8_RECIPES = ("fp8", "coat", "coat-lean", "coat4bit", "coat4bit-lean", "snsm", "snsm-lean")


class Setup(NamedTuple):
    recipe: str
    modes: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return "+".join((self.recipe, *self.modes))

    def has(self, mode: str) -> bool:
        return mode in self.modes


def parse(name: str, flag: str = "--recipe") -> Setup:
    """The setup ``name`` stands for, its modes in canonical order (an old name becomes its new
    form). Raises ``ValueError`` naming ``flag`` and what is unknown."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{flag}: a setup name is required (e.g. coat, coat-lean+release)")
    base, *mods = ALIASES.get(name, name).split("+")
    if base in PEERS:
        if mods:
            raise ValueError(f"{flag} {name!r}: {base} is another library's setup and takes no modes")
        return Setup(base)
    if base not in RECIPES:
        raise ValueError(f"{flag} {name!r}: unknown recipe {base!r} (recipes: {', '.join(RECIPES)}; modes after "
                         f"'+': {', '.join(MODES)})")
    for m in mods:
        if m not in MODES:
            raise ValueError(f"{flag} {name!r}: unknown mode {m!r} (modes: {', '.join(MODES)})")
        if mods.count(m) > 1:
            raise ValueError(f"{flag} {name!r}: mode {m!r} given twice")
    if "fused-loss" in mods and "hf-loss" in mods:
        raise ValueError(f"{flag} {name!r}: fused-loss and hf-loss exclude each other")
    if "side" in mods and "lora" in mods:
        raise ValueError(f"{flag} {name!r}: side and lora exclude each other (each is a way to fine-tune)")
    if "row" in mods and "block" in mods:
        raise ValueError(f"{flag} {name!r}: row and block exclude each other (each is a scaling of the FP8 layers)")
    scaled = [m for m in ("row", "block") if m in mods]
    if scaled and base not in FP8_RECIPES:
        raise ValueError(f"{flag} {name!r}: +{scaled[0]} scales the FP8 layers: recipes {', '.join(FP8_RECIPES)}")
    if scaled and ("lora" in mods or "side" in mods):
        raise ValueError(f"{flag} {name!r}: +{scaled[0]} does not combine with a base frozen in FP8 (lora, side)")
    if "v-block" in mods and base not in ADAMW4_RECIPES:
        raise ValueError(f"{flag} {name!r}: +v-block is coat.optim.AdamW4bit's v scaling: recipes "
                         f"{', '.join(ADAMW4_RECIPES)}")
    if "side" in mods and base not in SIDE_RECIPES:
        raise ValueError(f"{flag} {name!r}: side tuning runs on the FP8 frozen base: recipes "
                         f"{', '.join(SIDE_RECIPES)}")
    return Setup(base, tuple(m for m in MODES if m in mods))


def canonical(name: str) -> str:
    """``name`` as this vocabulary writes it; a name it does not know is returned unchanged."""
    try:
        return parse(name).name
    except ValueError:
        return name


def describe(name: str) -> str:
    """One line: the recipe's description, then each mode's."""
    s = parse(name)
    if s.recipe in PEERS:
        return PEERS[s.recipe]
    return "; ".join([RECIPES[s.recipe], *(MODES[m] for m in s.modes)])


def help_text() -> str:
    """The vocabulary in a sentence, for --help."""
    return ("recipes " + ", ".join(RECIPES) + "; modes after '+': " + ", ".join(MODES)
            + " (e.g. coat-lean+release)")


def alias_help() -> str:
    return "older names (" + ", ".join(ALIASES) + ") still work"
