"""The README's reliability table, made from the tests that try each fault and hostile input.

A test declares its row with @reliability(fault=..., seen=..., steps_lost=..., data_lost=...); the
row names the test. `python -m tests.reliability` prints the table;
tests/unit/repo/test_reliability_table.py fails when the README's copy differs from it.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

ROWS: list[dict] = []
MODULES = [
    "tests.workflow.test_faults",
    "tests.workflow.test_pipeline_faults",
    "tests.slurm.test_node_lost",
    "tests.slurm.test_sft_resume",
    "tests.workflow.test_sft_launcher",
    "tests.unit.sft.test_divergence_guard",
    "tests.slurm.test_cluster",
    "tests.slurm.test_nightly",
    "tests.workflow.test_hostile_paths",
    "tests.workflow.test_bad_datasets",
    "tests.unit.data.test_sources",
    "tests.unit.data.test_tools",
    "tests.unit.data.test_prepare",
    "tests.unit.data.test_preference",
    "tests.unit.core.test_config",
    "tests.unit.core.test_chat_templates",
    "tests.unit.core.test_model_folders",
    "tests.workflow.test_pipeline",
    "tests.workflow.test_profile_check",
    "tests.unit.test_main",
    "tests.unit.report.test_trend",
    "tests.workflow.test_shell_values",
    "tests.unit.nightly.test_run",
    "tests.unit.repo.test_skip_gate",
    "tests.workflow.test_benchmarks",
    "tests.unit.benchmarks.test_run",
    "tests.unit.core.test_fp8",
    "tests.workflow.test_promote",
    "tests.workflow.test_continue",
    "tests.unit.data.test_delta",
    "tests.unit.sft.test_preference",
    "tests.slurm.test_preference_resume",
]
BEGIN = "<!-- reliability table: python -m tests.reliability -->"
END = "<!-- end of reliability table -->"


def reliability(*, fault: str, seen: str, steps_lost: str, data_lost: str):
    def mark(fn):
        path = Path(inspect.getsourcefile(fn)).resolve()
        rel = path.relative_to(Path(__file__).resolve().parents[1])
        ROWS.append(
            {"fault": fault, "seen": seen, "steps_lost": steps_lost, "data_lost": data_lost,
             "test": f"{rel}::{fn.__name__}"}
        )  # fmt: skip
        return fn

    return mark


def table() -> str:
    for name in MODULES:
        importlib.import_module(name)
    lines = [
        BEGIN,
        "| fault or hostile input | what the user sees | steps lost | data lost | test |",
        "|---|---|---|---|---|",
    ]

    def order(row: dict) -> int:
        module = row["test"].split("::")[0].removesuffix(".py").replace("/", ".")
        return MODULES.index(module) if module in MODULES else len(MODULES)

    seen = set()
    for r in sorted(ROWS, key=order):
        if (r["test"], r["fault"]) in seen:  # a module imported twice registers its rows twice
            continue
        seen.add((r["test"], r["fault"]))
        lines.append(f"| {r['fault']} | {r['seen']} | {r['steps_lost']} | {r['data_lost']} | `{r['test']}` |")
    lines.append(END)
    return "\n".join(lines)


if __name__ == "__main__":
    # the test modules register their rows in tests.reliability, not in this __main__ copy
    from tests.reliability import table as registered

    sys.stdout.write(registered() + "\n")
