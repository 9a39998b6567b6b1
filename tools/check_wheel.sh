#!/usr/bin/env bash
# Builds coat's wheel and proves it installs and runs where nothing can compile: a fresh virtualenv
# (no system site-packages, so neither this checkout's editable install nor its build is visible)
# with the same torch, PATH reduced to the virtualenv's bin (no cmake, nvcc, ninja or C++
# compiler), binary packages only. Then `import coat` and a CPU check of the compiled kernels.
#
# Run after tools/install.sh (.ci/run does): the wheel is built in the same build folder (build/py,
# pyproject.toml's build-dir) with the same CMake options, so it reuses that build instead of
# compiling everything again. TORCH_SPEC as for tools/install.sh. The wheel is left in build/dist/.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
step() { printf '[wheel %3ds] %s\n' "$SECONDS" "$*"; }

mkdir -p build/dist
rm -f build/dist/coat-*.whl
step "pip wheel --no-build-isolation --no-deps . (reusing build/py; log: build/wheel.log)"
if ! COAT_BUILD_TESTS=ON python3 -m pip wheel -v --no-build-isolation --no-deps -w build/dist . >build/wheel.log 2>&1; then
  echo "tools/check_wheel.sh: pip wheel failed; the end of build/wheel.log:" >&2
  tail -n 60 build/wheel.log >&2
  exit 1
fi
# How much it compiled: Ninja's step lines in the log ("[n/N] Building ..."), none when reused.
step "compile steps run for the wheel: $(grep -cE '^\s*\[[0-9]+/[0-9]+\] Building' build/wheel.log || true)"
whl=$(ls build/dist/coat-*.whl)
python3 - "$whl" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
mods = [n for n in names if n.startswith("coat/_C.") and n.endswith(".so")]
if not mods:
    sys.exit(f"{sys.argv[1]} holds no compiled module coat/_C*.so")
print(f"  {sys.argv[1]}: {len(names)} files, compiled module {mods[0]}")
EOF

work=$(mktemp -d)
orig_path=$PATH
trap 'PATH=$orig_path rm -rf "$work"' EXIT
venv=$work/venv
step "fresh virtualenv $venv with ${TORCH_SPEC:-torch==2.13.0}, then the wheel (binary packages only)"
python3 -m venv "$venv"
# Nothing on PATH but the virtualenv: a build step hidden in the install would fail here.
export PATH="$venv/bin"
for tool in cmake nvcc ninja c++ g++ gcc cc; do
  if command -v "$tool" >/dev/null 2>&1; then echo "tools/check_wheel.sh: $tool is still on PATH" >&2; exit 1; fi
done
python -m pip install -q --only-binary=:all: "${TORCH_SPEC:-torch==2.13.0}"
python -m pip install -q --only-binary=:all: "$whl"

step "import coat and check the compiled kernels on the CPU"
cd "$work"   # not the checkout: its coat/ folder would shadow the installed package
python - "$venv" <<'EOF'
import os, sys
import torch
import coat
import coat.functional as F
import coat.optim

venv = os.path.realpath(sys.argv[1])
assert os.path.realpath(coat.__file__).startswith(venv), coat.__file__
# Every library loaded from a site-packages (torch's, libcublasLt from nvidia-cublas) must be the
# virtualenv's: the module's rpath also names the build machine's folders, which exist here.
with open("/proc/self/maps") as f:
    libs = {line.split()[-1] for line in f if "site-packages" in line and ".so" in line}
outside = sorted(p for p in libs if not os.path.realpath(p).startswith(venv))
assert not outside, f"libraries loaded from outside {venv}: {outside}"
print(f"  {len(libs)} libraries from the virtualenv's site-packages, cuBLASLt: "
      f"{[p for p in libs if 'libcublasLt' in p] or 'not loaded (CPU-only build)'}")
print(f"  coat {coat.__version__} from {os.path.dirname(coat.__file__)}; torch {torch.__version__}; "
      f"CUDA kernels compiled: {coat.built_with_cuda()}")

# FP8 per-tensor quantization through coat._C: amax exact, E4M3 keeps 3 mantissa bits, so each
# normal value comes back within 2^-4 relative error.
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 128, generator=g)
t = F.quantize_per_tensor(x, "e4m3")
assert t.data.dtype == torch.float8_e4m3fn and t.data.shape == x.shape
assert float(t.amax) == float(x.abs().max()), (float(t.amax), float(x.abs().max()))
y = F.dequantize(t)
normal = x.abs() >= 2.0 ** -6 * float(t.scale)
rel = ((y - x).abs() / x.abs())[normal].max().item()
assert rel <= 2.0 ** -4, rel

# FP8 AdamW states on the CPU: a least-squares fit gets better step after step.
w = torch.nn.Parameter(torch.zeros(32, 16))
a, target = torch.randn(256, 32, generator=g), torch.randn(256, 16, generator=g)
opt = coat.optim.AdamW([w], lr=1e-2)
losses = []
for _ in range(20):
    loss = ((a @ w - target) ** 2).mean()
    losses.append(loss.item())
    opt.zero_grad()
    loss.backward()
    opt.step()
assert torch.isfinite(w).all() and losses[-1] < 0.9 * losses[0], losses
print(f"  quantize/dequantize max relative error {rel:.4f}; AdamW loss {losses[0]:.3f} -> {losses[-1]:.3f}")
EOF
step "the wheel installs and runs without a compiler"
