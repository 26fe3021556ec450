"""No silent skips. Under CI (the variable CI set to anything but empty/0/false) or with
LLMFT_NO_SKIPS=1 (which `make test` sets), a test that skips or xfails and is not on the allow-list
tests/allowed_skips.yaml fails the run at session end, naming the test and its reason. An entry
allows a node id pattern with one reason pattern: the same test skipping for another reason (a
different missing tool) still fails the run. Outside those, skips stay skips (a developer's machine
may lack Node, Chromium or root).

Registered by tests/conftest.py; a plugin module of its own so that a test can run it on a
generated suite (tests/unit/repo/test_skip_gate.py). Under pytest-xdist the controller decides: it
receives every worker's test reports and its skipped collection reports.
"""

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


def load_allowed(path: Path = ALLOWED) -> list[dict]:
    """[{test: node id pattern, reason: skip or xfail reason pattern (both fnmatch), why: ...}]."""
    entries = yaml.safe_load(path.read_text(encoding="utf-8")) or []
    for i, entry in enumerate(entries, 1):
        if not (
            isinstance(entry, dict)
            and all(str(entry.get(k) or "").strip() for k in ("test", "reason", "why"))
        ):
            raise pytest.UsageError(
                f"{path}: entry {i} needs a `test` pattern, a `reason` pattern and a `why`"
            )
    return entries


def not_allowed(skipped: list[tuple[str, str]], allowed: list[dict]) -> list[tuple[str, str]]:
    def listed(node: str, why: str) -> bool:
        return any(fnmatchcase(node, a["test"]) and fnmatchcase(why, a["reason"]) for a in allowed)

    return [(node, why) for node, why in skipped if not listed(node, why)]


def _record(report) -> None:
    if not report.skipped:
        return
    if hasattr(report, "wasxfail"):  # an xfail is a test that did not prove what it names
        why = f"xfail: {report.wasxfail}" if report.wasxfail else "xfail"
    else:
        longrepr = report.longrepr
        why = (longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)).removeprefix("Skipped: ")
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
            f"{len(bad)} skipped or xfailed test(s) fail this run: install what they need or allow them"
        )


_BAD = pytest.StashKey[list]()
