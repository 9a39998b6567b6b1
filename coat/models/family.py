"""What a decoder layer of one Hugging Face model family is, as coat's FP8 blocks need to know it.

A family is a description, not code: which norm feeds which fused GEMM, the norm's arithmetic, the
gated MLP's activation, whether q/k carry their own norms, which norms wrap a block's output
("sandwich" norms), and which configuration switches coat cannot honour (it refuses those). The
FP8 blocks (``coat.nn``) read these fields and know no model; ``coat.convert`` finds a model's family
by its ``config.model_type``. Adding a family is one file beside this one and one line in
``coat/models/__init__.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Projections that share one GEMM (and so one per-tensor weight scale), by the block owning them.
#: Every family coat supports names them as Llama does.
GROUPS: dict[str, tuple[tuple[str, ...], ...]] = {
    "self_attn": (("q_proj", "k_proj", "v_proj"), ("o_proj",)),
    "mlp": (("gate_proj", "up_proj"), ("down_proj",)),
}
#: Every projection, in GROUPS' order (LoRA targets, checks).
PROJECTIONS: tuple[str, ...] = tuple(n for groups in GROUPS.values() for g in groups for n in g)

#: Hugging Face activation names -> the gated activation coat's kernels compute.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
#: RMSNorm arithmetic: "scaled" is Llama's w * T(h); "unit_offset" is Gemma's T(h * (1 + w)).
NORM_KINDS = ("scaled", "unit_offset")


@dataclass(frozen=True)
class Family:
    name: str                     # as messages name it ("Llama", "Gemma 3")
    model_types: tuple[str, ...]  # config.model_type values of the family
    hf_module: str                # transformers.models.<hf_module>.modeling_<hf_module>
    layer_class: str              # the decoder layer's class name
    act_config: str = "hidden_act"  # the config attribute naming the MLP activation
    norm: str = "scaled"
    attn_norm: str = "input_layernorm"           # fused into the QKV GEMM
    mlp_norm: str = "post_attention_layernorm"   # fused into the gate/up GEMM
    attn_out_norm: str | None = None             # applied to attention's output before the residual add
    mlp_out_norm: str | None = None              # applied to the MLP's output before the residual add
    qk_norm: bool = False                        # q_norm / k_norm per head, before RoPE
    #: configuration attributes that must be unset (None): what coat's blocks do not compute.
    refused: tuple[str, ...] = ("attn_logit_softcapping", "final_logit_softcapping")

    def __post_init__(self) -> None:
        if self.norm not in NORM_KINDS:
            raise ValueError(f"Family {self.name}: norm must be one of {NORM_KINDS}, got {self.norm!r}")

    @property
    def module_path(self) -> str:
        return f"transformers.models.{self.hf_module}.modeling_{self.hf_module}"

    @property
    def unit_offset(self) -> bool:
        return self.norm == "unit_offset"

    def norms(self) -> tuple[str, ...]:
        """The decoder layer's norm submodules this family's layer has."""
        return tuple(n for n in (self.attn_norm, self.mlp_norm, self.attn_out_norm, self.mlp_out_norm) if n)

    def activation(self, config) -> str:
        """The gated activation of ``config`` ("silu" or "gelu_tanh"); anything else is refused."""
        name = getattr(config, self.act_config, None) if config is not None else "silu"
        act = ACTIVATIONS.get(name)
        if act is None:
            raise ValueError(f"coat.convert supports gated MLPs with activation "
                             f"{' or '.join(sorted(set(ACTIVATIONS)))}; this {self.name} model has "
                             f"{self.act_config}={name!r}")
        return act

    def check(self, config) -> str:
        """Everything ``coat.convert`` asks of ``config`` (a transformers config, or None): the switches
        ``check_config`` refuses, then the activation. Returns the gated activation."""
        self.check_config(config)
        return self.activation(config)

    def check_config(self, config) -> None:
        """Refuses a configuration whose switches coat's blocks would silently ignore."""
        for attr in self.refused:
            value = getattr(config, attr, None)
            if value is not None:
                raise ValueError(f"coat.convert does not support {self.name} models with {attr}={value!r} "
                                 f"(set it to None, or train without coat.convert)")
