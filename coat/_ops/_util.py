"""Helpers shared by the custom-op modules."""

from __future__ import annotations

import contextlib

import torch

from ..fp8.formats import CORE_ID, format_of_dtype


def stream(t: torch.Tensor) -> int:
    """The raw cudaStream_t of the current stream on t's device (0 for CPU tensors)."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def u8(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors cross into the core as uint8 views (DLPack has no FP8 dtypes)."""
    return t.view(torch.uint8)


def fmt_id(dtype: torch.dtype, arg: str = "fp8_dtype") -> int:
    """The core's format enum for a torch FP8 dtype."""
    return CORE_ID[format_of_dtype(dtype, arg)]


def dev_ctx(t: torch.Tensor):
    """DLPack export needs the tensor's device to be the current one."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
