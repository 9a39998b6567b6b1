"""Quantized Side Tuning (QST, Zhang et al., ACL 2024) on coat's FP8 frozen base.

The base causal LM is frozen and converted with ``coat.convert(base, frozen_weights="fp8")``: its
projections are kept only as FP8 codes, and it runs under ``torch.no_grad()``, so it saves nothing
for backward. Beside it a narrow side network trains: the base's hidden state after each decoder
layer (and its embedding output) is downsampled (Linear(hidden, downsample) -> SiLU ->
Linear(downsample, hidden // r) -> RMSNorm) and mixed into the side stream by learnable gates
``g = sigmoid(alpha)``, one per side channel (alpha = -0.5 at first: QST's 0.62 on the side
stream); the side stream runs through L small Llama decoder layers of width hidden // r, one beside
each base layer. At the top the side stream is upsampled and mixed with the base's final hidden
state by gates ``w = sigmoid(beta)``, one per hidden channel (beta = 1 at first, QST's), then the
base's frozen final norm and LM head take it, through coat's fused LM head + loss when labels are
given (the logits never exist). The upsample starts at zero, so the model starts as the base: the
final RMSNorm cancels w's uniform scale, up to its epsilon and one rounding.

Layout of the side stream (L base layers, h_0 the embedding output, h_i base layer i's output)::

    s = D_0(h_0)
    for i in 1..L:  s = side_i(s);  s = g_i * D_i(h_i) + (1 - g_i) * s
    h = w * h_L + (1 - w) * up(s)          -> final norm -> LM head (-> fused loss)

(Format 1, until 2026-11-27, had one scalar top gate used as is, starting at exactly 1: every
gradient into the side network was scaled by 1 - w = 0 at first, and the side network learned only
as fast as AdamW moved w; benchmarks/RESULTS.md section 23 measures the difference.)

docs/side_tuning.md describes the API, the defaults and what is not done yet.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import models
from .convert import convert
from .fp8.tensor import Fp8Tensor
from .functional import dequantize, quantize_per_group
from .memory_side import input_group as _input_group  # shared with the memory plan, as the head rule is
from .memory_side import side_heads
from .nn import adapters
from .nn._cache import cache_name
from .nn.lm_head_loss import fused_lm_head_loss
from .nn.norm import norm_eps

__all__ = ["SideTuned"]

CONFIG_FILE = "side_config.json"
WEIGHTS_FILE = "side_model.safetensors"
_FORMAT = "coat-side-tuning/2"


def _positive_int(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_base(base) -> models.Family:
    if not isinstance(base, nn.Module):
        raise ValueError(f"base must be a torch.nn.Module (a Hugging Face causal LM), got {type(base).__name__}")
    if callable(getattr(base, "get_base_model", None)):
        raise ValueError("base must be a plain Hugging Face causal LM, not a PEFT model (its adapters would train "
                         "beside the side network)")
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    fam = models.by_model_type(model_type)
    if fam is None:
        raise ValueError(f"base: side tuning supports {models.names()} causal LMs; got {type(base).__name__}"
                         + (f" (model_type={model_type!r})" if model_type else ""))
    inner = getattr(base, "model", None)
    for name, obj in (("model.layers", getattr(inner, "layers", None)), ("model.norm", getattr(inner, "norm", None)),
                      ("lm_head", getattr(base, "lm_head", None))):
        if obj is None:
            raise ValueError(f"base has no {name}: not a {fam.name} causal LM")
    return fam


def _freeze_and_convert(base: nn.Module) -> None:
    """Freezes every parameter of ``base`` and stores its projections in FP8 (keeping the recipe of
    an already converted base). Refuses a base whose projections could not be stored in FP8."""
    layers = base.model.layers
    recipe = getattr(layers[0].self_attn, "coat_recipe", None) if len(layers) else None
    base.requires_grad_(False)
    convert(base, **({"recipe": recipe} if recipe is not None else {}), frozen_weights="fp8")
    plain = [n for n, m in base.named_modules() if isinstance(m, nn.Linear) and n.startswith("model.layers.")
             and not adapters.is_frozen_fp8(m)]
    trainable = [n for n, p in base.named_parameters() if p.requires_grad]
    if plain or trainable:
        raise ValueError(f"base: frozen_weights='fp8' conversion left {(plain or trainable)[0]} "
                         f"{'outside FP8' if plain else 'trainable'}; side tuning needs the whole base frozen in FP8")


def _side_layer_config(base, width: int, intermediate: int | None, heads: int | None) -> dict:
    cfg = base.config
    heads = side_heads(width) if heads is None else _positive_int(heads, "num_heads")
    if width % heads or (width // heads) % 2:
        raise ValueError(f"num_heads={heads} must divide the side width {width} into an even head dimension")
    if intermediate is None:
        intermediate = max(width, cfg.intermediate_size // (cfg.hidden_size // width))
    return dict(hidden_size=width, intermediate_size=_positive_int(intermediate, "intermediate_size"),
                num_attention_heads=heads, num_key_value_heads=heads, head_dim=width // heads,
                rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
                max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 2048)))


def _downsampler(hidden: int, downsample: int, width: int, eps: float) -> nn.Sequential:
    return nn.Sequential(nn.Linear(hidden, downsample), nn.SiLU(), nn.Linear(downsample, width),
                         nn.RMSNorm(width, eps=eps))


class _Fp8SavedInputLinear(torch.autograd.Function):
    """A Linear computed in the input's dtype whose input is kept for backward only as FP8 codes
    (E4M3, one fp32 scale per 1 x 128 group): the downsampler's first Linear reads the base's
    full-width hidden state, the largest thing side tuning keeps (L + 1 states per token). The
    forward is exactly ``F.linear``; only the weight gradient sees the input rounded to E4M3, as
    COAT's FP8 linears' weight gradients do."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        y = torch.nn.functional.linear(x, weight, bias)
        group = _input_group(x.shape[-1])
        if not weight.requires_grad:
            codes, scales = None, None
        elif group is None:
            codes, scales = x, None  # (no FP8 group divides the width: kept as it is)
        else:
            q = quantize_per_group(x.reshape(-1, x.shape[-1]).contiguous(), group, "e4m3")
            codes, scales = q.data, q.scale
        ctx.group, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = group, x.shape, x.dtype, weight.dtype
        ctx.needs = (x.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        ctx.save_for_backward(codes, scales, weight if x.requires_grad else None)
        return y

    @staticmethod
    def backward(ctx, dy):
        codes, scales, weight = ctx.saved_tensors
        dx = dw = db = None
        d2 = dy.reshape(-1, dy.shape[-1])
        if ctx.needs[0]:
            dx = (d2 @ weight.to(dy.dtype)).reshape(ctx.x_shape)
        if ctx.needs[1]:
            x = codes if ctx.group is None else dequantize(
                Fp8Tensor(codes, scales, ctx.group), ctx.x_dtype)
            dw = (d2.t() @ x.reshape(-1, ctx.x_shape[-1]).to(dy.dtype)).to(ctx.w_dtype)
        if ctx.needs[2]:
            db = d2.sum(0).to(ctx.w_dtype)
        return dx, dw, db


def _same_weights(seen: list, params, layer: int) -> None:
    """A checkpointed side block's guard: its first run (forward) records its weights' version
    counters, its recomputation (backward) refuses weights changed in place since then, as autograd
    refuses a modified saved tensor (a recomputation with other weights would give other gradients,
    silently)."""
    versions = [p._version for p in params]
    if not seen:
        seen.append(versions)
    elif versions != seen[0]:
        raise RuntimeError(f"side layer {layer}: a weight was modified in place between the forward and the "
                           "backward; its recomputation (SideTuned.recompute) would use the new values. Call "
                           "backward before changing the side network's weights, or set recompute=False")


def _down_head(seq: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """A downsampler's first Linear (``_downsampler``'s modules) on a base hidden state, keeping the
    state only in FP8 for its weight gradient: hidden -> downsample width."""
    first = seq[0]
    return _Fp8SavedInputLinear.apply(x, first.weight, first.bias) if torch.is_grad_enabled() else first(x)


def _down_tail(seq: nn.Sequential, y: torch.Tensor) -> torch.Tensor:
    """The rest of a downsampler: SiLU -> Linear(downsample, side width) -> RMSNorm."""
    for m in list(seq)[1:]:
        y = m(y)
    return y


def _check_tensors(tensors: dict, want: dict, where: str) -> None:
    """``tensors`` has exactly ``want``'s names, each a floating-point tensor of its shape."""
    if not isinstance(tensors, dict) or set(tensors) != set(want):
        diff = sorted(set(tensors) ^ set(want)) if isinstance(tensors, dict) else type(tensors).__name__
        raise ValueError(f"{where}: the saved side weights do not match this side network ({diff[:3]})")
    for k, v in want.items():
        t = tensors[k]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.shape != v.shape:
            raise ValueError(f"{where}: {k} has {getattr(t, 'dtype', type(t).__name__)} of shape "
                             f"{tuple(getattr(t, 'shape', ()))}, expected a floating-point tensor of shape "
                             f"{tuple(v.shape)}")


#: Causal LM keywords whose meaning the side network does not implement: refused, not ignored.
_UNSUPPORTED = {"past_key_values": "KV caches", "inputs_embeds": "input embeddings in place of input_ids",
                "use_cache": "KV caches", "output_hidden_states": "hidden states in the output",
                "output_attentions": "attention weights in the output"}


def _refuse_unsupported(kwargs: dict) -> None:
    for name, what in _UNSUPPORTED.items():
        value = kwargs.get(name)
        if value is not None and value is not False:
            shown = repr(value) if isinstance(value, bool) else f"<{type(value).__name__}>"
            raise ValueError(f"{name}={shown}: coat.SideTuned does not support {what} (its forward recomputes "
                             "the whole sequence through the base and the side network); pass the whole sequence "
                             "as input_ids")


class _Recorder:
    """Forward hooks on the base's decoder layers, for one forward: each hidden state the side
    network reads (layer 0's input, the embedding output, and every layer's output) goes through
    its downsampler's first Linear as soon as its layer has run, so the base's full-width states
    are not kept beyond their layer (only FP8 copies are, for those Linears' weight gradients); the
    last layer's output (the final norm's input) is kept whole for the top mix. ``grad``: whether the downsamplers
    record autograd (the base itself runs under no_grad)."""

    def __init__(self, layers: nn.ModuleList, down: nn.ModuleList, grad: bool):
        self.down, self.grad = down, grad
        self.states: list[torch.Tensor] = []  # the first Linear of D_i on h_i (downsample width)
        self.last: torch.Tensor | None = None
        self._first_state: torch.Tensor | None = None
        self.handles = [layers[0].register_forward_pre_hook(self._first, with_kwargs=True)]
        self.handles += [layer.register_forward_hook(self._output) for layer in layers]

    def _first(self, module, args, kwargs):
        self._first_state = args[0] if args else kwargs["hidden_states"]

    def _output(self, module, args, out):
        # Outside the layer's own forward (its post-hooks run after it): nothing computed here is
        # counted as something the base saves.
        out = out[0] if isinstance(out, (tuple, list)) else out
        with torch.set_grad_enabled(self.grad):
            if self._first_state is not None:
                self.states.append(_down_head(self.down[0], self._first_state))
                self._first_state = None
            if len(self.states) >= len(self.down):
                raise RuntimeError(f"the base ran more decoder layers than the {len(self.down) - 1} the side network has")
            self.states.append(_down_head(self.down[len(self.states)], out))
        self.last = out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


class _Caches:
    """The KV caches of one ``generate`` call: the base's (its family's layer kinds, e.g. sliding
    windows) and the side network's, each passed under the name its forward takes."""

    def __init__(self, st: "SideTuned"):
        from transformers import DynamicCache

        self.base = DynamicCache(config=st.base.config)
        self.side = DynamicCache()
        self.base_kw = cache_name(type(st.base.model).forward)
        self.side_kw = cache_name(type(st.layers[0]).forward) if len(st.layers) else "cache"


def _step_mask(mask: torch.Tensor, q: int, dtype: torch.dtype) -> torch.Tensor:
    """The side layers' additive mask [batch, 1, q, kv] for q new tokens after kv - q cached ones:
    causal among the new tokens, padded keys hidden."""
    kv = mask.shape[1]
    dev = mask.device
    causal = torch.ones(q, kv, dtype=torch.bool, device=dev).tril(kv - q)
    allowed = causal[None, None] & mask[:, None, None, :].bool()
    return torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill(~allowed, torch.finfo(dtype).min)


def _pick(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int | None,
          generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row: the argmax, or a draw from softmax(logits / temperature) over the
    top_k logits."""
    if not do_sample:
        return logits.argmax(-1)
    z = logits / temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = z.topk(top_k, -1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    return torch.multinomial(torch.softmax(z, -1), 1, generator=generator)[:, 0]


def _check_generate(input_ids, attention_mask, max_new_tokens, temperature, top_k, eos_token_id) -> list[int]:
    """Refuses bad generate arguments, naming them; returns the eos ids as a list."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long \
            or input_ids.shape[1] == 0:
        raise ValueError("input_ids must be a [batch, prompt] int64 tensor with at least one token")
    if attention_mask is not None:
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, "
                             f"got {tuple(attention_mask.shape)}")
        m = attention_mask.bool()
        if bool((m[:, :-1] & ~m[:, 1:]).any()) or not bool(m[:, -1].all()):
            raise ValueError("attention_mask: only left padding is supported (each row's tokens last, its "
                             "last position a token)")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0 \
            or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos):
        raise ValueError(f"eos_token_id must be None, a token id or a list of them, got {eos_token_id!r}")
    return eos


class SideTuned(nn.Module):
    """A Hugging Face causal LM ``base`` (Llama, Mistral, Qwen2, Qwen3, Gemma 3 text) frozen in FP8
    with a trainable QST side network beside it (module docstring). ``base`` is frozen and converted
    in place. ``r``: the side width is hidden // r (even); ``downsample``: the downsamplers' inner
    width. ``intermediate_size`` / ``num_heads`` of the side layers default to the base's
    intermediate size // r and one head per 64 channels. Only ``side_parameters()`` train.
    ``recompute`` (also an attribute; a captured ``coat.CudaGraphStep`` keeps the setting it was
    captured with): the side layers run again in backward instead of keeping their activations (at
    2048 tokens, about 32 of the 33 MiB a Llama-3-8B side layer, its downsampler tail and its mix
    would keep); it changes no number, only memory against a second side forward."""

    def __init__(self, base: nn.Module, r: int = 16, downsample: int = 16, *, intermediate_size: int | None = None,
                 num_heads: int | None = None, recompute: bool = True):
        super().__init__()
        if not isinstance(recompute, bool):
            raise ValueError(f"recompute must be True or False, got {recompute!r}")
        self._build(base, r, downsample, intermediate_size, num_heads)
        self.recompute = recompute
        _freeze_and_convert(base)  # last: a refused argument leaves the base as it was

    def _build(self, base: nn.Module, r, downsample, intermediate_size, num_heads) -> None:
        """Checks every argument and makes the side network; the base is not changed."""
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        fam = _check_base(base)
        r, downsample = _positive_int(r, "r"), _positive_int(downsample, "downsample")
        hidden, n_layers = int(base.config.hidden_size), len(base.model.layers)
        if hidden % r or (hidden // r) % 2:
            raise ValueError(f"r={r} must divide the base's hidden size {hidden} into an even side width")
        width = hidden // r
        side_config = _side_layer_config(base, width, intermediate_size, num_heads)
        self.family, self.r, self.downsample, self.hidden = fam, r, downsample, hidden
        self.side_config = side_config
        cfg = LlamaConfig(vocab_size=1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                          num_hidden_layers=n_layers, hidden_act="silu", attention_bias=False, mlp_bias=False,
                          **self.side_config)
        cfg._attn_implementation = "sdpa"
        self.base = base
        dtype = base.lm_head.weight.dtype if base.lm_head.weight.is_floating_point() else torch.float32
        eps = self.side_config["rms_norm_eps"]
        dev = base.lm_head.weight.device
        self.down = nn.ModuleList(_downsampler(hidden, downsample, width, eps) for _ in range(n_layers + 1))
        self.alpha = nn.Parameter(torch.full((n_layers, width), -0.5))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, layer_idx=i) for i in range(n_layers))
        self.up = nn.Linear(width, hidden)
        nn.init.zeros_(self.up.weight)  # the model starts as the base; up gets gradients at once
        nn.init.zeros_(self.up.bias)
        self.top_gate = nn.Parameter(torch.ones(hidden))  # w = sigmoid(1) = 0.73 per channel, QST's
        for p in self.side_parameters():
            p.data = p.data.to(device=dev, dtype=dtype)
        self.rotary = LlamaRotaryEmbedding(cfg).to(dev)

    @property
    def config(self):
        """The base's Hugging Face config (what code written for a causal LM reads: model type, sizes)."""
        return self.base.config

    def side_state_dict(self) -> dict[str, torch.Tensor]:
        """The side network's state alone (``state_dict()`` also holds the base, dequantized): what a
        training checkpoint needs, the base being rebuilt from its own checkpoint."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("base.")}

    def load_side_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Loads what ``side_state_dict`` returned (strict: the same names and shapes)."""
        own = self.side_state_dict()
        _check_tensors(state, own, "state")  # every name, shape and dtype before anything is copied
        with torch.no_grad():
            for k, v in own.items():
                v.copy_(state[k])

    def side_parameters(self) -> list[nn.Parameter]:
        """The trainable parameters: downsamplers, gates, side layers, upsample, top gate."""
        return [p for _, p in self._side_named()]

    def _side_named(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if not n.startswith("base.")]

    def _base_states(self, input_ids, attention_mask, position_ids) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(the downsamplers' first Linears on the base's states h_i, i = 0..L; the base's last hidden
        state h_L)."""
        grad = torch.is_grad_enabled()  # (read before no_grad: the downsamplers train)
        with torch.no_grad(), _Recorder(self.base.model.layers, self.down, grad) as rec:
            self.base.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False)
        if len(rec.states) != len(self.layers) + 1:
            raise RuntimeError(f"recorded {len(rec.states)} hidden states of the base, expected {len(self.layers) + 1}")
        return rec.states, rec.last

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                num_items_in_batch=None, ignore_index: int = -100, shift_labels: torch.Tensor | None = None,
                **kwargs):
        """(loss, logits) as a ``CausalLMOutputWithPast``: with ``labels`` (shifted here, as Hugging
        Face does) or ``shift_labels`` (already aligned with the inputs) the fused loss and
        ``logits=None``; without, the logits and ``loss=None``. Other keyword arguments of a causal
        LM's forward are accepted and ignored, except those asking for what the side network does
        not do (a KV cache: ``past_key_values``, ``use_cache=True``; ``inputs_embeds``;
        ``output_hidden_states`` / ``output_attentions``), which are refused (cached decoding is
        ``generate``'s)."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        _refuse_unsupported(kwargs)
        states, last = self._base_states(input_ids, attention_mask, position_ids)
        seq = input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(seq, device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        # With an attention_mask, whether any key is padded is read on the host (one device sync per
        # call, as the base's own Hugging Face mask code does): a mask of no padding would keep SDPA
        # off its causal flash kernel in every side layer. Without one (coat train, coat bench) no sync.
        padded = attention_mask is not None and not bool(attention_mask.all())
        s = self._side_stream(states, position_ids, attention_mask if padded else None)
        w = torch.sigmoid(self.top_gate)
        h = w * last + (1 - w) * self.up(s)
        norm, head = self.base.model.norm, self.base.lm_head
        if labels is None and shift_labels is None:
            return CausalLMOutputWithPast(loss=None, logits=head(norm(h)))
        loss = fused_lm_head_loss(h, head.weight, labels, norm_weight=norm.weight, eps=norm_eps(norm),
                                  norm_unit_offset=self.family.unit_offset, ignore_index=ignore_index,
                                  num_items_in_batch=num_items_in_batch, shift_labels=shift_labels)
        return CausalLMOutputWithPast(loss=loss, logits=None)

    def _side_stream(self, states: list[torch.Tensor], pos: torch.Tensor, mask: torch.Tensor | None,
                     caches: "_Caches | None" = None) -> torch.Tensor:
        """The side stream after the last side layer, from the downsamplers' first Linears on the
        base's states (the new tokens' only, with ``caches``). ``mask``: the whole sequence's
        attention mask when a key is padded, else None (SDPA's own causal mask); ``pos``: the
        states' positions. When training with ``recompute`` on, each side layer, the rest of its
        downsampler and its gated mix run under activation checkpointing: they keep only their
        inputs (the side stream and the downsample-width state) and run again in backward."""
        s = _down_tail(self.down[0], states[0])
        pe = self.rotary(s, pos)
        side_mask = None if mask is None else _step_mask(mask, s.shape[1], s.dtype)
        cache = {} if caches is None else {"use_cache": True, caches.side_kw: caches.side}
        gates = torch.sigmoid(self.alpha)
        again = self.recompute and caches is None and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            def block(s, y, g, layer=layer, down=self.down[i + 1], index=i, seen=[]):
                if again:
                    _same_weights(seen, (*layer.parameters(), *down.parameters()), index)
                s = layer(s, attention_mask=side_mask, position_ids=pos, position_embeddings=pe, **cache)
                s = s[0] if isinstance(s, tuple) else s
                return g * _down_tail(down, y) + (1 - g) * s
            # (No randomness in a side layer (no dropout): the recomputation needs no saved RNG state,
            # which CUDA graph capture could not read.)
            s = checkpoint(block, s, states[i + 1], gates[i], use_reentrant=False, preserve_rng_state=False) \
                if again else block(s, states[i + 1], gates[i])
        return s

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, generator: torch.Generator | None = None,
                 output_logits: bool = False):
        """Decoding with KV caches through the base and the side network: the prompt in one pass,
        then one token a step. Returns the [batch, prompt + new] token ids, and with ``output_logits`` also the [batch, new, vocab]
        logits each token was chosen from. Greedy, or sampled (``do_sample``: ``temperature``,
        ``top_k``, ``generator``); a row stops at ``eos_token_id`` (an id or a list) and is padded
        with ``pad_token_id`` (default: the first eos id) while the others go on; the whole batch
        stops when every row has. ``attention_mask``: 1 for tokens, 0 for left padding."""
        eos = _check_generate(input_ids, attention_mask, max_new_tokens, temperature, top_k, eos_token_id)
        pad = eos[0] if pad_token_id is None and eos else (0 if pad_token_id is None else int(pad_token_id))
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device).long()
        caches = _Caches(self)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)  # positions of left-padded rows start at their first token
        padded = not bool(mask.all())  # once: the tokens that follow are never padding
        ids, new, logits = input_ids, input_ids, []
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        eos_ids = torch.tensor(eos, device=input_ids.device)
        for _ in range(max_new_tokens):
            step = self._cached_logits(new, mask if padded else None, pos, caches)
            logits.append(step)
            nxt = _pick(step, do_sample, temperature, top_k, generator)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            ids = torch.cat([ids, nxt[:, None]], 1)
            if eos:
                done |= torch.isin(nxt, eos_ids)
                if bool(done.all()):
                    break
            new, pos = nxt[:, None], pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(new)], 1)
        return (ids, torch.stack(logits, 1)) if output_logits else ids

    def _cached_logits(self, new: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor, caches: "_Caches"):
        """The last position's logits [batch, vocab] after running ``new`` tokens (the prompt, then
        one token a step) through the base and the side network, each with its KV cache. ``mask``:
        the whole sequence's attention mask so far when a key is padded, else None; ``pos``: the new
        tokens' positions."""
        with _Recorder(self.base.model.layers, self.down, False) as rec:
            self.base.model(input_ids=new, attention_mask=mask, position_ids=pos, use_cache=True,
                            **{caches.base_kw: caches.base})
        s = self._side_stream(rec.states, pos, mask, caches)
        w = torch.sigmoid(self.top_gate)
        h = w * rec.last[:, -1:] + (1 - w) * self.up(s[:, -1:])
        return self.base.lm_head(self.base.model.norm(h))[:, 0].float()

    # ---- saving and loading the side network ---------------------------------------------------

    def _config(self) -> dict:
        return dict(format=_FORMAT, model_type=self.base.config.model_type, r=self.r, downsample=self.downsample,
                    hidden=self.hidden, layers=len(self.layers), side_layer=dict(self.side_config))

    def save_side(self, folder: str | os.PathLike) -> None:
        """Writes the side network alone to ``folder`` (created if missing; refused if not empty):
        side_config.json and the weights as safetensors. Both are written into a fresh folder beside
        it, which then takes ``folder``'s place: a failure leaves no half-written folder."""
        from safetensors.torch import save_file

        given = os.fspath(folder)
        folder = os.path.abspath(given)
        if os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
            raise ValueError(f"folder {given!r} is not an empty directory: save_side does not overwrite")
        parent = os.path.dirname(folder)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(folder)}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
        os.mkdir(tmp)  # (the umask's permissions, as os.makedirs gives the folder)
        try:
            tensors = {n: p.detach().contiguous().clone() for n, p in self._side_named()}
            save_file(tensors, os.path.join(tmp, WEIGHTS_FILE), metadata={"format": _FORMAT})
            with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
                json.dump(self._config(), f, indent=2)
            os.rename(tmp, folder)  # replaces an empty folder (POSIX), else creates it
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @classmethod
    def load_side(cls, folder: str | os.PathLike, base: nn.Module) -> "SideTuned":
        """Builds a ``SideTuned`` on ``base`` (frozen and converted in place) with the side network
        saved in ``folder`` by ``save_side``. Reads JSON and safetensors only. Everything is checked
        (the config against the base, every weight's name, dtype and shape) before ``base`` is
        frozen and converted: a refused folder leaves the base as it was."""
        from safetensors.torch import load_file

        folder = os.fspath(folder)
        cfg = _read_config(folder, base)
        side = cfg["side_layer"]
        model = cls.__new__(cls)
        nn.Module.__init__(model)
        model._build(base, cfg.get("r"), cfg.get("downsample"), side.get("intermediate_size"),
                     side.get("num_attention_heads"))
        model.recompute = True
        # What changes the side layers' arithmetic (not max_position_embeddings: default RoPE ignores it)
        differ = [k for k in set(side) | set(model.side_config)
                  if k != "max_position_embeddings" and side.get(k) != model.side_config.get(k)]
        if differ:
            key = min(differ)
            raise ValueError(f"folder {folder!r}: the side layers were saved with {key}={side.get(key)!r}, "
                             f"on this base they would have {key}={model.side_config.get(key)!r}")
        tensors = load_file(os.path.join(folder, WEIGHTS_FILE))
        params = dict(model._side_named())
        _check_tensors(tensors, params, f"folder {folder!r}")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(tensors[n])
        _freeze_and_convert(base)
        return model


def _read_config(folder: str, base: nn.Module) -> dict:
    """side_config.json of ``folder``, checked against ``base`` (model type, hidden size, layers)."""
    with open(os.path.join(folder, CONFIG_FILE)) as f:
        cfg = json.load(f)
    if isinstance(cfg, dict) and cfg.get("format") == "coat-side-tuning/1":
        raise ValueError(f"folder {folder!r}: saved by an older coat (format 1: one scalar top gate); this coat's "
                         "side network has per-channel gates (format 2): train it again")
    if not isinstance(cfg, dict) or cfg.get("format") != _FORMAT:
        raise ValueError(f"folder {folder!r}: {CONFIG_FILE} is not a coat side-tuning config")
    if not isinstance(cfg.get("side_layer"), dict):
        raise ValueError(f"folder {folder!r}: {CONFIG_FILE} has no side_layer settings (a dict)")
    _check_base(base)
    have = {"hidden": int(base.config.hidden_size), "layers": len(base.model.layers),
            "model_type": base.config.model_type}
    for key, value in have.items():
        if cfg.get(key) != value:
            raise ValueError(f"base: the side network in {folder!r} was saved for {key}={cfg.get(key)!r}, "
                             f"this base has {key}={value!r}")
    return cfg
