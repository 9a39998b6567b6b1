"""Frozen weights kept only in FP8: ``coat.convert(model, frozen_weights="fp8")``.

A weight that does not train (the base of a LoRA fine-tune, frozen layers) needs no bf16 copy: its
projection's ``weight`` becomes E4M3 codes (1 byte per parameter instead of 2) with a per-tensor
``weight_scale`` buffer, and the forward and input-gradient GEMMs read the codes directly.

Scales: one per-tensor scale per fused group (q/k/v share one, gate/up share one, o and down have
their own): the scale coat's trainable path already computes for those GEMMs every step, so a
frozen-FP8 layer computes bit for bit what the converted layer with bf16 frozen weights computes
(tested) and adds no error of its own beyond the FP8 GEMMs that conversion already brings.
Per-channel or 128x128-block scales would need GEMM kernels that scale inside the reduction for
the input gradient (the channel scales of W lie along its reduction dimension there); measured,
the per-tensor codes stay within the FP8 tolerance stated by the conversion tests.

The codes of a group live in one buffer (each projection's weight a view of its rows), which the
fused forward GEMM reads as it lies. Moving the model afterwards (``model.to(device)``) gives each
weight its own storage: still correct, but every forward then concatenates the group; convert
after moving the model.

A group is stored in FP8 only when every member is frozen (requires_grad False); a group with a
trainable member stays as it is. ``dequantize_frozen`` turns the codes back into floating-point
weights (the dequantized FP8 values), e.g. before PEFT's ``merge_and_unload``.

State dicts: ``state_dict()`` (and so ``save_pretrained``, which plain transformers loads) holds
each FP8-frozen weight dequantized, in the dtype it had before freezing, under its own key, and no
scale: the weights the model computes with. They are made one at a time on the model's device and
kept on the CPU: a state dict costs host memory (2 bytes per frozen parameter of a bf16 model),
not GPU memory. ``load_state_dict`` into an FP8-frozen projection accepts exactly the weight its
codes dequantize to (a state dict of this model: the codes stay, the round trip is exact) or FP8
codes with a ``weight_scale`` (coat's earlier checkpoints); any other weight is refused, naming
it: load such weights before ``coat.convert(frozen_weights="fp8")``.

Casts and moves: ``model.to(dtype)``, ``.half()``, ``.float()``, ``.bfloat16()`` leave the codes and
the fp32 scale as they are (the projection stays FP8-frozen; its GEMMs take the cast model's
activations and return that dtype), and its state-dict weight takes the new dtype; device moves
(``.to(device)``, ``.cuda()``, ``.cpu()``) move them. Without that, the casts would turn the codes
into numbers read without their scale. What FP8 codes cannot do is refused, naming what to do
instead: training them (``requires_grad`` set on them again, e.g. by ``model.requires_grad_(True)``:
the forward raises where gradients are recorded), writing them in place (``copy_`` of floats casts
them to codes without the scale; any in-place write since coat wrote them is refused at the next
forward, naming the group) and merging a LoRA adapter into them (PEFT's
``merge_and_unload``/``merge_adapter``): call ``dequantize_frozen(model)`` first for any of these.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .._ops import quantize as qops
from .._ops._util import fmt_id
from ..models import GROUPS  # projections that share one GEMM (and so one per-tensor scale)
from . import adapters as A
from .recipe import DEFAULT, Fp8Recipe

__all__ = ["freeze_to_fp8", "dequantize_frozen", "GROUPS"]


def _bases(layer: nn.Module, block: str, names) -> list[nn.Linear]:
    owner = getattr(layer, block)
    return [A.base_linear(getattr(owner, n), f"{block}.{n}") for n in names]


def freeze_to_fp8(layers, recipe: Fp8Recipe = DEFAULT) -> int:
    """Stores every fully frozen projection group of ``layers`` as FP8 codes in the recipe's weight
    format (E4M3) + one scale; returns the bytes freed."""
    freed = 0
    for layer in layers:
        if not getattr(layer, "_coat_frozen_hook", False):
            layer.register_forward_pre_hook(_refuse_training_codes)
            # on the layer: it runs once all of its projections are loaded (a group's codes share one
            # version counter, so a member loaded after another moves the other's too)
            layer.register_load_state_dict_post_hook(_marked_after_load)
            layer._coat_frozen_hook = True
        layer._coat_frozen_fp8 = True  # asked for: groups frozen later must be stored too (hook below)
        for block, groups in GROUPS.items():
            for names in groups:
                bases = _bases(layer, block, names)
                if not any(A.is_frozen_fp8(b) or b.weight.requires_grad for b in bases):
                    freed += _freeze_group(bases, recipe.act_dtype)
                # LoRA wrappers of a group frozen now or before (convert again after get_peft_model)
                for n in names:
                    mod = getattr(getattr(layer, block), n)
                    if A.is_lora(mod) and A.is_frozen_fp8(mod.base_layer):
                        mod.merge = functools.partial(_merge_refused, mod)
    return freed


def _freeze_group(bases, dtype: torch.dtype) -> int:
    """Stores one projection group as FP8 codes of ``dtype`` (views of one buffer) + its shared scale."""
    ws = [b.weight.detach() for b in bases]
    q, _, scale = qops.quantize_stacked_amax(ws, fmt_id(dtype), True, False)
    q = q.view(dtype)
    row, freed = 0, 0
    for b, w in zip(bases, ws):
        # Each projection's codes are a view of the group's one buffer, so the fused
        # forward GEMM reads the group where it lies (``group_codes``: no copy).
        codes = q[row:row + w.shape[0]]
        row += w.shape[0]
        freed += w.numel() * w.element_size() - codes.numel()
        b.weight = nn.Parameter(codes, requires_grad=False)
        # Not persistent: the state dict holds the dequantized weight instead (hooks below).
        b.register_buffer("weight_scale", scale.clone(), persistent=False)
        b.coat_frozen_dtype = w.dtype
        b._apply = functools.partial(_apply_keeping_codes, b)  # casts keep the codes (see the docstring)
        if not getattr(b, "_coat_state_dict_hooks", False):
            b.register_state_dict_post_hook(_dequantized_state)
            b.register_load_state_dict_pre_hook(_load_frozen_state)
            b._coat_state_dict_hooks = True
    for b in bases:  # after the group: its codes are views of one buffer, sharing one version counter
        _mark_codes(b)
    return freed


def _mark_codes(linear: nn.Linear, written: bool = False) -> None:
    """Records the codes the projection's scale belongs to: the Parameter and its version counter,
    which every in-place write (``copy_``, ``fill_``, an optimizer's step) moves. ``written``: codes
    already written since, which stay refused."""
    if A.is_frozen_fp8(linear):
        linear._coat_codes = (id(linear.weight), -1 if written else linear.weight._version)


def _marked_after_load(layer: nn.Module, incompatible_keys) -> None:
    """load_state_dict copied codes in place (their own, or coat's earlier codes with their scale)."""
    for mod in layer.modules():
        if isinstance(mod, nn.Linear):
            _mark_codes(mod)


def _codes_written(linear: nn.Linear) -> bool:
    """Whether the codes were written in place since coat wrote them. Another Parameter object (a
    deepcopy, an unpickled model) is adopted as it is: its version counter starts again."""
    mark = getattr(linear, "_coat_codes", None)
    if mark is None:
        return False
    if mark[0] != id(linear.weight):
        _mark_codes(linear, written=mark[1] < 0)
        return mark[1] < 0
    return mark[1] != linear.weight._version


def _apply_keeping_codes(linear: nn.Linear, fn, recurse: bool = True) -> nn.Module:
    """``_apply`` of an FP8-frozen projection (what ``to``, ``half``, ``cuda``, ... call): the codes and
    the scale go through ``fn`` as integer views, which floating-point casts leave alone and device
    moves move; the dtype of the state-dict weight follows the cast."""
    if not A.is_frozen_fp8(linear):  # dequantized or replaced since
        return type(linear)._apply(linear, fn, recurse)
    w, scale = linear.weight, linear.weight_scale
    written = _codes_written(linear)  # codes written before a move or cast stay refused after it
    with torch.no_grad():
        dtype = fn(torch.empty(0, dtype=linear.coat_frozen_dtype, device=w.device)).dtype
    linear._parameters["weight"] = nn.Parameter(w.detach().view(torch.uint8), requires_grad=False)
    linear._buffers["weight_scale"] = scale.view(torch.int32)
    try:
        type(linear)._apply(linear, fn, recurse)
    finally:
        codes = linear._parameters["weight"].detach().view(w.dtype)
        linear._buffers["weight_scale"] = linear._buffers["weight_scale"].view(scale.dtype)
        if codes.device == w.device:
            w.data = codes  # the same Parameter (and, unmoved, the same view of its group's buffer)
        else:
            w = nn.Parameter(codes, requires_grad=w.requires_grad)
        linear._parameters["weight"] = w
        _mark_codes(linear, written)
    linear.coat_frozen_dtype = dtype
    return linear


def _refuse_training_codes(layer: nn.Module, args) -> None:
    """Forward pre-hook of a layer with FP8-frozen projections: codes that require grad (e.g. after
    ``model.requires_grad_(True)``) cannot train; refused where gradients are recorded. And a group
    frozen after ``coat.convert(frozen_weights="fp8")`` (``peft.get_peft_model`` of a converted model)
    would silently keep its floating-point weights: refused, naming the order that works."""
    if getattr(layer, "_coat_frozen_fp8", False):
        for block, groups in GROUPS.items():
            for names in groups:
                bases = _bases(layer, block, names)
                if not any(A.is_frozen_fp8(b) or b.weight.requires_grad for b in bases):
                    idx = getattr(getattr(layer, "self_attn", None), "layer_idx", None)
                    raise ValueError(
                        f"{block}.{'/'.join(names)}" + (f" of decoder layer {idx}" if idx is not None else "")
                        + " were frozen after coat.convert(frozen_weights='fp8') and are still "
                        f"{bases[0].weight.dtype}, not FP8 (e.g. by peft.get_peft_model(coat.convert(model, "
                        "frozen_weights='fp8'), config)): call coat.convert(model, frozen_weights='fp8') again "
                        "after freezing them (after get_peft_model), or convert with frozen_weights='keep' before it")
    grad = torch.is_grad_enabled()
    for block, groups in GROUPS.items():
        for names in groups:
            for n, b in zip(names, _bases(layer, block, names)):
                if not A.is_frozen_fp8(b) or not (_codes_written(b) or grad and b.weight.requires_grad):
                    continue
                idx = getattr(getattr(layer, "self_attn", None), "layer_idx", None)
                where = f"{block}.{n}.weight" + (f" of decoder layer {idx}" if idx is not None else "")
                if _codes_written(b):  # a float copied into E4M3 codes is stored without the scale
                    raise ValueError(
                        where + f" (or another of {block}.{'/'.join(names)}, which share one buffer) holds FP8 "
                        "codes with a per-tensor scale (coat.convert(frozen_weights='fp8')) and was written in "
                        "place since (copy_, fill_, an optimizer step): the scale does not "
                        "follow such writes, so the layer would compute with wrong weights. Load new weights "
                        "with load_state_dict, or before coat.convert(frozen_weights='fp8'), or call "
                        "coat.nn.dequantize_frozen(model) before editing them")
                if grad and b.weight.requires_grad:
                    raise ValueError(
                        where + " is frozen in FP8 (coat.convert(frozen_weights='fp8')) but has requires_grad=True: "
                        "FP8 codes cannot train. Call requires_grad_(False) on it again (unfreeze only what "
                        "trains), or coat.nn.dequantize_frozen(model) before unfreezing it")


def _merge_refused(lora: nn.Module, *args, **kwargs) -> None:
    """``merge`` of a PEFT LoRA layer around an FP8-frozen projection (``merge_and_unload``,
    ``merge_adapter``): the adapter cannot be added to FP8 codes."""
    if A.is_frozen_fp8(lora.base_layer):
        raise ValueError(
            "cannot merge a LoRA adapter into a projection frozen in FP8 (coat.convert(frozen_weights='fp8')): "
            "call coat.nn.dequantize_frozen(model) before merge_and_unload() or merge_adapter()")
    return type(lora).merge(lora, *args, **kwargs)


def _dequantized(linear: nn.Linear, dtype: torch.dtype | None = None) -> torch.Tensor:
    return (linear.weight.detach().float() * linear.weight_scale).to(dtype or getattr(linear, "coat_frozen_dtype", torch.bfloat16))


def _dequantized_state(linear, state_dict, prefix, local_metadata) -> None:
    """state_dict hook of an FP8-frozen projection: its weight as the model computes with it."""
    if A.is_frozen_fp8(linear) and prefix + "weight" in state_dict:
        w = _dequantized(linear)
        # On the host: a whole model's dequantized weights would not fit beside it on the GPU.
        state_dict[prefix + "weight"] = w if w.device.type in ("cpu", "meta") else w.cpu()


def _load_frozen_state(linear, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                       error_msgs) -> None:
    """load_state_dict pre-hook of an FP8-frozen projection (see the module docstring)."""
    key = prefix + "weight"
    w = state_dict.get(key)
    if not A.is_frozen_fp8(linear) or w is None:
        return
    scale = state_dict.pop(prefix + "weight_scale", None)
    if w.dtype == linear.weight.dtype and scale is not None:  # codes and scale: loaded as they are
        with torch.no_grad():
            linear.weight_scale.copy_(scale.reshape(linear.weight_scale.shape))
        return
    if not (w.shape == linear.weight.shape and w.is_floating_point()
            and torch.equal(w.to(linear.weight.device), _dequantized(linear).to(w.dtype))):
        error_msgs.append(
            f"{key}: this projection is frozen in FP8 (coat.convert(frozen_weights='fp8')) and takes only "
            "the weight its codes dequantize to (a state dict of this model); load other weights into the "
            "model before converting it with frozen_weights='fp8'")
    state_dict[key] = linear.weight.detach()  # the codes stay as they are


def dequantize_frozen(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Turns FP8-frozen projection weights back into ``dtype`` weights (the FP8 values, scaled);
    ``dtype`` defaults to each weight's dtype before freezing."""
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and A.is_frozen_fp8(mod):
            w = _dequantized(mod, dtype)
            del mod.weight_scale
            mod.__dict__.pop("_apply", None)
            mod.weight = nn.Parameter(w, requires_grad=False)
        if A.is_lora(mod):
            mod.__dict__.pop("merge", None)
        if getattr(mod, "_coat_frozen_fp8", False):
            mod._coat_frozen_fp8 = False  # floating-point frozen weights from now on, as asked
    return model


def _adjacent(weights) -> bool:
    """Whether the codes lie back to back in one storage (as ``freeze_to_fp8`` stores a group)."""
    w0 = weights[0]
    if not all(w.is_contiguous() and w.dim() == 2 and w.shape[1] == w0.shape[1] for w in weights):
        return False
    storage = w0.untyped_storage().data_ptr()
    end = w0.data_ptr() + w0.numel()
    for w in weights[1:]:
        if w.untyped_storage().data_ptr() != storage or w.data_ptr() != end:
            return False
        end += w.numel()
    return True


def group_codes(weights, scales) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked row-major codes of an FP8-frozen group and its (shared) scale: a view of the
    group's buffer when its codes lie back to back (no copy), else their concatenation."""
    if len(weights) == 1:
        return weights[0], scales[0]
    if _adjacent(weights):
        rows = sum(w.shape[0] for w in weights)
        return weights[0].as_strided((rows, weights[0].shape[1]), (weights[0].shape[1], 1)), scales[0]
    return torch.cat(weights, 0), scales[0]


def group_codes_t(weights) -> torch.Tensor:
    """The stacked codes transposed [K, N], for the input-gradient GEMM: one pass of a tiled
    transpose kernel over the parts where they lie."""
    parts = [w.contiguous().view(torch.uint8) for w in weights]
    return qops.transpose_stacked_codes(parts).view(weights[0].dtype)
