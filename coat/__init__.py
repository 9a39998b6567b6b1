"""coat: memory-efficient FP8 training for PyTorch (COAT: FP8 optimizer states and activations)."""

from . import _C, functional
from .convert import convert
from .fp8.tensor import DreTensor, Fp8Tensor
from .graphs import CudaGraphStep

__version__ = "0.1.0"

__all__ = ["convert", "CudaGraphStep", "functional", "Fp8Tensor", "DreTensor", "built_with_cuda", "__version__"]


def built_with_cuda() -> bool:
    """Whether this build carries the CUDA kernels (the CPU path is always there)."""
    return bool(_C.built_with_cuda())
