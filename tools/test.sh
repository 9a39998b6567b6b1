#!/usr/bin/env bash
# The test command (README): C++ CPU tests (GoogleTest under CTest) and the Python suite. GPU tests
# run too when a CUDA device is present (pytest marker `gpu`, CTest label `gpu`).
# Expects an install with tests built: COAT_BUILD_TESTS=ON pip install --no-build-isolation -e .
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${COAT_BUILD_DIR:-build/py}
if [ ! -f "$BUILD/CTestTestfile.cmake" ]; then
  echo "no C++ test build in $BUILD: run COAT_BUILD_TESTS=ON pip install --no-build-isolation -e . first" >&2
  exit 2
fi
labels=cpu
if python3 -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then labels="cpu|gpu"; fi
ctest --test-dir "$BUILD" -L "$labels" --output-on-failure
python3 -m pytest -q tests/python
