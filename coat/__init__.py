"""coat: memory-efficient FP8 training for PyTorch (COAT: FP8 optimizer states and activations)."""

import os as _os
import sys as _sys


def _is_coat_command() -> bool:
    """Whether this process is the ``coat`` command (its console script or ``python -m coat``)."""
    argv = getattr(_sys, "orig_argv", [])
    return _os.path.basename(_sys.argv[0]) == "coat" or any(
        a == "-m" and b == "coat" for a, b in zip(argv, argv[1:]))


try:  # importing torch takes seconds: a Ctrl-C then ends the coat command as it does later, quietly
    from ._ops import built_with_cuda  # loads the compiled core, checked against the installed torch
    from . import functional  # noqa: E402
    from .convert import convert  # noqa: E402
    from .fp8.tensor import DreTensor, Fp8Tensor  # noqa: E402
    from .graphs import CudaGraphStep  # noqa: E402
    from .nn.recipe import Fp8Recipe  # noqa: E402
    from .nn.stats import Fp8Stats, fp8_stats  # noqa: E402
    from .side_tuning import SideTuned  # noqa: E402
except KeyboardInterrupt:
    if not _is_coat_command():
        raise
    print("\ncoat: interrupted (Ctrl-C)", file=_sys.stderr)
    raise SystemExit(130) from None

__version__ = "0.1.0"

__all__ = ["convert", "Fp8Recipe", "CudaGraphStep", "Fp8Stats", "fp8_stats", "functional", "Fp8Tensor", "DreTensor", "SideTuned",
           "built_with_cuda", "__version__"]

