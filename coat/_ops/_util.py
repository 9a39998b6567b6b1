"""Helpers shared by the custom-op modules."""

from __future__ import annotations

import contextlib

import torch
from torch._library.custom_ops import CustomOpDef

from ..fp8.formats import format_of_dtype
from .enums import DTYPE_IDS, FP8_FORMATS

_nullctx = contextlib.nullcontext()
_Parameter = torch.nn.Parameter
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_level = torch._C._functorch.peek_interpreter_stack


def stream(t: torch.Tensor) -> int:
    """The raw cudaStream_t of the current stream on t's device (0 for CPU tensors)."""
    return torch._C._cuda_getCurrentRawStream(t.get_device()) if t.is_cuda else 0


def u8(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of FP8 codes (the core also takes float8 tensors as they are)."""
    return t.view(torch.uint8)


def fmt_id(dtype: torch.dtype, arg: str = "fp8_dtype") -> int:
    """The core's format enum for a torch FP8 dtype."""
    return FP8_FORMATS[format_of_dtype(dtype, arg)]


def dtype_id(dtype: torch.dtype, arg: str = "dtype") -> int:
    """The core's id of a float dtype it writes (float32, bfloat16, float16)."""
    i = DTYPE_IDS.get(dtype)
    if i is None:
        raise ValueError(f"{arg} must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    return i


def dev_ctx(t: torch.Tensor):
    """Makes t's device current for the call (the core launches on the current device); a no-op
    in the common case where it already is."""
    if t.is_cuda and t.get_device() != torch._C._cuda_getDevice():
        return torch.cuda.device(t.device)
    return _nullctx


class _EagerFastOp(CustomOpDef):
    """A torch.library custom op whose eager calls on plain tensors run its Python body directly.

    The dispatcher round trip of a Python custom op costs ~20-30 us of host time per call, more than
    most of coat's kernels take on the GPU. Eager calls from coat's own autograd Functions need none
    of it (autograd is handled by the Function; the body only allocates outputs and launches), so
    they skip it. Everything else goes through the registered op and sees the same schema and fake
    implementation: torch.compile / Dynamo tracing, FakeTensor and other dispatch modes, tensor
    subclasses (DTensor, functional tensors) and functorch transforms.
    """

    def __call__(self, *args, **kwargs):
        t = args[0] if args else None
        if type(t) is list or type(t) is tuple:  # a TensorList first argument
            t = t[0] if t else None
        if eager_plain(t):
            return self._init_fn(*args, **kwargs)
        return self._opoverload(*args, **kwargs)


def eager_plain(t) -> bool:
    """Whether a call on ``t`` may run coat's kernels directly: t is a plain tensor or Parameter
    (no subclass), not on the meta device, and nothing is tracing or intercepting (torch.compile,
    dispatch modes such as FakeTensorMode, functorch transforms)."""
    return (
        (type(t) is torch.Tensor or type(t) is _Parameter)
        and not _is_compiling()
        and not _dispatch_modes()
        and _functorch_level() is None
        and not t.is_meta
    )


def custom_op(name: str, mutates_args=()):
    """``torch.library.custom_op`` with the eager fast path of ``_EagerFastOp``. The first argument
    of such an op must be a tensor (its type decides the path)."""

    def wrap(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        op.__class__ = _EagerFastOp
        return op

    return wrap
