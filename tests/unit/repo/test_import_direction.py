"""The package reads like the DAG (docs/layout.md): `llmft.core` imports only `llmft.core`, a stage
package imports only `llmft.core` and itself, the entry points (`llmft.__main__`, the CLI, and
`llmft.worker`, the training worker torchrun runs) may import anything, the module import graph has
no circle, and no function is longer than MAX_LINES. Every import counts, at any depth: one inside a
function is an arrow all the same, only hidden. Each failure names the file, the line and the
import."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO

ROOT = REPO / "workflow"
MAX_LINES = 80

# Arrows across stages allowed all the same: none (the preference package, llmft/preference/, removed
# the last three). Nothing may be added here.
ALLOWED: set[tuple[str, str]] = set()

# Functions over MAX_LINES allowed for now: none (the preference move split sft/render.py's render,
# sft/plan.py's resolve and __main__.py's _later_commands). Nothing may be added here.
LONG_FOR_NOW: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Import:
    importer: str  # module name, e.g. llmft.sft.train
    target: str  # the llmft module (or package) it imports
    path: Path
    line: int
    text: str  # the import as written

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root.parent).as_posix()}:{self.line}"


def module_names(root: Path) -> dict[str, Path]:
    """Every module and package under root/llmft by dotted name (a package by its __init__.py)."""
    out = {}
    for path in sorted((root / "llmft").rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a module or package of the tree."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in modules:
            return candidate
    return None


def _from_base(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    if not node.level:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _named(node: ast.AST, module: str, is_package: bool) -> list[tuple[str, str]]:
    """(dotted name imported, the import as written) for one node, [] when it imports nothing."""
    if isinstance(node, ast.Import):
        return [(a.name, f"import {a.name}") for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _from_base(node, module, is_package)
        if not base:
            return []
        text = f"from {'.' * node.level}{node.module or ''} import "
        return [(f"{base}.{a.name}", text + a.name) for a in node.names] + [(base, text + "...")]
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
            return [(node.args[0].value, f"{called}({node.args[0].value!r})")]
    return []


def collect(root: Path) -> tuple[list[Import], list[tuple[Path, int, str, int]]]:
    """Every import of an llmft module under root/llmft, at any depth, and every function as
    (path, line, name, length in lines)."""
    modules = module_names(root)
    imports: list[Import] = []
    functions: list[tuple[Path, int, str, int]] = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        seen = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((path, node.lineno, node.name, node.end_lineno - node.lineno + 1))
            named = _named(node, module, is_package)
            if isinstance(node, ast.ImportFrom) and named:
                # `from a.b import c`: the module a.b.c where c is one, else a.b itself
                base, rest = named[-1], named[:-1]
                named = [n for n in rest if _resolve(n[0], modules) == n[0]]
                if len(named) < len(rest):
                    named.append(base)
            for name, text in named:
                if name.split(".")[0] != "llmft":
                    continue
                target = _resolve(name, modules)
                if target is None or target == module or (target, node.lineno) in seen:
                    continue
                seen.add((target, node.lineno))
                imports.append(Import(module, target, path, node.lineno, text))
    return imports, functions


# Top-level modules that put stages together, so may import any of them: the CLI and the torchrun worker.
ENTRY_POINTS = {"__main__", "worker"}


def stage(module: str) -> str:
    """core, a stage package's name, an entry point (__main__, worker), or llmft for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def wrong_way(imp: Import) -> str | None:
    """Why an import runs the wrong way (None: it does not)."""
    own, theirs = stage(imp.importer), stage(imp.target)
    if own in ENTRY_POINTS:
        return None
    if own == "core":
        return None if theirs == "core" else "core imports core only"
    if theirs in ("core", own):
        return None
    return f"a stage ({own}) imports core and itself only"


