"""coat's layering, read from the source's own import statements (issue 27 item 5): no import
circles (imports inside functions included: a lazy import only hides a circle), the compiled core
loaded by coat/_ops alone, and the library never importing the application (coat/cli)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "coat"


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(p.relative_to(PKG.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the names it imports (modules of coat, plus coat._C), from every import statement."""
    out: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods or a.name == "_C" else base
                          for a in node.names}
        out[name] = {m for m in found if (m in mods or m == "coat._C") and m != name}
    return out


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    mods = _modules()
    assert len(mods) > 40  # the scan sees the package
    assert _cycles(_imports(mods)) == []


def test_the_compiled_core_is_loaded_by_coat_ops_alone() -> None:
    users = sorted(m for m, deps in _imports(_modules()).items() if "coat._C" in deps)
    assert users and all(m.startswith("coat._ops") for m in users), users


def test_the_library_never_imports_the_application() -> None:
    imports = _imports(_modules())
    library = [m for m in imports if not (m.startswith("coat.cli") or m == "coat.__main__")]
    assert [m for m in library if any(d.startswith("coat.cli") for d in imports[m])] == []


def test_the_scan_finds_a_circle_hidden_in_a_function() -> None:
    edges = _imports({"coat.a": _write("a", "import coat.b\n"), "coat.b": _write("b", "def f():\n    from coat import a\n")})
    assert _cycles(edges) == [["coat.a", "coat.b"]]


def _write(name: str, text: str) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(text)
    return path
