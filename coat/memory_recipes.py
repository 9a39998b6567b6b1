"""How each modeled recipe stores a training step, for the memory plan (``coat.memory``): bytes per
parameter of each persistent part, the saved-activation table its layers follow, and the transients
it adds. The recipe names and their meaning are ``coat.recipes``'s."""

from __future__ import annotations

from dataclasses import dataclass, replace

from coat import recipes as names

class NotModeled(ValueError):
    """What the memory plan has no table for (coat bench then measures without an estimate)."""


#: coat.optim.AdamW: per moment 1 byte of FP8 code + per 128-element group a fp32 max and a 1-byte exponent.
COAT_STATE_BYTES = 2 * (1 + 5 / 128)
#: coat.optim.AdamW4bit on a decoder model: 4-bit m with an fp32 absmax per 128 elements, 4-bit v with
#: rank-1 (row and column) maxima on the matrices, two buffers of them: ~8 (rows + cols) / (rows cols)
#: B/param, 0.002-0.004 on Llama-2-7B's matrices; the few small tensors (norms) keep fp32 states.
ADAMW4_STATE_BYTES = 1 + 4 / 128 + 0.004
#: The same with ``v_scaling="block"`` (``+v-block``): both moments with an fp32 absmax per 128.
ADAMW4_BLOCK_STATE_BYTES = 1 + 8 / 128
#: coat.optim.SubsetNormSM's rank in the snsm setups (its default, and coat train's).
SNSM_RANK = 128


def snsm_matrix_bytes(rows: int, cols: int, rank: int) -> int:
    """State bytes of one SN-SM matrix in fp32: the subset norm (one value per row of a tall matrix,
    per column of a wide one) and the rank-r momentum and projection (coat.optim._snsm.state_bytes;
    tests/python/test_memory_snsm.py checks that the two agree)."""
    r = min(rank, rows, cols)
    return 4 * max(rows, cols) + 4 * r * (rows + cols)


def _snsm_matrices(s) -> list[tuple[int, int, int]]:
    """(rows, cols, how many) of the matrices SubsetNormSM steps in a decoder model: each layer's
    projections and an untied LM head (snsm_param_groups' split)."""
    h, q, kv, i = s.hidden, s.q_width, s.kv_width, s.intermediate
    mats = [(q, h, s.layers), (kv, h, 2 * s.layers), (h, q, s.layers), (i, h, 2 * s.layers), (h, i, s.layers)]
    return mats + ([] if s.tied else [(s.vocab, h, 1)])


def snsm_state_bytes(s, rank: int) -> float:
    """Optimizer-state bytes of SubsetNormSM on model shape ``s``: SN-SM on the matrices, FP8 AdamW
    (COAT_STATE_BYTES per parameter) on the embedding, norms and biases."""
    mats = _snsm_matrices(s)
    matrix_params = sum(r * c * k for r, c, k in mats)
    return sum(snsm_matrix_bytes(r, c, rank) * k for r, c, k in mats) + COAT_STATE_BYTES * (s.n_params - matrix_params)


#: coat.optim._snsm.CHUNK: elements of a matrix one slice of the update touches.
SNSM_CHUNK = 1 << 24


def snsm_step_transient(s, rank: int) -> float:
    """The largest transient of SubsetNormSM's step over the matrices: a refresh (the fp32 gradient
    and the thin SVD's factors) or an update slice (~24 bytes per element of at most SNSM_CHUNK)."""
    def worst(r: int, c: int) -> int:
        k = min(r, c)
        return max(4 * (r * c + r * k + k * c + k), 24 * min(r * c, SNSM_CHUNK))

    return float(max(worst(r, c) for r, c, _ in _snsm_matrices(s)))


