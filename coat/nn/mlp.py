"""Gated MLP (SwiGLU: Llama, Mistral, Qwen; GeGLU with tanh GeLU: Gemma 3) with the FP8 precision flow.

gate/up run as ONE GEMM over [W_gate; W_up] (the norm before it fused, see ``fused.py``); the
SwiGLU and the down projection are one autograd block that saves only the gate/up output in FP8
(1 x 16 groups). In backward, silu(g) * u is recomputed from that copy in the same kernel that
computes dg and du, and feeds the down projection's weight gradient. Parameter names stay
``gate_proj``, ``up_proj``, ``down_proj``: state dicts do not change.
"""

from __future__ import annotations

import torch
from torch import nn

from .._ops import swiglu as sops
from . import adapters as A
from . import block as B
from .block import ACT_IDS, fp8_swiglu_ok, gated
from .fused import norm_linear
from .norm import norm_eps, rms_norm
from .recipe import DEFAULT, Fp8Recipe, resolve

__all__ = ["ACT_IDS", "fp8_swiglu_ok", "swiglu_down", "swiglu", "Fp8SwiGLUMixin", "Fp8SwiGLUMLP"]


def _act_id(act: str) -> int:
    if act not in ACT_IDS:
        raise ValueError(f"act must be one of {tuple(ACT_IDS)}, got {act!r}")
    return ACT_IDS[act]


def swiglu_down(gate_up: torch.Tensor, w_down: torch.Tensor, b_down: torch.Tensor | None, recipe: Fp8Recipe,
                w_scale: torch.Tensor | None = None, act: str = "silu"):
    """down_proj(act(gate) * up) over a fused [.., 2I] gate/up tensor; ``w_scale``: w_down is
    FP8-frozen codes with this scale (``frozen.py``); ``act``: "silu" or "gelu_tanh"."""
    if gate_up.shape[-1] % 2 or w_down.dim() != 2 or w_down.shape[1] * 2 != gate_up.shape[-1]:
        raise ValueError(f"gate_up of width {gate_up.shape[-1]} does not match down_proj {tuple(w_down.shape)}")
    _act_id(act)
    spec = B.make_spec(B.SWIGLU, recipe, gate_up, (w_down,), act=act,
                       frozen_scales=None if w_scale is None else (w_scale,))
    return B.block(gate_up, spec, None, (w_down,), () if b_down is None else (b_down,))


def _bias_list(*linears: nn.Linear) -> list[torch.Tensor]:
    bs = [lin.bias for lin in linears]
    if all(b is None for b in bs):
        return []
    return [b if b is not None else torch.zeros(lin.out_features, device=lin.weight.device, dtype=lin.weight.dtype)
            for b, lin in zip(bs, linears)]


class _SwiGLUFn(torch.autograd.Function):
    """act(gate) * up alone, saving gate/up in FP8 (1 x 16 groups): the MLP's path when down_proj
    carries a LoRA adapter, which needs the activation itself as its input."""

    @staticmethod
    def forward(ctx, gu, recipe, act_id):
        gu2 = gu.reshape(-1, gu.shape[-1])
        if not gu2.is_contiguous():
            gu2 = gu2.contiguous()
        h, q, s = sops.swiglu_fwd(gu2, True, recipe.act_dtype, recipe.e8m0, act_id)
        ctx.save_for_backward(q, s)
        ctx.gu_shape, ctx.act_id = gu.shape, act_id
        return h.reshape(*gu.shape[:-1], h.shape[-1])

    @staticmethod
    def backward(ctx, dh):
        q, s = ctx.saved_tensors
        dgu, _ = sops.swiglu_bwd(q, s, dh.reshape(-1, dh.shape[-1]).contiguous(), False, ctx.act_id)
        return dgu.reshape(ctx.gu_shape), None, None


def swiglu(gate_up: torch.Tensor, recipe: Fp8Recipe, act: str = "silu") -> torch.Tensor:
    """act(gate) * up over a fused [.., 2I] gate/up tensor, its input saved in FP8 where I % 16 == 0."""
    act_id = _act_id(act)
    if fp8_swiglu_ok(gate_up.shape[-1] // 2):
        return _SwiGLUFn.apply(gate_up, recipe, act_id)
    return gated(gate_up, act)


_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


class Fp8SwiGLUMixin:
    """forward() of an FP8 gated MLP over HF's ``gate_proj``/``up_proj``/``down_proj`` linears.
    ``norm`` (an RMSNorm module: its ``weight`` and epsilon) fuses the preceding norm so its output
    is never saved. ``coat_act`` ("silu", "gelu_tanh") and ``coat_unit_offset`` (the norm's
    arithmetic) come from the model family at convert. PEFT LoRA adapters on any of the three add
    their outputs beside the FP8 GEMMs (``adapters.py``)."""

    coat_act = "silu"
    coat_unit_offset = False
    coat_recipe: Fp8Recipe = DEFAULT  # convert sets the model's

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        recipe = self.coat_recipe
        act, uo = self.coat_act, self.coat_unit_offset
        nw = norm.weight if norm is not None else None
        eps = norm_eps(norm) if norm is not None else 0.0
        gate_up = (self.gate_proj, self.up_proj)
        bg, bu = (A.base_linear(m, n) for m, n in zip(gate_up, _GATE_UP))
        bd = A.base_linear(self.down_proj, "mlp.down_proj")
        gu_w, gu_b, gu_s = [bg.weight, bu.weight], _bias_list(bg, bu), A.frozen_scales((bg, bu))
        if A.any_delta(gate_up):  # LoRA: the adapters need the normed input itself
            y = rms_norm(x, nw, eps, recipe, uo) if nw is not None else x
            gu = A.add_deltas(norm_linear(y, None, 0.0, gu_w, gu_b, recipe, gu_s, flat=True), gate_up, _GATE_UP, y)
        else:
            gu = norm_linear(x, nw, eps, gu_w, gu_b, recipe, gu_s, unit_offset=uo)
        d_s = A.frozen_scales((bd,))
        if A.has_delta(self.down_proj):
            h = swiglu(gu, recipe, act)
            out = norm_linear(h, None, 0.0, [bd.weight], [bd.bias] if bd.bias is not None else [], recipe, d_s,
                              flat=True)
            return A.add_deltas(out, (self.down_proj,), ("mlp.down_proj",), h)
        return swiglu_down(gu, bd.weight, bd.bias, recipe, None if d_s is None else d_s[0], act)


class Fp8SwiGLUMLP(Fp8SwiGLUMixin, nn.Module):
    """A standalone Llama-style MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 recipe: Fp8Recipe | str | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.coat_recipe = resolve(recipe)
