"""coat: memory-efficient FP8 training for PyTorch (COAT: FP8 optimizer states and activations)."""

from ._ops import built_with_cuda  # loads the compiled core, checked against the installed torch
from . import functional  # noqa: E402
from .convert import convert  # noqa: E402
from .fp8.tensor import DreTensor, Fp8Tensor  # noqa: E402
from .graphs import CudaGraphStep  # noqa: E402
from .nn.stats import Fp8Stats, fp8_stats  # noqa: E402

__version__ = "0.1.0"

__all__ = ["convert", "CudaGraphStep", "Fp8Stats", "fp8_stats", "functional", "Fp8Tensor", "DreTensor", "built_with_cuda", "__version__"]