@dataclass(frozen=True)
class Recipe:
    """How a recipe stores a step: bytes per parameter of each persistent part, which saved-activation
    table its layers follow, and which transients it adds. One entry of ``RECIPES`` per recipe of
    ``coat.recipes`` that is modeled (or a ``with_modes`` variant): names and their meaning are there."""

    name: str
    summary: str
    param_bytes: int  # the model's weights
    master_bytes: int  # a separate master copy held by the optimizer (fp32 master of bf16 weights)
    state_bytes: float  # optimizer states
    grad_bytes: int
    activations: str  # key of ``ACTIVATION_TABLES``
    fsdp_activations: str  # the table under FSDP2 (AMP computes with bf16 weights gathered in bf16)
    weight_copies: bool = False  # autocast's bf16 copy of each linear weight, saved for backward
    fp8_weights: bool = False  # FP8 GEMMs: the largest fused weight exists in FP8 while its op runs
    fsdp_reduce_bytes: int = 2  # FSDP2 reduce-scatter dtype
    grad_release: bool = False  # optimizer step inside backward: one layer's gradients at a time
    fused_loss: bool = False  # LM head + cross-entropy chunked over tokens: no full logits
    # coat.nn.loss.DEFAULT_CHUNK_MIB: compute-dtype (bf16) logits of one chunk at most this many MiB.
    loss_chunk_mib: float = 512.0
    # The step replayed from CUDA graphs: the same plan (a replay allocates nothing beyond what the
    # captured eager step did).
    graph: bool = False
    # LoRA (coat bench's setups): rank-LORA_RANK adapters on every decoder linear, fp32 (PEFT casts
    # the adapters of a bf16 model to fp32), torch AdamW over them; the base (weights at
    # param_bytes) frozen, so it has no master copy, states or gradients.
    lora: bool = False
    # Side tuning (coat.SideTuned, r=16, coat bench's ``+side`` setups): the base frozen in FP8 and run
    # without autograd; the side network trains with this recipe's optimizer (coat.memory_side).
    side: bool = False
    # coat.optim.SubsetNormSM (the snsm setups): its rank; the states are then snsm_state_bytes, not
    # state_bytes per parameter, and its step adds snsm_step_transient. One GPU only (no FSDP2).
    snsm_rank: int = 0
    # The FP8 layers' scaling (coat.nn.recipe.GRANULARITIES): "block" adds the o_proj input's 128x1
    # scales to what a layer saves (fp32 per 128 tokens per channel: 1/32 byte per element).
    fp8_granularity: str = "tensor"
    # coat.optim.AdamW4bit's v_scaling (``+v-block``: "block", state_bytes ADAMW4_BLOCK_STATE_BYTES).
    v_scaling: str = "rank1"

    def with_v_block(self) -> "Recipe":
        """This 4-bit recipe with v in blocks of 128 on the matrices too (``+v-block``)."""
        base, *mods = self.name.split("+")
        if base not in names.ADAMW4_RECIPES:
            raise ValueError(f"--recipe {self.name}+v-block: +v-block is coat.optim.AdamW4bit's: recipes "
                             f"{', '.join(names.ADAMW4_RECIPES)}")
        return replace(self, v_scaling="block", state_bytes=ADAMW4_BLOCK_STATE_BYTES,
                       name=names.Setup(base, tuple(m for m in names.MODES if m in {*mods, "v-block"})).name)

    def with_granularity(self, granularity: str) -> "Recipe":
        """This recipe with its FP8 layers scaled at ``granularity`` (only FP8 recipes have one)."""
        from coat.nn.recipe import GRANULARITIES

        if granularity not in GRANULARITIES:
            raise ValueError(f"--fp8-granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
        if granularity != "tensor" and not self.activations.startswith("coat"):
            raise ValueError(f"--fp8-granularity {granularity}: --recipe {self.name} has no FP8 layers")
        if granularity != "tensor" and (self.side or self.lora):
            raise ValueError(f"--fp8-granularity {granularity}: --recipe {self.name} keeps its frozen base in FP8 "
                             "with per-tensor scales (row and block scaling need 'tensor' there)")
        base, *mods = self.name.split("+")
        mods = [m for m in mods if m not in ("row", "block")] + ([granularity] if granularity != "tensor" else [])
        return replace(self, fp8_granularity=granularity,
                       name=names.Setup(base, tuple(m for m in names.MODES if m in mods)).name)

    def with_modes(self, *, grad_release: bool | None = None, fused_loss: bool | None = None,
                   graph: bool | None = None, lora: bool | None = None, side: bool | None = None) -> "Recipe":
        """This recipe with gradient release, the fused loss, CUDA graphs and/or LoRA switched on or
        off (named ``<name>+release``, ``+fused-loss`` where the base recipe has none, ``+hf-loss``
        where it has one and it is switched off, ``+graph``, ``+lora``)."""
        r = replace(self, grad_release=self.grad_release if grad_release is None else grad_release,
                    fused_loss=self.fused_loss if fused_loss is None else fused_loss,
                    graph=self.graph if graph is None else graph, lora=self.lora if lora is None else lora,
                    side=self.side if side is None else side)
        base = self.name.split("+")[0]
        default_fused = RECIPES[base].fused_loss if base in RECIPES else self.fused_loss
        mods = {"release": r.grad_release, "fused-loss": r.fused_loss and not default_fused,
                "hf-loss": default_fused and not r.fused_loss, "graph": r.graph, "lora": r.lora, "side": r.side,
                r.fp8_granularity: r.fp8_granularity != "tensor", "v-block": r.v_scaling == "block"}
        r = replace(r, name=names.Setup(base, tuple(m for m in names.MODES if mods.get(m))).name)  # the setup asked for
        if r.side and not self.side:
            if base not in names.SIDE_RECIPES or r.lora or r.grad_release or not r.fused_loss:
                raise ValueError(f"--recipe {r.name}: side tuning is modeled for {', '.join(names.SIDE_RECIPES)} "
                                 "with the fused loss, eager or replayed from CUDA graphs (+graph), without other "
                                 "modes (coat train's and coat bench's setups)")
        if r.lora and not self.lora:
            # coat bench's two LoRA setups, with their own loss paths: bf16+lora (PEFT on Hugging Face's
            # layers) and coat+lora (PEFT on coat.convert's layers, the base kept only in FP8:
            # convert(frozen_weights="fp8"), the fused loss).
            if r.grad_release or (base, r.fused_loss) not in (("bf16", False), ("coat", True)):
                raise ValueError(f"--recipe {r.name}: LoRA is modeled for bf16+lora and coat+lora (coat bench's "
                                 "setups, with their graph variants) only")
            table, base_summary = {"bf16": ("hf-bf16-lora", "bf16 weights"),
                                   "coat": ("coat-lora", "coat.convert, decoder weights in FP8 only")}[base]
            r = replace(r, activations=table, fsdp_activations=table, master_bytes=0, state_bytes=0, grad_bytes=0,
                        summary=f"{base_summary} (the base, frozen), PEFT LoRA r={LORA_RANK} on every decoder "
                        "linear (fp32 adapters, torch AdamW)")
        return r


#: The rank of ``+lora`` setups (coat bench's LoRA setups: r=16 on every decoder linear).
LORA_RANK = 16

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("amp", "fp32 weights, bf16 autocast, torch.optim.AdamW(fused=True)", 4, 0, 8, 4, "hf-amp", "hf-bf16",
           weight_copies=True, fsdp_reduce_bytes=4),
    Recipe("bf16", "bf16 weights, torch.optim.AdamW(fused=True) (bf16 states)", 2, 0, 4, 2, "hf-bf16", "hf-bf16"),
    # coat.convert installs the fused LM head + loss by default.
    Recipe("coat", "bf16 weights, coat.convert, coat.optim.AdamW (FP8 states, fp32 master)", 2, 4, COAT_STATE_BYTES,
           2, "coat", "coat", fp8_weights=True, fused_loss=True),
    Recipe("coat-lean", "bf16 weights, coat.convert, coat.optim.AdamW(master_weights='bf16_sr')", 2, 0,
           COAT_STATE_BYTES, 2, "coat", "coat", fp8_weights=True, fused_loss=True),
    Recipe("coat4bit", "bf16 weights, coat.convert, coat.optim.AdamW4bit (4-bit states, fp32 master)", 2, 4,
           ADAMW4_STATE_BYTES, 2, "coat", "coat", fp8_weights=True, fused_loss=True),
    Recipe("coat4bit-lean", "bf16 weights, coat.convert, coat.optim.AdamW4bit(master_weights='bf16_sr')", 2, 0,
           ADAMW4_STATE_BYTES, 2, "coat", "coat", fp8_weights=True, fused_loss=True),
    Recipe("snsm", "bf16 weights, coat.convert, coat.optim.SubsetNormSM (rank 128, fp32 master)", 2, 4, 0.0, 2,
           "coat", "coat", fp8_weights=True, fused_loss=True, snsm_rank=SNSM_RANK),
    Recipe("snsm-lean", "bf16 weights, coat.convert, coat.optim.SubsetNormSM(master_weights='bf16_sr')", 2, 0, 0.0,
           2, "coat", "coat", fp8_weights=True, fused_loss=True, snsm_rank=SNSM_RANK),
)}


def recipe(name: str) -> Recipe:
    """The plan of setup ``name`` (``coat.recipes``): ``RECIPES[name]``, or a ``with_modes``
    variant (``+release``, ``+fused-loss``, ``+hf-loss``, ``+graph``, ``+lora``, ``+side``). ``ValueError``
    naming --recipe for a name that is unknown or not modeled."""
    s = names.parse(name)
    if s.recipe not in RECIPES:
        peer = s.recipe in names.PEERS
        kind, what = ("setup", names.PEERS[s.recipe]) if peer else ("recipe", names.RECIPES[s.recipe])
        raise ValueError(f"--recipe {name!r}: {kind} {s.recipe} ({what}) has no memory model (modeled: "
                         f"{', '.join(RECIPES)})")
    r = RECIPES[s.recipe]
    for g in ("row", "block"):
        if s.has(g):
            r = r.with_granularity(g)
    if s.has("v-block"):
        r = r.with_v_block()
    if not s.modes:
        return r
    fused = True if s.has("fused-loss") else False if s.has("hf-loss") else None
    return r.with_modes(grad_release=True if s.has("release") else None, fused_loss=fused,
                        graph=True if s.has("graph") else None, lora=True if s.has("lora") else None,
                        side=True if s.has("side") else None)
