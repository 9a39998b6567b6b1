"""FP8 linear layer: per-tensor E4M3 forward GEMM, E5M2 gradients, FP8-only saved activations.

Forward ``y = x W^T + b``: x is quantized per tensor to E4M3 (amax computed in the same call, and
the transposed codes written in the same pass for the weight gradient), W comes from a cache of
E4M3 codes + transpose + scale, and ``y = fp8_gemm(x8, W8)`` accumulates in fp32.
Backward: dY is quantized per tensor to E5M2 (with its transpose), ``dX = fp8_gemm(dY8, W8^T)`` and
``dW = fp8_gemm(dY8^T, x8^T)``, both E5M2 x E4M3; ``db = dY.sum(0)``. Only FP8 tensors are saved
for backward (x8^T, 1 byte per element, and the cached W8^T), never the bf16 input.

Weight cache: the quantized weight is reused across micro-batches and recomputed when the weight
changes: after any ``optimizer.step()`` (a global step post-hook bumps a generation counter), when
``weight._version`` or its storage changes (in-place edits), or after
:func:`invalidate_weight_cache`. Under ``torch.compile`` / fake tensors the cache is bypassed and
the weight is quantized inline, so tracing sees only custom ops.

On CUDA, cuBLASLt FP8 needs K (in_features) and N (out_features) to be multiples of 16: other layers
run ``F.linear`` (their BF16 path) with a one-time warning. On CPU every shape runs through the C++
reference GEMM.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as tF
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from .. import functional as F
from .._ops import gemm as _gemm_ops

__all__ = ["Fp8Linear", "fp8_linear", "invalidate_weight_cache"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

# ---- weight cache --------------------------------------------------------------------------------

_generation = 0
_cache: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: Counters for tests and diagnostics.
stats = {"weight_quantizations": 0, "fallbacks": 0}
_warned: set = set()


def _bump_generation(*_args, **_kwargs) -> None:
    global _generation
    _generation += 1


_step_hook = register_optimizer_step_post_hook(_bump_generation)


def step_generation() -> int:
    """How many optimizer steps (and manual invalidations) this process has seen."""
    return _generation


def invalidate_weight_cache() -> None:
    """Forget every cached FP8 weight (the next forward re-quantizes)."""
    _bump_generation()
    _cache.clear()


def _tracing(t: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return True
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


def _quantize_weight(w: torch.Tensor):
    q = F.quantize_per_tensor(w.detach().contiguous(), "e4m3", transpose=True)
    return q.data, q.data_t, q.scale


def _weight_fp8(w: torch.Tensor):
    """(w8 [N, K], w8_t [K, N], scale) for the current value of w, cached when safe."""
    if _tracing(w) or w.is_inference():
        return _quantize_weight(w)
    key = (_generation, w._version, w.data_ptr(), w.dtype, w.device, tuple(w.shape))
    hit = _cache.get(w)
    if hit is not None and hit[0] == key:
        return hit[1]
    val = _quantize_weight(w)
    stats["weight_quantizations"] += 1
    _cache[w] = (key, val)
    return val


# ---- the GEMMs -------------------------------------------------------------------------------------


def _gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """What fp8_gemm can produce for a wanted dtype (fp16 goes through fp32)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _gemm(a, b, sa, sb, out_dtype, bias=None):
    """fp8_gemm in out_dtype. On CUDA the reduction dim (K) must be a multiple of 16; the weight
    gradient reduces over tokens, so an odd token count takes an exact-operand bf16 matmul."""
    g_dtype = _gemm_dtype(out_dtype)
    if a.is_cuda and a.shape[1] % 16:
        y = (a.to(torch.bfloat16) @ b.to(torch.bfloat16).t()).to(g_dtype) * (sa * sb).to(g_dtype)
    else:
        fuse = bias is not None and g_dtype == torch.bfloat16 and bias.dtype == torch.bfloat16
        y = _gemm_ops.fp8_gemm(a, b, sa, sb, bias if fuse else None, g_dtype)
        if fuse:
            bias = None
    if bias is not None:
        y = y + bias.to(g_dtype)
    return y if y.dtype == out_dtype else y.to(out_dtype)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, w8, w8_t, w_scale, out_dtype, need_wgrad):
        k = x.shape[-1]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        # x8^T (for dW) is written in the same pass as x8, and only when dW will be needed.
        xq = F.quantize_per_tensor(x2, "e4m3", transpose=need_wgrad)
        y = _gemm(xq.data, w8, xq.scale, w_scale, out_dtype, bias)
        ctx.save_for_backward(xq.data_t if need_wgrad else None, xq.scale, w8_t, w_scale)
        ctx.x_dtype = x.dtype
        ctx.x_shape = x.shape
        ctx.w_dtype = weight.dtype
        ctx.has_bias = bias is not None
        ctx.b_dtype = bias.dtype if bias is not None else None
        return y.reshape(*lead, w8.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x8_t, x_scale, w8_t, w_scale = ctx.saved_tensors
        n = dy.shape[-1]
        dy2 = dy.reshape(-1, n)
        if not dy2.is_contiguous():
            dy2 = dy2.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dq = F.quantize_per_tensor(dy2, "e5m2", transpose=need_w)
        dx = dw = db = None
        if need_x:
            dx = _gemm(dq.data, w8_t, dq.scale, w_scale, ctx.x_dtype).reshape(ctx.x_shape)
        if need_w:
            dw = _gemm(dq.data_t, x8_t, dq.scale, x_scale, ctx.w_dtype)
        if need_b and ctx.has_bias:
            db = dy2.sum(0, dtype=torch.float32).to(ctx.b_dtype)
        return dx, dw, db, None, None, None, None, None


def _supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.device.type == "cuda":
        n, k = weight.shape
        if k % 16 or n % 16:
            key = (k, n)
            if key not in _warned:
                _warned.add(key)
                warnings.warn(
                    f"coat Fp8Linear: in_features={k} / out_features={n} are not multiples of 16 "
                    "(cuBLASLt FP8); this layer runs in BF16",
                    stacklevel=3,
                )
            return False
        return True
    return x.device.type == "cpu"


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with FP8 GEMMs (autograd-aware); x may have any leading dims.

    Output dtype: the autocast dtype when autocast is on for x's device, else x's dtype.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        raise ValueError(f"x must be a float32, bfloat16 or float16 tensor, got {getattr(x, 'dtype', type(x))}")
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x's last dimension must equal weight.shape[1]: x is {list(x.shape)}, weight is {list(weight.shape)}"
        )
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"weight and bias must be on x's device {x.device}")
    if not _supported(x, weight):
        stats["fallbacks"] += 1
        return tF.linear(x, weight, bias)
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    w8, w8_t, w_scale = _weight_fp8(weight)
    need_wgrad = torch.is_grad_enabled() and weight.requires_grad
    with torch.autocast(dev, enabled=False):
        return _Fp8LinearFn.apply(x, weight, bias, w8, w8_t, w_scale, out_dtype, need_wgrad)


class Fp8Linear(nn.Linear):
    """``nn.Linear`` with FP8 GEMMs; same parameters and state-dict keys."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        """Turns ``linear`` into an Fp8Linear in place (same parameter objects, nothing copied)."""
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        linear.__class__ = cls
        return linear
