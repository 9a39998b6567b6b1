#!/usr/bin/env bash
# Build coat on the GPU machine, run the GPU test suites (C++ and Python) and the benchmarks named as arguments
# (e.g. `bash tools/gpu_run.sh quantize optim`). Logs and JSON go to $OUT (or ./gpu_out).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
start=$(date +%s)
if ! COAT_BUILD_TESTS=ON python3 -m pip install --no-build-isolation --no-deps -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90a \
      -Cbuild-dir=build/gpu -e . > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
ctest --test-dir build/gpu -L gpu --output-on-failure 2>&1 | tee "$OUT/ctest_gpu.log" | tail -8
python3 -m pytest -q -m gpu tests/python ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
for b in "$@"; do
  echo "== bench_$b"
  python3 "benchmarks/bench_$b.py" --out "$OUT/bench_$b.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_$b.log" | tail -40
done
