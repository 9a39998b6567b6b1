"""Custom ops of the rope family: RoPE (rotate-half) on q and k with v copied alongside, read from a
fused QKV output and written as the contiguous q, k, v attention takes, in one launch; and the
backward that writes the fused QKV gradient directly. See csrc/include/coat/rope.h."""

from __future__ import annotations

import torch

from .. import _C
from ._util import custom_op, dev_ctx, stream


def _cs(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, dim: int):
    """cos/sin ([B or 1, S, dim]; the core reads them as [rows, dim]) in the activations' dtype."""
    if cos.dtype != dtype:  # autocast: fp32 tables, bf16 activations
        cos, sin = cos.to(dtype), sin.to(dtype)
    return cos, sin


def _check(x: torch.Tensor, width: int, dim: int) -> None:
    if x.shape[-1] != width:
        raise ValueError(f"expected a last dimension of {width} (heads x head_dim), got {list(x.shape)}")
    if dim <= 0 or dim % 2:
        raise ValueError(f"head_dim must be even and > 0, got {dim}")


@custom_op("coat::rope_qkv", mutates_args=())
def rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hk: int, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [..., (hq + 2 hk) dim] -> q [..., hq, dim], k and v [..., hk, dim], RoPE on q and k."""
    _check(qkv, (hq + 2 * hk) * dim, dim)
    c, s = _cs(cos, sin, qkv.dtype, dim)
    with dev_ctx(qkv):
        return _C.rope_qkv(qkv, c, s, hq, hk, dim, stream(qkv))


@rope_qkv.register_fake
def _(qkv, cos, sin, hq, hk, dim):
    _check(qkv, (hq + 2 * hk) * dim, dim)
    lead = qkv.shape[:-1]
    return qkv.new_empty((*lead, hq, dim)), qkv.new_empty((*lead, hk, dim)), qkv.new_empty((*lead, hk, dim))


@custom_op("coat::rope_qkv_bwd", mutates_args=())
def rope_qkv_bwd(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The fused QKV gradient [..., (hq + 2 hk) dim] from dq [..., hq, dim], dk and dv [..., hk, dim]
    (contiguous), the inverse rotation applied to dq and dk."""
    c, s = _cs(cos, sin, dq.dtype, dq.shape[-1])
    with dev_ctx(dq):
        return _C.rope_qkv_bwd(dq, dk, dv, c, s, stream(dq))


@rope_qkv_bwd.register_fake
def _(dq, dk, dv, cos, sin):
    return dq.new_empty((*dq.shape[:-2], (dq.shape[-2] + 2 * dk.shape[-2]) * dq.shape[-1]))


@custom_op("coat::rope", mutates_args=())
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """RoPE on one contiguous [..., heads, dim] tensor (or its gradient map when ``backward``)."""
    dim = x.shape[-1]
    _check(x, dim, dim)
    c, s = _cs(cos, sin, x.dtype, dim)
    with dev_ctx(x):
        return _C.rope(x, c, s, backward, stream(x))


@rope.register_fake
def _(x, cos, sin, backward):
    return torch.empty_like(x)
