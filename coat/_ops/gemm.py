"""Custom ops of the FP8 GEMM family: ``y = (a * scale_a) @ (b * scale_b).T``.

``a`` is ``[M, K]`` and ``b`` is ``[N, K]`` FP8 (both K-contiguous, the layout ``nn.Linear`` needs;
e5m2 x e5m2 is rejected), scales are per-tensor fp32 dequantization multipliers on the operands'
device. Accumulation is fp32. On CUDA, K and N must be multiples of 16 (cuBLASLt FP8); callers that
cannot guarantee it fall back themselves (``coat.nn.Fp8Linear`` does). csrc/include/coat/gemm.h
holds the full contract.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from .. import _C
from ._util import custom_op
from ._util import dev_ctx as _dev_ctx
from ._util import stream as _stream
from .enums import FP8_DTYPE_IDS as _FMT
from .enums import GEMM_OUT_IDS as _OUT

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

# Run the bf16 path (what devices without FP8 tensor cores do) on every GPU: for tests/comparisons.
_force_bf16 = os.environ.get("COAT_GEMM_FORCE_BF16", "0") == "1"

# One cuBLASLt workspace per (device, stream): GEMMs on one stream run in order, so they can share.
_workspaces: dict[tuple[int, int], torch.Tensor] = {}


@contextlib.contextmanager
def force_bf16(enabled: bool = True):
    """Within the block, CUDA GEMMs take the bf16 path that sm80 devices use."""
    global _force_bf16
    old, _force_bf16 = _force_bf16, enabled
    try:
        yield
    finally:
        _force_bf16 = old


def forced_bf16() -> bool:
    """Whether CUDA GEMMs take the bf16 path now (``force_bf16`` / ``COAT_GEMM_FORCE_BF16=1``)."""
    return _force_bf16


def _workspace(device: int, stream: int) -> torch.Tensor:
    key = (device, stream)
    ws = _workspaces.get(key)
    if ws is None:
        ws = torch.empty(_C.GEMM_WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device("cuda", device))
        _workspaces[key] = ws
    return ws


def _name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def check_args(a, b, scale_a, scale_b, bias, out_dtype, out_scale=None) -> None:
    """Raises ValueError naming the offending argument (also run by the fake implementations)."""
    for arg, t in (("a", a), ("b", b)):
        if t.dtype not in _FP8:
            raise ValueError(f"{arg} must be float8_e4m3fn or float8_e5m2, got {_name(t.dtype)}")
        if t.dim() != 2:
            raise ValueError(f"{arg} must be 2-D, got shape {list(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{arg} must be contiguous (call {arg}.contiguous() first)")
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise ValueError(
            "a and b are both e5m2: FP8 tensor cores have no e5m2 x e5m2 product; quantize one "
            "operand (usually the weight side, b) as e4m3"
        )
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"b must have the K of a (a is {list(a.shape)} = [M, K], b is {list(b.shape)} = [N, K])")
    named = [("scale_a", scale_a), ("scale_b", scale_b)]
    if out_scale is not None:
        named.append(("out_scale", out_scale))
    for arg, s in named:
        if s.dtype != torch.float32 or s.numel() != 1:
            raise ValueError(f"{arg} must be a float32 tensor with one element, got {_name(s.dtype)} {list(s.shape)}")
    if out_dtype not in _OUT:
        raise ValueError(f"out_dtype must be float32, bfloat16 or float8_e4m3fn, got {out_dtype}")
    if (out_dtype == torch.float8_e4m3fn) != (out_scale is not None):
        raise ValueError("out_scale is required with out_dtype=float8_e4m3fn and only used with it")
    if bias is not None:
        if bias.dtype != torch.bfloat16 or bias.shape != (b.shape[0],):
            raise ValueError(f"bias must be bfloat16 of shape [N] = [{b.shape[0]}], got {_name(bias.dtype)} {list(bias.shape)}")
        if out_dtype == torch.float32:
            raise ValueError(
                "bias needs a bfloat16 or e4m3 output (cuBLASLt's FP8 kernels have no bias epilogue "
                "for float32 output); add the bias separately"
            )
    others = [("b", b), ("scale_a", scale_a), ("scale_b", scale_b), ("bias", bias), ("out_scale", out_scale)]
    for arg, t in others:
        if t is not None and t.device != a.device:
            raise ValueError(f"{arg} is on {t.device} but a is on {a.device}")


def _aligned(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """cuBLASLt wants 16-byte aligned operands; a view at an odd offset is copied."""
    if t is None or not t.is_cuda or t.data_ptr() % 16 == 0:
        return t
    return t.clone()


def _run(a, b, scale_a, scale_b, bias, out_dtype, out_scale, want_amax, fast_accum=False):
    """(out, amax or None); the core checks the arguments (ValueError), the binding makes the outputs."""
    st = _stream(a)
    ws = None
    if a.is_cuda:
        a, b, bias = _aligned(a), _aligned(b), _aligned(bias)
        ws = _workspace(a.get_device(), st)
    with _dev_ctx(a):
        return _C.gemm_fp8(a, _FMT[a.dtype], scale_a, b, _FMT[b.dtype], scale_b, bias, _OUT[out_dtype], out_scale,
                           want_amax, ws, _force_bf16, fast_accum, st)


def _checked_run(check, *args):
    """Runs the GEMM, leaving argument checks to the core; when it refuses, the Python check
    (the one the fake implementation runs) names the problem in torch's terms. The happy path,
    every call of a training step, pays for no second check."""
    try:
        return _run(*args)
    except (ValueError, KeyError, TypeError):
        check()
        raise


def _check_fp8_gemm(a, b, scale_a, scale_b, bias, out_dtype) -> None:
    """fp8_gemm's checks (the op and its fake): check_args, and no FP8 output."""
    if out_dtype == torch.float8_e4m3fn:
        raise ValueError("out_dtype must be float32 or bfloat16 (use fp8_gemm_amax for an FP8 output)")
    check_args(a, b, scale_a, scale_b, bias, out_dtype)


