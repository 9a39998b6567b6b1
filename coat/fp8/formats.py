"""FP8 formats and the names users pass for them. Pure Python: the compiled core's ids for these
names are in coat._ops.enums (read from the core itself)."""

from __future__ import annotations

import torch

#: Format name -> torch dtype of the codes.
DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
#: Largest finite magnitude of each format.
MAX = {"e4m3": 448.0, "e5m2": 57344.0}
#: How per-group scales may be stored (the core's ids of these: coat._ops.enums.SCALE_KINDS).
SCALE_KINDS = ("fp32", "e8m0")
GROUP_SIZES = (16, 32, 64, 128)


def format_name(fmt: str | torch.dtype, arg: str = "fmt") -> str:
    """Normalises 'e4m3' / 'e5m2' / torch.float8_* to a format name; raises ValueError naming `arg`."""
    if isinstance(fmt, torch.dtype):
        for name, dt in DTYPES.items():
            if dt == fmt:
                return name
    elif isinstance(fmt, str) and fmt.lower() in DTYPES:
        return fmt.lower()
    raise ValueError(f"{arg} must be 'e4m3', 'e5m2', torch.float8_e4m3fn or torch.float8_e5m2, got {fmt!r}")


def format_of_dtype(dtype: torch.dtype, arg: str = "q") -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"{arg} must hold FP8 codes (torch.float8_e4m3fn or torch.float8_e5m2), got {dtype}")
