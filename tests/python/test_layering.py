"""coat's layering, read from the source's own import statements: no import circles (imports
inside functions included: a lazy import only hides a circle), the compiled core loaded by
coat/_ops alone, and the library never importing the application (coat/cli). And the size rule of
the design: no file in coat/ over 600 lines, no function over 80."""

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


MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80  # from the ``def`` line to the last line of the body



def _oversized(paths: list[Path], root: Path) -> tuple[list[str], list[str]]:
    """Files over MAX_FILE_LINES and functions (methods and nested ones too) over
    MAX_FUNCTION_LINES, as 'path (N lines)' and 'path:name (N lines)'."""
    files, functions = [], []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            files.append(f"{rel} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    functions.append(f"{rel}:{node.name} ({length} lines)")
    return files, functions


def test_no_file_or_function_in_coat_is_too_long() -> None:
    paths = sorted(PKG.rglob("*.py"))
    assert len(paths) > 40  # the scan sees the package
    files, functions = _oversized(paths, PKG.parent)
    assert files == [], "split these files"
    assert functions == [], "split these functions"


def test_the_size_scan_counts_files_and_functions() -> None:
    def body(indent: str, lines: int) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(lines))

    ok = _write("ok", "def fits():\n" + body("    ", MAX_FUNCTION_LINES - 1))
    long = _write("long", "class C:\n    def m(self):\n" + body("        ", MAX_FUNCTION_LINES))
    big = _write("big", "x = 1\n" * (MAX_FILE_LINES + 1))
    assert _oversized([ok], ok.parent) == ([], [])
    assert _oversized([long], long.parent) == ([], [f"long.py:m ({MAX_FUNCTION_LINES + 1} lines)"])
    assert _oversized([big], big.parent) == ([f"big.py ({MAX_FILE_LINES + 1} lines)"], [])


def _write(name: str, text: str) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(text)
    return path
