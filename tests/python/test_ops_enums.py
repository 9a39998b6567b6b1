"""The core's enums reach Python once: csrc/bindings/enums.cpp (and block.cpp, for its pre-op)
export each as a name -> value dict, coat/_ops/enums.py reads them, and every id coat passes to the
core comes from there. Checked three ways: the exports match the enums in the C++ headers, the
Python tables match the exports, and no module of coat holds a literal copy of an enum's ids."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

from coat import _C
from coat._ops import _util, block, enums, gemm, norm, swiglu
from coat.fp8 import formats
from coat.nn import _fp8mm

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "coat"

# Export -> (C++ enum, the file that defines it).
EXPORTS = {
    "FP8_FORMATS": ("Fp8Format", "csrc/include/coat/common.h"),
    "DTYPES": ("DType", "csrc/include/coat/common.h"),
    "SCALE_KINDS": ("ScaleKind", "csrc/include/coat/common.h"),
    "MASTER_KINDS": ("MasterKind", "csrc/include/coat/adamw.h"),
    "GEMM_OUTS": ("GemmOut", "csrc/include/coat/gemm.h"),
    "BLOCK_PRE": ("Pre", "csrc/bindings/block.cpp"),
    "NORM_KINDS": ("NormKind", "csrc/include/coat/norm.h"),
    "GATED_ACTS": ("GatedAct", "csrc/include/coat/swiglu.h"),
}


def _cpp_enum(name: str, path: str) -> list[int]:
    """The values of `enum class <name> : int { kA = 0, ... }` as written in the source."""
    src = re.sub(r"//[^\n]*", "", (ROOT / path).read_text())
    m = re.search(r"enum\s+class\s+" + name + r"\s*:\s*int\s*\{([^}]*)\}", src)
    assert m, f"enum class {name} not found in {path}"
    return [int(v) for v in re.findall(r"=\s*(\d+)", m.group(1))]


def test_each_export_covers_its_cpp_enum() -> None:
    for attr, (enum, path) in EXPORTS.items():
        values = _cpp_enum(enum, path)
        exported = getattr(_C, attr)
        assert sorted(exported.values()) == sorted(values), (attr, enum)
        assert len(set(exported.values())) == len(exported)


def test_python_tables_are_the_exports() -> None:
    assert enums.FP8_FORMATS == _C.FP8_FORMATS
    assert enums.SCALE_KINDS == _C.SCALE_KINDS
    assert enums.MASTER_KINDS == _C.MASTER_KINDS
    assert enums.BLOCK_PRE == _C.BLOCK_PRE
    assert enums.NORM_KINDS == _C.NORM_KINDS == {"scaled": 0, "unit_offset": 1}
    assert enums.GATED_ACTS == _C.GATED_ACTS == {"silu": 0, "gelu_tanh": 1}
    assert enums.DTYPE_IDS == {getattr(torch, n): i for n, i in _C.DTYPES.items()}
    assert enums.GEMM_OUT_IDS == {getattr(torch, n): i for n, i in _C.GEMM_OUTS.items()}
    assert enums.FP8_DTYPE_IDS == {formats.DTYPES[n]: i for n, i in _C.FP8_FORMATS.items()}
    # The pure-Python facts name the same things the core enumerates.
    assert set(formats.DTYPES) == set(_C.FP8_FORMATS)
    assert set(formats.SCALE_KINDS) == set(_C.SCALE_KINDS)


def test_callers_use_the_tables() -> None:
    assert gemm._FMT is enums.FP8_DTYPE_IDS and _fp8mm._FMT is enums.FP8_DTYPE_IDS
    assert gemm._OUT is enums.GEMM_OUT_IDS
    assert (block.NONE, block.NORM, block.SWIGLU) == tuple(_C.BLOCK_PRE[n] for n in ("none", "norm", "swiglu"))
    assert (swiglu.SILU, swiglu.GELU_TANH) == (_C.GATED_ACTS["silu"], _C.GATED_ACTS["gelu_tanh"])
    assert (norm.SCALED, norm.UNIT_OFFSET) == (_C.NORM_KINDS["scaled"], _C.NORM_KINDS["unit_offset"])
    assert (norm.kind_id(False), norm.kind_id(True)) == (norm.SCALED, norm.UNIT_OFFSET)
    for dt, i in enums.FP8_DTYPE_IDS.items():
        assert _util.fmt_id(dt) == i
    for dt, i in enums.DTYPE_IDS.items():
        assert _util.dtype_id(dt) == i


def _enum_names() -> set[str]:
    """What an id table would be keyed by: the exports' names and the torch FP8 dtypes' names."""
    fp8 = {str(dt).removeprefix("torch.") for dt in formats.DTYPES.values()}
    return fp8 | {n for attr in EXPORTS for n in getattr(_C, attr)}


def _key_name(node: ast.expr | None) -> str | None:
    """'e4m3' for "e4m3", 'float32' for torch.float32; None for other keys."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
        return node.attr
    return None


def _small_ints(nodes) -> list[int] | None:
    vals = [n.value for n in nodes if isinstance(n, ast.Constant) and type(n.value) is int]
    return vals if len(vals) == len(nodes) else None


def _literal_copies(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and len(node.keys) >= 2:
            # {"e4m3": 0, "e5m2": 1}, {torch.float32: 0, ...}: enum names mapped to 0..n-1
            keys = [_key_name(k) for k in node.keys]
            vals = _small_ints(node.values)
            if vals is not None and all(k in names for k in keys) and sorted(vals) == list(range(len(vals))):
                found.append((node.lineno, "dict of enum names to 0..n-1"))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple) and len(node.value.elts) >= 2:
            # NONE, NORM, SWIGLU = 0, 1, 2
            vals = _small_ints(node.value.elts)
            targets = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else []
            if (vals is not None and vals == list(range(len(vals)))
                    and {t.id.lower() for t in targets if isinstance(t, ast.Name)} & names):
                found.append((node.lineno, "names assigned 0..n-1"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "_C"
              and any(isinstance(a, ast.Constant) and type(a.value) is int for a in node.args)):
            # _C.fn(x, 0, ...): an enum id passed as a literal
            found.append((node.lineno, f"int literal passed to _C.{node.func.attr}"))
    return found


def test_the_scan_finds_copies() -> None:
    src = ('A = {"e4m3": 0, "e5m2": 1}\nB = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}\n'
           'NONE, NORM, SWIGLU = 0, 1, 2\n_C.gemm_fp8(a, 0)\nG = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}\n'
           'C = {"step": 0, "tokens": 0}\nD = {"fp32": 4, "bf16_sr": 2}\nE, F = 0, 1\n_C.f(x, False)\n')
    assert sorted(line for line, _ in _literal_copies(ast.parse(src), _enum_names())) == [1, 2, 3, 4, 5]


def test_no_module_copies_an_enum() -> None:
    names = _enum_names()
    files = sorted(PKG.rglob("*.py"))
    assert len(files) > 40
    copies = [f"{p.relative_to(ROOT)}:{line}: {what}" for p in files
              for line, what in _literal_copies(ast.parse(p.read_text()), names)]
    assert copies == []
