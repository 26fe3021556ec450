"""The report end to end: a dataset whose rows carry `<script>` and an `onerror` attribute goes
through the whole DAG (real LLaMA-Factory training, real evaluation); the page, the trend page and
`snakemake --report` are built from it, and headless Chromium (Debian's package, installed by
tests/setup-chromium.sh) opens the pages from disk.

Also here, because it needs a trained model: the evaluation split over two processes gives the
same predictions as one process (the multi-GPU path, exercised on CPU).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from llmft.core.assets import synthetic_rows
from llmft.core.io import read_jsonl, write_json, write_jsonl

from tests.browser import Browser, chromium_path
from tests.conftest import BIN, REPO, make_workdir, reuse_verify, rules_run, snakemake

pytestmark = pytest.mark.workflow

SCRIPT = "<script>alert(1)</script>"
ONERROR = "<img src=x onerror=alert(2)>"
needs_chromium = pytest.mark.skipif(
    chromium_path() is None, reason="chromium is not installed (tests/setup-chromium.sh could not install it)"
)


def hostile_rows() -> list[dict]:
    """The demo's word tasks, with markup in some inputs, answers and instructions, answers of six
    lines in others, plus two invalid rows (no output) that the run drops and counts."""
    rows = synthetic_rows(700, seed=7)
    for i, row in enumerate(rows):
        if row["task"] == "repeat" and i % 2 == 0:
            row["input"] = f"{SCRIPT} {row['input']}"
            row["output"] = row["input"]
        elif row["task"] == "repeat":  # long: the samples table collapses it
            row["input"] = "\n".join([row["input"]] * 6)
            row["output"] = row["input"]
        elif row["task"] == "category" and i % 3 == 0:
            row["instruction"] = f"{row['instruction']} {ONERROR}"
    rows += [{"instruction": f"{SCRIPT} broken row", "input": ""}, {"instruction": "no answer either"}]
    return rows


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("hostile")
    write_jsonl(work / "hostile.jsonl", hostile_rows())
    make_workdir(
        work,
        run="hostile",
        data__sources=[{"path": "hostile.jsonl", "format": "alpaca", "weight": 1.0}],
        data__invalid_rows="drop",
        data__cutoff_len=96,  # markup and six-line answers cost tokens: the demo's 64 would drop them
        sft__max_steps=60,
    )
    reuse_verify(work, "hostile")  # a real verify_env report of this machine, made once a session
    proc = snakemake(work)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "report" in rules_run(proc.stderr + proc.stdout)
    return work, work / "results/hostile"


def test_markup_in_rows_is_text_in_every_page(hostile_run):
    _, run = hostile_run
    heldout = (run / "data/heldout.jsonl").read_text()
    assert SCRIPT in heldout and ONERROR in heldout  # the hostile rows really reached the held-out split
    predictions = read_jsonl(run / "eval/tuned/predictions.jsonl")
    assert any(SCRIPT in p["prompt"] for p in predictions)
    stats = json.loads((run / "data/stats.json").read_text())
    assert stats["invalid"] == 2 and len(stats["invalid_examples"]) == 2
    for page in ("index.html", "trend.html"):
        text = (run / "report" / page).read_text()
        assert "<script" not in text.lower() and "<img" not in text.lower(), page
    index = (run / "report/index.html").read_text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in index
    assert "&lt;img src=x onerror=alert(2)&gt;" in index
    # The snakemake --report tables are data files: the raw text, not HTML.
    assert SCRIPT in (run / "report/samples.tsv").read_text()


@needs_chromium
def test_harness_sees_console_errors_and_requests(tmp_path):
    """The checks below can fail: a page that logs an error and fetches a URL is caught."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!doctype html><script>console.error("boom")</script><img src="http://192.0.2.1/x.png">')
    with Browser() as browser:
        load = browser.open(bad)
    assert any("boom" in e for e in load.errors())
    assert "http://192.0.2.1/x.png" in load.requests


def check_page(browser: Browser, page, shots_dir) -> list[dict]:
    """Open a page; assert no console error and no request but the file; assert every chart with
    data renders (a screenshot of its area has grey levels and coloured pixels). Returns the charts."""
    import numpy as np
    from PIL import Image

    load = browser.open(page)
    assert load.errors() == [], load.errors()
    assert load.requests == [page.resolve().as_uri()]  # self-contained: nothing fetched
    assert browser.evaluate("document.scripts.length") == 0
    charts = browser.elements("svg.chart")
    assert charts
    for i, chart in enumerate(charts):
        assert chart["width"] > 100 and chart["height"] > 100, chart
        png = browser.screenshot(chart["x"], chart["y"], chart["width"], chart["height"])
        (shots_dir / f"{page.stem}-{i}.png").write_bytes(png)
        pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)
        variance = float(pixels.mean(axis=2).var())
        coloured = int(((pixels.max(axis=2) - pixels.min(axis=2)) > 60).sum())
        assert variance > 50, f"{chart['label']}: blank chart (grey-level variance {variance:.1f})"
        if "na" in chart["cls"].split():
            assert coloured == 0, chart["label"]  # only the "n/a" text
        else:
            assert coloured > 200, f"{chart['label']}: no coloured line or bar ({coloured} pixels)"
    return charts


