"""Small statistics for reading training results: means, spreads and Student t intervals."""

from __future__ import annotations

import math
from typing import Sequence

#: Two-sided 95% quantiles t_{0.975, df} of Student's t, df 1..30.
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788,
         2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639,
         2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)
_Z975 = 1.959964


def t975(df: int) -> float:
    """t_{0.975, df}: the table up to 30 degrees of freedom, then the Cornish-Fisher expansion
    around the normal quantile (within 1e-4 there; the normal limit 1.96 as df grows)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def mean_std(xs: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for one value)."""
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None)


def mean_se(xs: Sequence[float]) -> tuple[float, float | None]:
    """Mean and its standard error (None for one value)."""
    m, sd = mean_std(xs)
    return m, None if sd is None else sd / math.sqrt(len(xs))
