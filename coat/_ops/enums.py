"""The core's enum values, read from coat._C in this one place (csrc/bindings/enums.cpp exports
each enum once as a name -> value dict). The rest of coat passes enums to the core through these
tables, keyed as Python knows the values: FP8 format names, torch dtypes, master kinds, norm kinds,
gated activations."""

from __future__ import annotations

import torch

from .. import _C
from ..fp8.formats import DTYPES as _FP8_DTYPES


def _by_dtype(ids: dict[str, int]) -> dict[torch.dtype, int]:
    return {getattr(torch, name): i for name, i in ids.items()}


#: coat::Fp8Format by format name ("e4m3", "e5m2") and by torch FP8 dtype.
FP8_FORMATS: dict[str, int] = dict(_C.FP8_FORMATS)
FP8_DTYPE_IDS: dict[torch.dtype, int] = {_FP8_DTYPES[name]: i for name, i in FP8_FORMATS.items()}
#: coat::DType by torch dtype (float32, bfloat16, float16).
DTYPE_IDS: dict[torch.dtype, int] = _by_dtype(_C.DTYPES)
#: coat::ScaleKind of per-group scales by name ("fp32", "e8m0").
SCALE_KINDS: dict[str, int] = dict(_C.SCALE_KINDS)
#: coat::MasterKind by AdamW master kind ("none", "fp32", "bf16_sr").
MASTER_KINDS: dict[str, int] = dict(_C.MASTER_KINDS)
#: coat::GemmOut by torch dtype of the GEMM output (float32, bfloat16, float8_e4m3fn).
GEMM_OUT_IDS: dict[torch.dtype, int] = _by_dtype(_C.GEMM_OUTS)
#: The pre-op of a fused block call (csrc/bindings/block.cpp) by name ("none", "norm", "swiglu").
BLOCK_PRE: dict[str, int] = dict(_C.BLOCK_PRE)
#: coat::NormKind, how an RMSNorm weight applies, by name ("scaled": Llama's w * h, "unit_offset":
#: Gemma's (1 + w) * h).
NORM_KINDS: dict[str, int] = dict(_C.NORM_KINDS)
#: coat::GatedAct, the gate's activation of the swiglu family, by name ("silu", "gelu_tanh").
GATED_ACTS: dict[str, int] = dict(_C.GATED_ACTS)