@needs_chromium
def test_report_page_renders_in_chromium(hostile_run, tmp_path):
    _, run = hostile_run
    with Browser() as browser:
        charts = check_page(browser, run / "report/index.html", tmp_path)
        body = browser.evaluate("document.body.innerText")
        images = browser.evaluate("document.images.length")
    labels = [c["label"] for c in charts]
    for title in ("Loss", "Learning rate", "Gradient norm", "tokens/s", "FLOPs", "Token length"):
        assert any(title in label for label in labels), (title, labels)
    mfu = next(c for c in charts if "FLOPs" in c["label"])
    assert "na" in mfu["cls"].split()  # a CPU run has no peak FLOP/s: MFU is n/a
    assert SCRIPT in body and ONERROR in body  # shown as text ...
    assert images == 0  # ... and never parsed as an element
    for section in ("Held-out metrics", "Sample generations", "Invalid rows (2)", "verify_env", "Provenance"):
        assert section in body, section


@needs_chromium
def test_long_rows_are_collapsed_and_open_on_a_click(hostile_run, tmp_path):
    _, run = hostile_run
    page = run / "report/index.html"
    assert "<details>" in page.read_text()
    rows = "document.querySelectorAll('table.samples tbody tr')"
    with Browser() as browser:
        browser.open(page)
        heights = json.loads(
            browser.evaluate(f"JSON.stringify([...{rows}].map(r => r.getBoundingClientRect().height))")
        )
        collapsed = browser.evaluate(f"[...{rows}].filter(r => r.querySelector('details')).length")
        first = "document.querySelector('table.samples details')"
        before = browser.evaluate(f"{first}.querySelector('.full').checkVisibility()")
        browser.evaluate(f"{first}.querySelector('summary').click()")
        after = browser.evaluate(f"{first}.querySelector('.full').checkVisibility()")
        shown = browser.evaluate(f"{first}.querySelector('.full').innerText")
    assert collapsed >= 1 and heights and max(heights) < 120, heights  # no row pages tall
    assert not before and after and shown.count("\n") >= 5  # a click shows all six lines


@needs_chromium
def test_trend_page_reads_runs_with_and_without_optional_keys(hostile_run, tmp_path):
    _, run = hostile_run
    results = tmp_path / "results"
    summary = json.loads((run / "report/summary.json").read_text())
    # An older run without throughput keys, and a nightly one with a promotion decision.
    old = {k: v for k, v in summary.items() if k not in ("tokens_per_second_per_gpu", "mfu", "generated")}
    old["run"] = "2026-11-28"
    nightly = dict(summary, run="2026-11-29", generated="2026-11-29T02:00:00Z")
    nightly["promotion"] = {"status": "rejected", "reason": f"exact_match fell {SCRIPT}"}
    for s in (old, nightly, summary):
        write_json(results / s["run"] / "report/summary.json", s)
    out = tmp_path / "trend.html"
    proc = subprocess.run(
        [sys.executable, "-m", "llmft", "trend", "--results-dir", str(results), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "trend of 3 run(s)" in proc.stdout
    with Browser() as browser:
        charts = check_page(browser, out, tmp_path)
        body = browser.evaluate("document.body.innerText")
    assert len(charts) == 4
    assert f"rejected: exact_match fell {SCRIPT}" in body
    assert "2026-11-28" in body and "hostile" in body


def test_snakemake_report_zip(hostile_run, tmp_path):
    work, _ = hostile_run
    proc = snakemake(work, "--report", str(tmp_path / "report.zip"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with zipfile.ZipFile(tmp_path / "report.zip") as zf:
        names = zf.namelist()
    for item in ("index.html", "trend.html", "loss.svg", "mfu.svg", "length_histogram.svg", "samples.tsv"):
        assert any(n.endswith(item) for n in names), (item, names[:20])


def test_two_process_evaluation_matches_one(hostile_run, tmp_path):
    """Shards over processes (one per GPU on a GPU node) give the same predictions, in order."""
    work, run = hostile_run
    cfg = {"run": "hostile", "eval": {"max_rows": 300, "batch_size": 8}}  # several batches per process
    outs = {}
    for n in (1, 2):
        out = tmp_path / f"p{n}"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "llmft",
                "evaluate",
                "--config-json",
                json.dumps(cfg),
                "--model",
                str(run / "sft/model"),
                "--heldout",
                str(run / "data/heldout.jsonl"),
                "--out-dir",
                str(out),
                "--label",
                "tuned",
                "--processes",
                str(n),
            ],
            capture_output=True,
            text=True,
            cwd=work,
            env=dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}"),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs[n] = out
    one, two = (read_jsonl(outs[n] / "predictions.jsonl") for n in (1, 2))
    assert [r["index"] for r in two] == list(range(len(one)))
    assert one == two
    metrics = json.loads((outs[2] / "metrics.json").read_text())
    assert metrics["processes"] == 2 and metrics["devices"] == ["cpu", "cpu"]
    shutil.rmtree(tmp_path, ignore_errors=True)
