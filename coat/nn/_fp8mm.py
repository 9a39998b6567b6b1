"""The GEMM layer under the fused FP8 blocks: per-tensor quantization, the FP8 weight cache and an
FP8 "NT" matrix product (a @ b.T with both operands row-major FP8).

On CUDA the product runs on coat's own FP8 GEMM (``coat::fp8_gemm``, cuBLASLt with cached plans;
its bf16 path on GPUs without FP8 tensor cores), or on ``torch._scaled_mm`` with
``COAT_LAYER_GEMM=scaled_mm`` (for comparisons). Dimensions that are not multiples of 16 are
zero-padded (zeros add nothing to the products). On the CPU it is emulated exactly: the FP8
operands are dequantized and multiplied in fp32, so the numerics are the same up to accumulation
order.
"""

from __future__ import annotations

import os

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._ops import gemm as gops
from .._ops import quantize as qops
from .._ops._util import fmt_id
from . import linear as _linear
from .recipe import ACT_DTYPE

_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()
_BACKEND = os.environ.get("COAT_LAYER_GEMM", "coat")


def quantize(x2d: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool):
    """Per-tensor FP8 with an amax computed on the device: (q, q_t or None, scale)."""
    q, q_t, scale, _ = qops.quantize_per_tensor_amax(x2d, fmt_id(fp8_dtype), transpose)
    return q.view(fp8_dtype), (q_t.view(fp8_dtype) if transpose else None), scale


def transpose_fp8(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).t().contiguous().view(q.dtype)


class Fp8Weight:
    """FP8 E4M3 copy of one weight or of several concatenated along dim 0 (fused QKV, gate/up),
    with one per-tensor scale. ``data_t`` (the transpose, for the input-gradient GEMM) is made on
    first use in backward."""

    __slots__ = ("data", "scale", "_t", "key")

    def __init__(self, weights: tuple[torch.Tensor, ...], key):
        w = weights[0] if len(weights) == 1 else torch.cat(weights, 0)
        self.data, _, self.scale = quantize(w.detach().contiguous(), ACT_DTYPE, False)
        self._t = None
        self.key = key

    @property
    def data_t(self) -> torch.Tensor:
        if self._t is None:
            self._t = transpose_fp8(self.data)
        return self._t


def _key(weights):
    # The step generation (bumped by every optimizer step through a global step hook, see
    # linear.py) catches optimizers that write parameters in place without bumping their version
    # counters, as coat.optim.AdamW's kernel does.
    return (_linear.step_generation(),) + tuple((w._version, w.data_ptr(), tuple(w.shape), w.dtype) for w in weights)


def fp8_weight(weights: tuple[torch.Tensor, ...], use_cache: bool = True) -> Fp8Weight:
    """The FP8 copy of ``weights``, cached until one of them changes (version counter or storage)
    or an optimizer steps."""
    if not use_cache or torch.compiler.is_compiling():
        return Fp8Weight(weights, None)
    key = _key(weights)
    per_first = _CACHE.get(weights[0])
    ident = tuple(id(w) for w in weights)
    if per_first is not None:
        hit = per_first.get(ident)
        if hit is not None and hit.key == key:
            return hit
    else:
        per_first = {}
        _CACHE[weights[0]] = per_first
    entry = Fp8Weight(weights, key)
    per_first[ident] = entry
    return entry


def clear_weight_cache() -> None:
    """Drops every cached FP8 weight (they are rebuilt on next use)."""
    _CACHE.clear()


def _use_scaled_mm(t: torch.Tensor) -> bool:
    if _BACKEND != "scaled_mm" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(t.device) >= (8, 9)


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    r, c = t.shape
    if r == rows and c == cols:
        return t
    out = torch.zeros((rows, cols), dtype=torch.uint8, device=t.device)
    out[:r, :c] = t.view(torch.uint8)
    return out.view(t.dtype)


def _up16(n: int) -> int:
    return (n + 15) // 16 * 16


def fp8_mm(a, sa, b, sb, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """(a * sa) @ (b * sb).T for row-major FP8 a [M, K] and b [N, K]; fp32 accumulation."""
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0 or k == 0:
        return torch.zeros((m, n), dtype=out_dtype, device=a.device)
    if a.is_cuda and _use_scaled_mm(a):
        mp, kp, np_ = _up16(m), _up16(k), _up16(n)
        ap, bp = _pad(a, mp, kp), _pad(b, np_, kp)
        out = torch._scaled_mm(ap, bp.t(), scale_a=sa.reshape(()), scale_b=sb.reshape(()), out_dtype=out_dtype,
                               use_fast_accum=fast_accum)
        return out if (mp == m and np_ == n) else out[:m, :n].contiguous()
    if a.is_cuda:
        kp, np_ = _up16(k), _up16(n)
        ap, bp = _pad(a, m, kp), _pad(b, np_, kp)
        dt = out_dtype if out_dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = gops.fp8_gemm(ap, bp, sa.reshape(1), sb.reshape(1), None, dt)
        out = out if np_ == n else out[:, :n].contiguous()
        return out if dt == out_dtype else out.to(out_dtype)
    return ((a.float() * sa) @ (b.float() * sb).t()).to(out_dtype)