def cycles(imports: list[Import]) -> list[list[Import]]:
    """One circle of imports through each strongly connected set of modules (Tarjan's algorithm)."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        edges.setdefault(imp.importer, {}).setdefault(imp.target, imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[Import]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.add(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(_circle(v, members, edges))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def _circle(start: str, members: set[str], edges: dict[str, dict[str, Import]]) -> list[Import]:
    """A path of imports from `start` back to it inside `members` (breadth-first: a shortest one)."""
    back: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w, imp in sorted(edges.get(v, {}).items()):
                if w in members and w not in back:
                    back[w] = imp
                    nxt.append(w)
        if start in back:
            break
        frontier = nxt
    path, v = [], start
    while True:
        imp = back[v]
        path.append(imp)
        v = imp.importer
        if v == start:
            return path[::-1]


def _show(imp: Import) -> str:
    return f"{imp.where(ROOT)} {imp.importer} -> {imp.target} ({imp.text})"


def test_every_import_runs_down_or_within_its_stage():
    imports, _ = collect(ROOT)
    wrong = [(imp, why) for imp in imports if (why := wrong_way(imp))]
    unlisted = [f"{_show(imp)}: {why}" for imp, why in wrong if (imp.importer, imp.target) not in ALLOWED]
    assert unlisted == [], "imports that run the wrong way:\n" + "\n".join(unlisted)
    stale = ALLOWED - {(imp.importer, imp.target) for imp, _ in wrong}
    assert not stale, f"ALLOWED lists arrows that no longer exist, remove them: {sorted(stale)}"


def test_no_circle_of_imports():
    imports, _ = collect(ROOT)
    found = [" ; ".join(_show(imp) for imp in circle) for circle in cycles(imports)]
    assert found == [], "circles of imports (inside functions too):\n" + "\n".join(found)


def test_no_function_over_the_limit():
    _, functions = collect(ROOT)
    package = ROOT / "llmft"
    long = {
        (path.relative_to(package).as_posix(), name): f"{path.relative_to(ROOT.parent).as_posix()}:{line} "
        f"{name}: {n} lines"
        for path, line, name, n in functions
        if n > MAX_LINES
    }
    unlisted = sorted(where for key, where in long.items() if key not in LONG_FOR_NOW)
    assert unlisted == [], f"functions over {MAX_LINES} lines:\n" + "\n".join(unlisted)
    stale = LONG_FOR_NOW - set(long)
    assert not stale, (
        f"LONG_FOR_NOW lists functions now at most {MAX_LINES} lines, remove them: {sorted(stale)}"
    )


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "llmft" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_checker_sees_every_kind_of_import(tmp_path):
    root = _tree(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/io.py": "def f():\n    from llmft.sft import train\n",
            "core/text.py": "from . import io\nfrom .io import f\n",
            "sft/__init__.py": "",
            "sft/train.py": "import importlib\n\ndef g():\n    importlib.import_module('llmft.data.prep')\n",
            "data/__init__.py": "",
            "data/prep.py": "from ..core import text\nimport llmft.sft.train\n",
            "__main__.py": "from llmft.data import prep\nfrom llmft.sft.train import g\n",
            "worker.py": "from llmft.sft.train import g\n",
        },
    )
    imports, functions = collect(root)
    seen = {(i.importer, i.target, i.line) for i in imports}
    assert seen == {
        ("llmft.core.io", "llmft.sft.train", 2),  # inside a function, `from package import module`
        ("llmft.core.text", "llmft.core.io", 1),  # relative, a module
        ("llmft.core.text", "llmft.core.io", 2),  # relative, a name of a module
        ("llmft.sft.train", "llmft.data.prep", 4),  # importlib.import_module
        ("llmft.data.prep", "llmft.core.text", 1),  # two dots up
        ("llmft.data.prep", "llmft.sft.train", 2),
        ("llmft.__main__", "llmft.data.prep", 1),
        ("llmft.__main__", "llmft.sft.train", 2),
        ("llmft.worker", "llmft.sft.train", 1),
    }
    wrong = sorted((i.importer, i.target) for i in imports if wrong_way(i))
    assert wrong == [
        ("llmft.core.io", "llmft.sft.train"),
        ("llmft.data.prep", "llmft.sft.train"),
        ("llmft.sft.train", "llmft.data.prep"),
    ]
    (circle,) = cycles(imports)
    assert {(i.importer, i.target) for i in circle} == {
        ("llmft.sft.train", "llmft.data.prep"),
        ("llmft.data.prep", "llmft.sft.train"),
    }
    assert {(name, n) for _, _, name, n in functions} == {("f", 2), ("g", 2)}
