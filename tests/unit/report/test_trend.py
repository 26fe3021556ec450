"""The trend page links only to run folders it validated itself."""

from __future__ import annotations

import json
import re

import pytest
from llmft.report.trend import build_trend


def _run(results, folder: str, **summary) -> None:
    (results / folder / "report").mkdir(parents=True)
    (results / folder / "report/summary.json").write_text(json.dumps({"run": folder, **summary}))


@pytest.mark.reliability(
    fault="a folder under results/ named like a link scheme (`javascript:...`), or not a run name, "
    "with a report/summary.json",
    seen="left out of trend.html (no link, no row), named in a warning; the page links only to run folders",
    steps_lost="none",
    data_lost="none",
)
def test_trend_links_only_to_run_folders_it_validated(tmp_path, caplog):
    results = tmp_path / "results"
    _run(results, "a", generated="2026-01-01")
    _run(results, "javascript:alert(document.cookie)", generated="2026-01-02")
    _run(results, "-x y", generated="2026-01-03")  # a space: never a run name
    (results / "current").symlink_to("a")  # the nightly's link to the promoted run, not a run
    runs = build_trend(results, results / "trend.html")
    page = (results / "trend.html").read_text()
    assert [r["run"] for r in runs] == ["a"]
    assert re.findall(r"href='([^']*)'", page) == ["a/report/index.html"]
    assert "javascript:" not in page and "-x y" not in page
    assert "javascript:alert(document.cookie)" in caplog.text and "not a run folder" in caplog.text


def test_an_older_summary_renders_its_throughput(tmp_path):
    """A summary.json written before the throughput was measured over the last attempt's steps (a
    committed H200 pipeline run's): the trend page reads the same key from it."""
    from tests.conftest import REPO

    old = json.loads((REPO / "bench/results/pipeline_h200x1_20261201_flops.summary.json").read_text())
    results = tmp_path / "results"
    _run(results, "old", **{k: v for k, v in old.items() if k != "run"})
    _run(results, "new", generated="2099-01-01", tokens_per_second_per_gpu=2.5, mfu=0.5)
    build_trend(results, tmp_path / "trend.html")
    page = (tmp_path / "trend.html").read_text()
    assert "<td class='num'>6.494e+04</td><td>49.39%</td>" in page  # 64 944.2, MFU 0.4939
    assert "<td class='num'>2.5</td><td>50.00%</td>" in page


def test_the_trend_page_marks_a_night_whose_stack_changed(tmp_path):
    from llmft.core import stack

    old = {k: None for k in stack.FIELDS} | {"torch": "2.9.1+rocm7.0", "rocm": "7.0.2-56", "build": "rocm"}
    new = old | {"torch": "2.10.0+rocm7.1", "rocm": "7.1.0-38"}

    def st(fp):
        return {"hash": stack.stack_hash(fp), "fingerprint": fp, "differs": []}

    results = tmp_path / "results"
    _run(results, "n1", generated="2026-12-01", stack=st(old))
    _run(results, "n2", generated="2026-12-02", stack=st(old))
    _run(results, "n3", generated="2026-12-03")  # no stack recorded: compared past, not marked
    _run(results, "n4", generated="2026-12-04", stack=st(new))
    build_trend(results, results / "trend.html")
    page = (results / "trend.html").read_text()
    rows = re.findall(r"<tr( class='warn')?><td>(n\d)</td>.*?</tr>", page)
    assert rows == [("", "n1"), ("", "n2"), ("", "n3"), (" class='warn'", "n4")]
    assert (
        f"changed (torch 2.9.1+rocm7.0 -&gt; 2.10.0+rocm7.1; rocm 7.0.2-56 -&gt; 7.1.0-38): "
        f"{stack.stack_hash(new)}"
    ) in page
    assert page.count(stack.stack_hash(old)) == 2
