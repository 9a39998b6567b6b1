"""A weight gathered as FP8 codes: what FSDP2 hands a converted layer under FP8 all-gather
(``coat.integrations.fp8_gather``).

Each rank quantizes its shard of a weight with the scale of the whole weight group (the fused QKV,
gate/up or a single projection: the maximum of the shards' amaxes, all-reduced), and the all-gather
moves those codes: half the bytes of a bf16 gather and of FSDP2's copies in and out of its buffers,
and the forward's weight quantization reads 1 / world of the elements. The codes are exactly the
ones the block op would make from the gathered bf16 weight (same amax, same scale, same rounding),
so a converted layer computes bit for bit what it computes with a bf16 gather.

To a layer block this tensor is a weight source (``weights.GATHERED``): its codes and scale are read
as they are, and transposed for the input-gradient GEMM. To anything else it is a read-only tensor
of the weight's shape and dtype whose value is its dequantization (an op on it dequantizes first, a
write to it is refused): the codes are all there is of the unsharded weight.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .._ops import quantize as qops
from .._ops._util import fmt_id

__all__ = ["Fp8Gathered", "is_gathered", "group_codes", "group_codes_t"]

aten = torch.ops.aten

# Ops that give another view of the same codes: FSDP2 makes the parameter with as_strided and
# nn.Parameter (detach), autograd saves and aliases it.
_VIEWS = {aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
          aten.as_strided.default}
# Views that only move elements (no dtype or value change): a gathered view of the codes too, so that
# a write through one (w[0].zero_(), w.t().mul_(2)) is refused rather than lost in a dequantized copy.
_VIEWS |= {getattr(getattr(aten, op), ov) for op, ov in (
    ("t", "default"), ("transpose", "int"), ("permute", "default"), ("select", "int"), ("slice", "Tensor"),
    ("narrow", "default"), ("expand", "default"), ("unsqueeze", "default"), ("squeeze", "default"),
    ("squeeze", "dim"), ("squeeze", "dims"), ("unbind", "int"), ("split", "Tensor"), ("split_with_sizes", "default"),
    ("diagonal", "default"), ("unfold", "default"), ("_reshape_alias", "default"))
    if hasattr(getattr(aten, op, None), ov)}
# Ops that only take the dtype and device of their first argument: no value is needed.
_NEW = {aten.new_empty.default, aten.new_empty_strided.default, aten.new_zeros.default, aten.new_ones.default,
        aten.new_full.default}


class Fp8Gathered(torch.Tensor):
    """An unsharded weight of ``dtype`` held as E4M3/E5M2 codes (uint8, ``fmt`` a torch FP8 dtype)
    with one fp32 dequantization scale [1]. Every weight of one layer block shares the scale
    tensor."""

    _codes: torch.Tensor
    _scale: torch.Tensor
    _fmt: torch.dtype

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, fmt: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, codes.shape, strides=codes.stride(), storage_offset=codes.storage_offset(), dtype=dtype,
            device=codes.device, requires_grad=False)

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, fmt: torch.dtype):
        if codes.dtype != torch.uint8:
            raise TypeError(f"Fp8Gathered: codes must be uint8, got {codes.dtype}")
        self._codes, self._scale, self._fmt = codes, scale, fmt

    def __repr__(self) -> str:
        return f"Fp8Gathered(shape={list(self.shape)}, dtype={self.dtype}, codes={self._fmt})"

    def __tensor_flatten__(self):
        return ["_codes", "_scale"], (self.dtype, self._fmt)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8Gathered(inner["_codes"], inner["_scale"], *meta)

    def dequantize(self) -> torch.Tensor:
        """The weight's value: codes * scale in its dtype."""
        q = self._codes.contiguous()
        return qops.dequantize_per_tensor(q, self._scale, fmt_id(self._fmt), self.dtype).view(self.shape)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VIEWS:
            src = args[0]
            out = func(src._codes, *args[1:], **kwargs)
            if isinstance(out, torch.Tensor):
                return Fp8Gathered(out, src._scale, src.dtype, src._fmt)
            return type(out)(Fp8Gathered(c, src._scale, src.dtype, src._fmt) for c in out)  # unbind, split
        if func in _NEW:
            src = args[0]
            return func(torch.empty((), dtype=src.dtype, device=src.device), *args[1:], **kwargs)
        if func._schema.is_mutable:
            raise RuntimeError(
                f"{func} would write to a weight that FSDP2 gathered as FP8 codes (coat's FP8 all-gather), "
                "which holds no bf16 copy to write to: change the sharded parameter instead (outside forward "
                "and backward), or shard with fp8_all_gather=False")

        def plain(t):  # lists too (cat, stack, foreach ops): else the op comes back here forever
            if isinstance(t, (list, tuple)):
                return type(t)(plain(u) for u in t)
            return t.dequantize() if isinstance(t, Fp8Gathered) else t

        return func(*[plain(a) for a in args], **{k: plain(v) for k, v in kwargs.items()})


def is_gathered(weights: Sequence[torch.Tensor]) -> bool:
    """Whether a block's weights are FP8-gathered: all of them or none (else ``ValueError``)."""
    n = sum(isinstance(w, Fp8Gathered) for w in weights)
    if 0 < n < len(weights):
        raise ValueError("a layer block got FP8-gathered and plain weights together; FP8 all-gather must cover "
                         "every weight of a fused projection (q/k/v, gate/up) or none")
    return n > 0


def _check(weights: Sequence[Fp8Gathered], dtype: torch.dtype) -> None:
    w0 = weights[0]
    if w0._fmt != dtype:
        raise ValueError(f"a weight was gathered as {w0._fmt} codes but the layer's recipe quantizes weights to "
                         f"{dtype}: shard with FP8 all-gather after converting with the recipe you train with")
    if any(w._scale is not w0._scale for w in weights[1:]):
        raise ValueError("the weights of one layer block were gathered with different scales: FP8 all-gather "
                         "must group a fused projection's weights (q/k/v, gate/up) under one scale")


def group_codes(weights: Sequence[Fp8Gathered], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked row-major codes [N, K] of a block's gathered weights (viewed as ``dtype``) and
    their shared scale."""
    _check(weights, dtype)
    parts = [w._codes for w in weights]
    codes = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
    return codes.view(dtype), weights[0]._scale


def group_codes_t(weights: Sequence[Fp8Gathered], dtype: torch.dtype) -> torch.Tensor:
    """The stacked codes transposed [K, N] for the input-gradient GEMM: one pass over the parts."""
    _check(weights, dtype)
    return qops.transpose_stacked_codes([w._codes.contiguous() for w in weights]).view(dtype)
