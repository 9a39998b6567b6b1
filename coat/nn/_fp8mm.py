"""The GEMM layer under the fused LM head (``lm_head_loss.py``): per-tensor quantization of
activations and gradients and an FP8 "NT" matrix product (a @ b.T with both operands row-major FP8).
The layer blocks do not come here: their GEMMs run inside the block op (``block.py``).

On CUDA the product runs on coat's own FP8 GEMM (``coat::fp8_gemm``, cuBLASLt with cached plans;
its bf16 path on GPUs without FP8 tensor cores), or on ``torch._scaled_mm`` with
``COAT_LAYER_GEMM=scaled_mm`` (for comparisons). Dimensions that are not multiples of 16 are
zero-padded (zeros add nothing to the products). On the CPU it is emulated exactly: the FP8
operands are dequantized and multiplied in fp32, so the numerics are the same up to accumulation
order.
"""

from __future__ import annotations

import functools
import os

import torch

from .._ops import gemm as gops
from .._ops import quantize as qops
from .._ops.enums import FP8_DTYPE_IDS as _FMT

_BACKEND = os.environ.get("COAT_LAYER_GEMM", "coat")
_SCALED_MM = _BACKEND == "scaled_mm"
_GEMM_OUT = (torch.float32, torch.bfloat16)  # what coat::fp8_gemm writes itself


def quantize(x2d: torch.Tensor, fp8_dtype: torch.dtype, transpose: bool):
    """Per-tensor FP8 with an amax computed on the device: (q, q_t or None, scale)."""
    q, q_t, scale, _ = qops.quantize_per_tensor_amax(x2d, _FMT[fp8_dtype], transpose)
    return q.view(fp8_dtype), (q_t.view(fp8_dtype) if transpose else None), scale


def _use_scaled_mm(t: torch.Tensor) -> bool:
    if not _SCALED_MM or not hasattr(torch, "_scaled_mm"):
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
    if a.is_cuda and not _SCALED_MM and k % 16 == 0 and n % 16 == 0 and m and out_dtype in _GEMM_OUT:
        return gops.fp8_gemm(a, b, sa, sb, None, out_dtype, fast_accum)  # every call of a Llama step
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
        out = gops.fp8_gemm(ap, bp, sa, sb, None, dt, fast_accum)
        out = out if np_ == n else out[:, :n].contiguous()
        return out if dt == out_dtype else out.to(out_dtype)
    return ((a.float() * sa) @ (b.float() * sb).t()).to(out_dtype)


@functools.cache
def f32_out_gemm(device_type: str, dtype: torch.dtype) -> str:
    """What this torch offers for ``dtype`` (bf16/fp16) operands with an fp32 result on a device
    type, probed once: "addmm" (``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)``
    accumulates into fp32: CUDA, torch >= 2.10), "mm" (``torch.mm(a, b, out_dtype=torch.float32)``:
    CUDA, torch 2.9) or "none" (the CPU, older torch: callers upcast the operands). A probe that
    raises means the form is not there; that is the answer, not an error."""
    if device_type != "cuda":
        return "none"
    a = torch.zeros(16, 16, dtype=dtype, device=device_type)
    c = torch.zeros(16, 16, dtype=torch.float32, device=device_type)
    for name, call in (("addmm", lambda: torch.addmm(c, a, a, out_dtype=torch.float32, out=c)),
                       ("mm", lambda: torch.mm(a, a, out_dtype=torch.float32))):
        try:
            call()
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, NotImplementedError):
            continue
        return name
    return "none"


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result: for bf16/fp16 operands one GEMM with fp32 accumulation whose
    product is never rounded to their dtype (upcast operands where torch has no such GEMM)."""
    if a.dtype == torch.float32:
        return a @ b
    if f32_out_gemm(a.device.type, a.dtype) != "none":
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()

