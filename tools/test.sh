#!/usr/bin/env bash
# The test command (README): C++ CPU tests (GoogleTest under CTest) and the Python suite. GPU tests
# run too when a CUDA device is present (pytest marker `gpu`, CTest label `gpu`).
# Expects the install tools/install.sh makes: C++ tests built and the test requirements present
# (by hand: COAT_BUILD_TESTS=ON pip install --no-build-isolation -e ".[test]").
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${COAT_BUILD_DIR:-build/py}
if [ ! -f "$BUILD/CTestTestfile.cmake" ]; then
  echo "no C++ test build in $BUILD: run bash tools/install.sh, or by hand" \
       "COAT_BUILD_TESTS=ON pip install --no-build-isolation -e \".[test]\"" >&2
  exit 2
fi
if ! python3 -c "import pytest, expecttest, peft" 2>/dev/null; then
  echo "the Python tests need pytest, expecttest and peft (pyproject.toml's [test] extra):" \
       "pip install \"pytest>=7\" expecttest \"peft>=0.14\"" >&2
  exit 2
fi
labels=cpu
if python3 -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then labels="cpu|gpu"; fi
ctest --test-dir "$BUILD" -L "$labels" --output-on-failure
python3 -m pytest -q tests/python
