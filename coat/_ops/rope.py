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
    lead = qkv.shape[:-1]
    q = torch.empty((*lead, hq, dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((*lead, hk, dim), dtype=qkv.dtype, device=qkv.device)
    v = torch.empty((*lead, hk, dim), dtype=qkv.dtype, device=qkv.device)
    c, s = _cs(cos, sin, qkv.dtype, dim)
    with dev_ctx(qkv):
        _C.rope_apply(qkv, 0, qkv, hq * dim, qkv, (hq + hk) * dim, q, 0, k, 0, v, 0, qkv.numel() // qkv.shape[-1],
                      hq, hk, hk, dim, c, s, False, stream(qkv))
    return q, k, v


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
    hq, dim = dq.shape[-2], dq.shape[-1]
    hk = dk.shape[-2]
    out = torch.empty((*dq.shape[:-2], (hq + 2 * hk) * dim), dtype=dq.dtype, device=dq.device)
    c, s = _cs(cos, sin, dq.dtype, dim)
    with dev_ctx(dq):
        _C.rope_apply(dq, 0, dk, 0, dv, 0, out, 0, out, hq * dim, out, (hq + hk) * dim, out.numel() // out.shape[-1],
                      hq, hk, hk, dim, c, s, True, stream(dq))
    return out


@rope_qkv_bwd.register_fake
def _(dq, dk, dv, cos, sin):
    return dq.new_empty((*dq.shape[:-2], (dq.shape[-2] + 2 * dk.shape[-2]) * dq.shape[-1]))


@custom_op("coat::rope", mutates_args=())
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """RoPE on one contiguous [..., heads, dim] tensor (or its gradient map when ``backward``)."""
    heads, dim = x.shape[-2], x.shape[-1]
    _check(x, dim, dim)
    out = torch.empty_like(x)
    c, s = _cs(cos, sin, x.dtype, dim)
    with dev_ctx(x):
        _C.rope_apply(x, 0, None, 0, None, 0, out, 0, None, 0, None, 0, x.numel() // (heads * dim) if heads else 0,
                      heads, 0, 0, dim, c, s, backward, stream(x))
    return out


@rope.register_fake
def _(x, cos, sin, backward):
    return torch.empty_like(x)
