#!/usr/bin/env bash
# Installs coat from this checkout on a fresh machine (Debian/Ubuntu, Python >= 3.10): system
# packages, torch (before anything that depends on it), build and test requirements, then coat
# itself in editable mode with its C++ tests (what tools/test.sh runs). nvcc on PATH (or CUDACXX)
# enables the CUDA kernels. Uses the python3 on PATH (a virtualenv's, when one is active).
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
step() { printf '[install %3ds] %s\n' "$SECONDS" "$*"; }

if ! dpkg -s libgtest-dev ninja-build cmake >/dev/null 2>&1; then
  step "system packages: cmake, ninja-build, libgtest-dev"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends libgtest-dev ninja-build cmake >/dev/null
fi
# torch first (TORCH_SPEC overrides; the default is the CPU-or-CUDA build pip picks for 2.13.0).
step "torch: ${TORCH_SPEC:-torch==2.13.0}"
python3 -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
step "build and test requirements: nanobind, scikit-build-core, pytest, expecttest, peft, pyarrow"
python3 -m pip install -q "nanobind>=2" "scikit-build-core>=0.10" "pytest>=7" expecttest "peft>=0.14" pyarrow
# cuBLASLt (the FP8 GEMMs) only when the CUDA kernels are compiled and the toolkit lacks it: the
# nvidia-cublas wheel is 568 MB, and a CUDA build of torch has brought it already (pip then has
# nothing to do). tools/cuda_deps.py decides, as it does for the wheel's dependencies.
cublas=$(python3 tools/cuda_deps.py)
if [ -n "$cublas" ]; then
  step "cuBLASLt: not in the CUDA toolkit, installing $cublas (568 MB unless torch brought it)"
  python3 -m pip install -q "$cublas"
elif command -v "${CUDACXX:-nvcc}" >/dev/null 2>&1; then
  step "cuBLASLt: from the CUDA toolkit"
else
  step "no nvcc on PATH (nor CUDACXX): building the CPU path only"
fi

# The build (about 8 minutes on 2 cores with the CUDA kernels) runs under pip, which prints nothing
# until it ends. pip -v passes CMake's and Ninja's output through: its log goes to a file, and the
# build's steps ("[12/40] Building CUDA object ...", scikit-build-core's "*** ..." stages) are shown
# as they happen. On failure the log's end is printed.
mkdir -p build
log=build/install.log
step "building and installing coat (editable, C++ tests on); full log: $log"
set +e
COAT_BUILD_TESTS=ON python3 -m pip install -v --no-build-isolation -e . >"$log" 2>&1 &
pip_pid=$!
# Follow the log until pip ends; each build step line once, prefixed with the elapsed time.
tail -n +1 -F --pid="$pip_pid" "$log" 2>/dev/null \
  | grep --line-buffered -E '^\s*(\[[0-9]+/[0-9]+\] |\*\*\* |CMake Error|ninja: build stopped)' \
  | while IFS= read -r line; do printf '[install %3ds]   %s\n' "$SECONDS" "${line#"${line%%[![:space:]]*}"}"; done
wait "$pip_pid"; rc=$?
set -e
if [ "$rc" -ne 0 ]; then
  echo "tools/install.sh: pip install failed (exit $rc); the end of $log:" >&2
  tail -n 60 "$log" >&2
  exit "$rc"
fi
step "done"
python3 -c "import coat; print('coat', coat.__version__, '| CUDA kernels:', coat.built_with_cuda())"
