"""Every performance and accuracy figure in README.md, docs/ and config/README.md is rendered from
bench/results by bench/render_tables.py: a committed table that differs from a fresh rendering fails
here, so no figure can be edited by hand or quoted two ways."""

import importlib.util
import json
import re

import pytest

from tests.conftest import REPO


def _render_tables():
    spec = importlib.util.spec_from_file_location("render_tables", REPO / "bench" / "render_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rt = _render_tables()


def test_every_committed_table_is_what_the_script_renders():
    assert rt.stale() == [], "run python bench/render_tables.py"


def test_every_table_is_rendered_somewhere_and_every_marker_is_known():
    used = set()
    for path in rt.doc_files():
        text = path.read_text()
        opened = re.findall(r"<!-- table:([a-z0-9-]+) -->", text)
        assert len(opened) == text.count("<!-- /table -->"), f"{path}: a table marker is not closed"
        unknown = set(opened) - set(rt.TABLES)
        assert not unknown, f"{path}: unknown table(s) {sorted(unknown)}"
        used.update(opened)
    assert used == set(rt.TABLES), f"tables rendered nowhere: {sorted(set(rt.TABLES) - used)}"


def test_the_readme_quotes_the_performance_table_and_both_timings():
    readme = (REPO / "README.md").read_text()
    for name in ("performance", "suite-time", "demo-time"):
        assert f"<!-- table:{name} -->" in readme, name


def test_a_hand_edited_figure_is_caught(tmp_path, monkeypatch):
    doc = tmp_path / "README.md"
    fresh = f"<!-- table:performance -->\n{rt.performance()}\n<!-- /table -->\n"
    doc.write_text(fresh.replace("1.37×", "1.73×", 1))
    monkeypatch.setattr(rt, "REPO", tmp_path)
    monkeypatch.setattr(rt, "DOCS", ("README.md",))
    assert rt.stale() == ["README.md: performance"]
    assert rt.main(["--check"]) == 1
    assert rt.main([]) == 0 and doc.read_text() == fresh


@pytest.mark.parametrize("name", ["suite_timings.json", "demo_timings.json"])
def test_the_timing_files_name_commit_date_machine_and_command(name):
    runs = json.loads((REPO / "bench" / "results" / name).read_text())["runs"]
    assert runs
    for run in runs:
        assert re.fullmatch(r"[0-9a-f]{7,40}", run["commit"]), run
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d", run["commit_date"]), run
        assert run["machine"] and run["command"] and run.get("seconds", run.get("pipeline_seconds")) > 0


def test_every_source_file_the_script_names_exists():
    names = [v for k, v in vars(rt).items() if k.isupper() and isinstance(v, str) and v.endswith(".json")]
    names += [
        n
        for k, v in vars(rt).items()
        if k.isupper() and isinstance(v, tuple)
        for n in v
        if n.endswith(".json")
    ]
    missing = [n for n in names if not (rt.RESULTS / n).is_file()]
    assert names and not missing, missing
