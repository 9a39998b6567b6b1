"""Does this build need cuBLASLt from the `nvidia-cublas` wheel?

coat's CUDA half links cuBLASLt (the FP8 GEMMs). CMakeLists.txt takes it from the CUDA toolkit when
the toolkit has it, else from the `nvidia-cublas` wheel (site-packages/nvidia/cu13). A CUDA build of
torch depends on that wheel anyway; a CPU build of torch does not, and the wheel is 568 MB, so it is
asked for only when the build compiles CUDA (nvcc found) and the toolkit lacks cuBLASLt.

Used two ways, so that tools/install.sh and the package metadata decide alike:
  - `python3 tools/cuda_deps.py` prints the pip requirement (e.g. `nvidia-cublas==13.0.*`) or
    nothing; tools/install.sh installs what it prints.
  - scikit-build-core's dynamic-metadata provider (pyproject.toml): a wheel whose module links the
    wheel's libcublasLt.so.13 declares that requirement, so `pip install coat-*.whl` on a machine
    with a CPU torch brings the library the module loads at import.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys


def find_nvcc() -> str | None:
    """The CUDA compiler CMake's check_language(CUDA) would find: $CUDACXX, else nvcc on PATH."""
    cudacxx = os.environ.get("CUDACXX")
    if cudacxx:
        return cudacxx if os.path.exists(cudacxx) else shutil.which(cudacxx)
    return shutil.which("nvcc")


def nvcc_version(nvcc: str) -> tuple[int, int]:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise RuntimeError(f"cannot read the CUDA version from `{nvcc} --version`:\n{out}")
    return int(m.group(1)), int(m.group(2))


def toolkit_has_cublaslt(nvcc: str) -> bool:
    """Header and library, where FindCUDAToolkit looks (the toolkit root above bin/nvcc)."""
    root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    incs = [os.path.join(root, "include")] + glob.glob(os.path.join(root, "targets", "*", "include"))
    libs = [os.path.join(root, d) for d in ("lib64", "lib")] + glob.glob(os.path.join(root, "targets", "*", "lib"))
    header = any(os.path.isfile(os.path.join(d, "cublasLt.h")) for d in incs)
    library = any(glob.glob(os.path.join(d, "libcublasLt.so*")) for d in libs)
    return header and library


def cublas_requirement() -> str | None:
    """The pip requirement for cuBLASLt, or None when the build does not need the wheel."""
    if os.environ.get("COAT_WITH_CUDA", "").upper() in ("0", "OFF", "FALSE", "NO"):
        return None
    nvcc = find_nvcc()
    if nvcc is None or toolkit_has_cublaslt(nvcc):
        return None
    major, minor = nvcc_version(nvcc)
    # cuBLAS wheels carry the toolkit's major.minor (13.0.x for CUDA 13.0); CMakeLists.txt finds
    # them in nvidia/cu<major>.
    return f"nvidia-cublas=={major}.{minor}.*"


def dynamic_metadata(field, settings, project=None):
    """scikit-build-core provider for `dependencies`: settings["base"] plus cuBLASLt if needed."""
    if field != "dependencies":
        raise RuntimeError(f"tools/cuda_deps.py provides `dependencies`, not {field!r}")
    deps = list(settings.get("base", []))
    req = cublas_requirement()
    if req:
        deps.append(req)
    return deps


if __name__ == "__main__":
    req = cublas_requirement()
    if req:
        print(req)
    sys.exit(0)
