"""docs/reliability.md's table, made from the tests that prove its rows.

A test declares the row it proves with the marker
`@pytest.mark.reliability(fault=..., seen=..., steps_lost=..., data_lost=...)`, written above the
assertions that prove it; a bound in the wording is formatted from the constant the test asserts
with, so the two cannot part. Tests whose markers carry the same four texts share one row.

`python -m tests.reliability` collects the files that use the marker with pytest itself and prints
the table (`--write`: into docs/reliability.md), each row naming its tests by the node id pytest
gives them (parameters left out: the id runs every case). A marker on something pytest does not
collect (a helper, a module it skips, a misnamed file) makes no row; a row whose test is renamed,
moved or deleted disappears from the table. tests/unit/repo/test_reliability_table.py fails when
docs/reliability.md's copy differs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs/reliability.md"
BEGIN = "<!-- reliability table: python -m tests.reliability --write -->"
END = "<!-- end of reliability table -->"
FIELDS = ("fault", "seen", "steps_lost", "data_lost")
# The table's sections, in this order: rows of the files not listed come last.
ORDER = [
    "tests/workflow/test_faults.py",
    "tests/workflow/test_pipeline_faults.py",
    "tests/slurm/test_node_lost.py",
    "tests/slurm/test_sft_resume.py",
    "tests/workflow/test_sft_launcher.py",
    "tests/workflow/test_divergence_guard_run.py",
    "tests/slurm/test_cluster.py",
    "tests/slurm/test_nightly.py",
    "tests/workflow/test_hostile_paths.py",
    "tests/workflow/test_bad_datasets.py",
    "tests/unit/data/",
    "tests/unit/core/test_config.py",
    "tests/unit/core/test_chat_templates.py",
    "tests/unit/core/test_model_folders.py",
    "tests/workflow/test_pipeline.py",
    "tests/workflow/test_profile_check.py",
    "tests/unit/test_main.py",
    "tests/unit/report/",
    "tests/workflow/test_shell_values.py",
    "tests/unit/nightly/",
    "tests/unit/repo/",
    "tests/workflow/test_benchmarks.py",
    "tests/unit/benchmarks/",
    "tests/unit/core/test_fp8.py",
    "tests/workflow/test_promote.py",
    "tests/workflow/test_quarantine.py",
    "tests/workflow/test_continue.py",
    "tests/unit/sft/",
    "tests/slurm/test_preference_resume.py",
]
_OUT = "LLMFT_RELIABILITY_OUT"


def pytest_collection_finish(session):
    """Plugin hook (`-p tests.reliability`): write every collected test's reliability markers."""
    found = []
    for item in session.items:
        for mark in item.iter_markers("reliability"):
            missing = [f for f in FIELDS if not str(mark.kwargs.get(f) or "").strip()]
            if mark.args or missing or set(mark.kwargs) - set(FIELDS):
                raise ValueError(
                    f"{item.nodeid}: a reliability marker takes exactly {FIELDS}; missing {missing}"
                )
            found.append({"test": item.nodeid.split("[")[0], **{f: mark.kwargs[f] for f in FIELDS}})
    Path(os.environ[_OUT]).write_text(json.dumps(found))


def marked_files(root: Path = REPO) -> list[str]:
    """The test files that use the marker (collecting only these keeps it to a few seconds)."""
    files = sorted(root.glob("tests/**/test_*.py"))
    return [str(p.relative_to(root)) for p in files if "pytest.mark.reliability(" in p.read_text()]


def collect(root: Path = REPO) -> list[dict]:
    """Every reliability marker on a test pytest collects under `root`: [{test: node id, fault, ...}]."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.reliability"]
        cmd += ["-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir", str(root), *marked_files(root)]
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, _OUT: str(out), "PYTHONPATH": path}
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"collecting the marked tests failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        return json.loads(out.read_text())


def rows(found: list[dict]) -> list[dict]:
    """One row per distinct wording, naming each test that carries it, in ORDER's sections."""
    merged: dict[tuple, dict] = {}
    for entry in found:
        row = merged.setdefault(tuple(entry[f] for f in FIELDS), {**entry, "tests": []})
        if entry["test"] not in row["tests"]:
            row["tests"].append(entry["test"])

    def section(row: dict) -> int:
        return next((i for i, p in enumerate(ORDER) if row["tests"][0].startswith(p)), len(ORDER))

    return sorted(merged.values(), key=section)


def table(found: list[dict]) -> str:
    lines = [
        BEGIN,
        "| fault or hostile input | what the user sees | steps lost | data lost | tests (pytest node ids) |",
        "|---|---|---|---|---|",
    ]
    for r in rows(found):
        tests = "<br>".join(f"`{t}`" for t in r["tests"])
        lines.append(f"| {r['fault']} | {r['seen']} | {r['steps_lost']} | {r['data_lost']} | {tests} |")
    lines.append(END)
    return "\n".join(lines)


def documented(text: str) -> str:
    """The table as docs/reliability.md holds it."""
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{DOC.name} needs one {BEGIN} ... {END}"
    return text[text.index(BEGIN) : text.index(END) + len(END)]


if __name__ == "__main__":
    fresh = table(collect())
    if sys.argv[1:] == ["--write"]:
        text = DOC.read_text()
        DOC.write_text(text.replace(documented(text), fresh))
    else:
        sys.stdout.write(fresh + "\n")
