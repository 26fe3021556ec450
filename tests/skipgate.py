"""No silent skips. Under CI (the variable CI set to anything but empty/0/false) or with
LLMFT_NO_SKIPS=1 (which `make test` sets), a test that skips and is not on the allow-list
tests/allowed_skips.yaml fails the run at session end, naming the test and its skip reason. Outside
those, skips stay skips (a developer's machine may lack Node, Chromium or root).

Registered by tests/conftest.py; a plugin module of its own so that a test can run it on a
generated suite (tests/unit/repo/test_skip_gate.py)."""

from __future__ import annotations

import os
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
import yaml

ALLOWED = Path(__file__).with_name("allowed_skips.yaml")
_skipped: list[tuple[str, str]] = []


def gate_on() -> bool:
    ci = os.environ.get("CI", "").strip().lower()
    return os.environ.get("LLMFT_NO_SKIPS") == "1" or ci not in ("", "0", "false", "no")


def load_allowed(path: Path = ALLOWED) -> dict[str, str]:
    """{node id pattern (fnmatch): reason}; every entry must say why it may skip."""
    entries = yaml.safe_load(path.read_text(encoding="utf-8")) or []
    allowed = {}
    for i, entry in enumerate(entries, 1):
        if not (isinstance(entry, dict) and entry.get("test") and str(entry.get("reason") or "").strip()):
            raise pytest.UsageError(f"{path}: entry {i} needs a `test` pattern and a `reason`")
        allowed[str(entry["test"])] = str(entry["reason"])
    return allowed


def not_allowed(skipped: list[tuple[str, str]], allowed: dict[str, str]) -> list[tuple[str, str]]:
    return [(node, why) for node, why in skipped if not any(fnmatchcase(node, p) for p in allowed)]


def _record(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        longrepr = report.longrepr
        why = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        why = why.removeprefix("Skipped: ")
        _skipped.append((report.nodeid, why))


def pytest_runtest_logreport(report):
    _record(report)


def pytest_collectreport(report):
    _record(report)


def pytest_sessionfinish(session, exitstatus):
    # Under pytest-xdist the controller sees every worker's reports and decides; workers do not.
    if hasattr(session.config, "workerinput") or not gate_on():
        return
    bad = not_allowed(_skipped, load_allowed())
    if bad:
        session.config.stash[_BAD] = bad
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    bad = config.stash.get(_BAD, [])
    if bad:
        terminalreporter.section("skips not on tests/allowed_skips.yaml (no silent skips)", red=True)
        for node, why in bad:
            terminalreporter.line(f"{node}: {why}")
        terminalreporter.line(
            f"{len(bad)} skipped test(s) fail this run: install what they need or allow them"
        )


_BAD = pytest.StashKey[list]()
