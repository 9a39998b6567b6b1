"""tools/cuda_deps.py: nvidia-cublas (568 MB) is asked for only when the build compiles CUDA and the
CUDA toolkit lacks cuBLASLt; the same answer goes to tools/install.sh and to the wheel's metadata."""

import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("cuda_deps", ROOT / "tools" / "cuda_deps.py")
cd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cd)


def _toolkit(root: Path, version: str = "13.0", cublas: bool = False) -> Path:
    """A toolkit folder whose bin/nvcc answers --version like the real one."""
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {version}, V{version}.88'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    if cublas:
        (root / "targets" / "x86_64-linux" / "include").mkdir(parents=True)
        (root / "targets" / "x86_64-linux" / "include" / "cublasLt.h").write_text("")
        (root / "lib64").mkdir()
        (root / "lib64" / "libcublasLt.so.13").write_text("")
    return nvcc


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("CUDACXX", raising=False)
    monkeypatch.delenv("COAT_WITH_CUDA", raising=False)
    return monkeypatch


def test_no_nvcc_needs_nothing(env, tmp_path):
    env.setenv("PATH", str(tmp_path))
    assert cd.cublas_requirement() is None


def test_toolkit_without_cublas_needs_the_wheel_of_its_version(env, tmp_path):
    nvcc = _toolkit(tmp_path / "cuda")
    env.setenv("PATH", str(nvcc.parent))
    assert cd.cublas_requirement() == "nvidia-cublas==13.0.*"
    env.setenv("COAT_WITH_CUDA", "OFF")  # the CMake option, read from the environment by pyproject.toml
    assert cd.cublas_requirement() is None


def test_toolkit_with_cublas_needs_nothing(env, tmp_path):
    nvcc = _toolkit(tmp_path / "cuda", cublas=True)
    env.setenv("PATH", str(tmp_path))  # no nvcc on PATH: CUDACXX names it, as for CMake
    env.setenv("CUDACXX", str(nvcc))
    assert cd.cublas_requirement() is None


def test_header_without_library_is_not_enough(env, tmp_path):
    nvcc = _toolkit(tmp_path / "cuda", version="13.1", cublas=True)
    os.remove(tmp_path / "cuda" / "lib64" / "libcublasLt.so.13")
    env.setenv("CUDACXX", str(nvcc))
    assert cd.cublas_requirement() == "nvidia-cublas==13.1.*"


def test_metadata_and_command_line_agree(env, tmp_path):
    nvcc = _toolkit(tmp_path / "cuda")
    env.setenv("CUDACXX", str(nvcc))
    deps = cd.dynamic_metadata("dependencies", {"base": ["torch>=2.6", "numpy"]})
    assert deps == ["torch>=2.6", "numpy", "nvidia-cublas==13.0.*"]
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "cuda_deps.py")], capture_output=True, text=True,
                         check=True, env={**os.environ, "CUDACXX": str(nvcc)}).stdout
    assert out.strip() == "nvidia-cublas==13.0.*"
    with pytest.raises(RuntimeError, match="not 'version'"):
        cd.dynamic_metadata("version", {})