@custom_op("coat::fp8_gemm", mutates_args=())
def fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b).T (+ bias)`` as float32 or bfloat16. ``fast_accum``: Hopper's
    fast FP8 accumulation (no periodic fp32 promotion; coat uses it for forward GEMMs only)."""
    if out_dtype == torch.float8_e4m3fn:
        raise ValueError("out_dtype must be float32 or bfloat16 (use fp8_gemm_amax for an FP8 output)")
    return _checked_run(lambda: _check_fp8_gemm(a, b, scale_a, scale_b, bias, out_dtype),
                        a, b, scale_a, scale_b, bias, out_dtype, None, False, fast_accum)[0]


@fp8_gemm.register_fake
def _(a, b, scale_a, scale_b, bias, out_dtype, fast_accum=False):
    _check_fp8_gemm(a, b, scale_a, scale_b, bias, out_dtype)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@custom_op("coat::fp8_gemm_amax", mutates_args=())
def fp8_gemm_amax(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    out_scale: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like fp8_gemm, also returning amax = max |y| (before the output rounding; fused in cuBLASLt
    for an e4m3 output). out_dtype float8_e4m3fn stores ``e4m3(y / out_scale)``."""
    check_args(a, b, scale_a, scale_b, bias, out_dtype, out_scale)
    return _run(a, b, scale_a, scale_b, bias, out_dtype, out_scale, True)


@fp8_gemm_amax.register_fake
def _(a, b, scale_a, scale_b, bias, out_dtype, out_scale):
    check_args(a, b, scale_a, scale_b, bias, out_dtype, out_scale)
    return (
        a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype),
        a.new_empty((1,), dtype=torch.float32),
    )


def fp8_gemm_scaled(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, a_mode: str,
                    b_mode: str, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b).T`` with row or block scales (``quantize.SCALE_MODES``: "row" x
    "row", or "1x128" with "1x128" or "128x128"), codes from ``quantize.quantize_scaled``; float32 or
    bfloat16 out. On CUDA: an sm_90 GPU, M, N and K multiples of 16 (quantize_scaled pads)."""
    from .quantize import SCALE_MODES
    for name, m in (("a_mode", a_mode), ("b_mode", b_mode)):
        if m not in SCALE_MODES:
            raise ValueError(f"{name} must be one of {sorted(SCALE_MODES)}, got {m!r}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in _FMT:
            raise ValueError(f"{name} must be float8_e4m3fn or float8_e5m2 codes (view uint8 codes as their format), "
                             f"got {t.dtype}")
    st = _stream(a)
    ws = _workspace(a.get_device(), st) if a.is_cuda else None
    with _dev_ctx(a):
        return _C.gemm_fp8(a, _FMT[a.dtype], scale_a, b, _FMT[b.dtype], scale_b, None, _OUT[out_dtype], None, False, ws,
                           _force_bf16, fast_accum, st, SCALE_MODES[a_mode], SCALE_MODES[b_mode])[0]


def native_fp8(device: torch.device) -> bool:
    """Whether GEMMs on this CUDA device run on FP8 tensor cores (else the bf16 path)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    return bool(_C.gemm_fp8_native(device.index if device.index is not None else torch.cuda.current_device()))
