"""torch.library custom ops over the compiled core: the only package that calls coat._C.

One module per kernel family, mirroring csrc/bindings/ (import the family module you need:
``from coat._ops import quantize``). Every op is functional (returns new tensors, or declares
what it mutates) and has a fake implementation, so it works under torch.compile and FakeTensor
tracing. FP8 data crosses into the core as uint8 views.

This package loads the compiled core (here, once, with the check that it matches the installed
torch); the rest of coat reads the core's constants and ops from its modules.
"""

import torch

try:
    from .. import _C
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


def built_with_cuda() -> bool:
    """Whether this build carries the CUDA kernels (the CPU path is always there)."""
    return bool(_C.built_with_cuda())
