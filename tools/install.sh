#!/usr/bin/env bash
# Installs coat from this checkout on a fresh machine (Debian/Ubuntu, Python >= 3.10): system
# packages, torch (before anything that depends on it), build requirements, then coat itself in
# editable mode with its C++ tests. nvcc on PATH (or CUDACXX) enables the CUDA kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
if ! dpkg -s libgtest-dev ninja-build cmake >/dev/null 2>&1; then
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends libgtest-dev ninja-build cmake >/dev/null
fi
# torch first (TORCH_SPEC overrides; the default is the CPU-or-CUDA build pip picks for 2.13.0).
python3 -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
python3 -m pip install -q "nanobind>=2" "scikit-build-core>=0.10" "nvidia-cublas==13.0.*" "pytest>=7" expecttest "peft>=0.14"
COAT_BUILD_TESTS=ON python3 -m pip install -q --no-build-isolation -e .
python3 -c "import coat; print('coat', coat.__version__, '| CUDA kernels:', coat.built_with_cuda())"
