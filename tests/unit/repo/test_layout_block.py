"""docs/layout.md's block lists every module of workflow/llmft with what it owns: a module added
without a line there, or a line left for a module that no longer exists, fails here."""

import re

from tests.conftest import REPO

LAYOUT = REPO / "docs" / "layout.md"
PACKAGE = REPO / "workflow" / "llmft"


def _block_modules(text: str) -> list[str]:
    """The module paths (relative to workflow/llmft, with .py) the block names, in order."""
    lines = text.splitlines()
    start = lines.index("workflow/llmft/") + 1
    end = lines.index("```", start)
    modules: list[str] = []
    folders: list[str] = []  # the folder open at each depth
    for line in lines[start:end]:
        if not line.strip():
            continue
        match = re.match(r"( *)(\S+)(?:\s+(.*))?$", line)
        indent, name, what = match.group(1), match.group(2), match.group(3)
        assert len(indent) % 2 == 0 and len(indent) >= 2, f"odd indent in layout block: {line!r}"
        assert what, f"layout block line says nothing about what {name} owns: {line!r}"
        depth = len(indent) // 2 - 1
        assert depth <= len(folders), f"layout block line nested under nothing: {line!r}"
        folders = folders[:depth]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
            continue
        stem = name if name.endswith(".py") else name + ".py"
        modules.append("/".join([*folders, stem]))
    return modules


def _package_modules() -> set[str]:
    return {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py" and "__pycache__" not in path.parts
    }


def test_every_module_has_a_line_and_every_line_a_module():
    named = _block_modules(LAYOUT.read_text())
    assert len(named) == len(set(named)), f"named twice: {sorted({m for m in named if named.count(m) > 1})}"
    actual = _package_modules()
    assert sorted(actual - set(named)) == [], "modules with no line in docs/layout.md's block"
    assert sorted(set(named) - actual) == [], "docs/layout.md's block names modules that do not exist"


def test_readme_links_the_layout_page():
    assert "(docs/layout.md)" in (REPO / "README.md").read_text()


def test_parser_sees_a_missing_and_a_stale_module():
    block = "\n".join(
        ["```", "workflow/llmft/", "  __main__.py   the CLI", "  core/   shared", "    config   the config"]
        + ["  sft/   sft", "    gone   old", "```"]
    )
    assert _block_modules(block) == ["__main__.py", "core/config.py", "sft/gone.py"]
