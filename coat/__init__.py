"""coat: memory-efficient FP8 training for PyTorch (COAT: FP8 optimizer states and activations)."""

import torch

try:
    from . import _C
except ImportError as e:  # built against another torch: its C++ symbols differ
    raise ImportError(
        f"coat's compiled module does not load with torch {torch.__version__} ({e}). It is built "
        "against the torch it is installed with: reinstall coat (pip install --no-build-isolation -e .)"
    ) from e
if _C.TORCH_VERSION != torch.__version__:
    raise ImportError(
        f"coat was built against torch {_C.TORCH_VERSION} but torch {torch.__version__} is installed; "
        "reinstall coat (pip install --no-build-isolation -e .) so that its tensor bindings match"
    )

from . import functional  # noqa: E402
from .convert import convert  # noqa: E402
from .fp8.tensor import DreTensor, Fp8Tensor  # noqa: E402
from .graphs import CudaGraphStep  # noqa: E402
from .nn.stats import Fp8Stats, fp8_stats  # noqa: E402

__version__ = "0.1.0"

__all__ = ["convert", "CudaGraphStep", "Fp8Stats", "fp8_stats", "functional", "Fp8Tensor", "DreTensor", "built_with_cuda", "__version__"]


def built_with_cuda() -> bool:
    """Whether this build carries the CUDA kernels (the CPU path is always there)."""
    return bool(_C.built_with_cuda())
