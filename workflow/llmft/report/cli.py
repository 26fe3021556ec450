"""The report stage's CLI commands (report, trend), which llmft.__main__ collects."""

from __future__ import annotations

import functools
from collections.abc import Callable

from llmft.core.cli import config_of
from llmft.core.settings import Config


def cmd_report(args, stage_pages: Callable[[], tuple]) -> int:
    from llmft.report.page import build_report

    raw = config_of(args)
    build_report(
        Config.from_dict(raw),
        args.run_dir,
        args.out_dir,
        args.results_dir,
        stage_pages=stage_pages(),
        validated=raw,
    )
    return 0


def cmd_trend(args) -> int:
    from llmft.report.trend import build_trend

    runs = build_trend(args.results_dir, args.out)
    print(f"trend of {len(runs)} run(s) written to {args.out}")
    return 0


def register(sub, add, stage_pages: Callable[[], tuple]) -> dict:
    """Add the stage's commands through llmft.core.cli.adder's `add` (and `sub` for trend, which takes
    no config); `stage_pages`: the page parts other stages add (a stage imports no other stage).
    Nothing to hide from their imports."""
    report = functools.partial(cmd_report, stage_pages=stage_pages)
    add(
        "report",
        report,
        "run-dir=the run's folder (results/<run>)",
        "out-dir=the folder for index.html, summary.json and figures",
        "results-dir?=the folder of every run, for the trend page beside the report",
        help="write the run's HTML report",
    )
    p = sub.add_parser("trend", help="held-out metrics and throughput of every run under --results-dir")
    p.add_argument("--results-dir", default="results", help="the folder holding one folder per run")
    p.add_argument("--out", default="results/trend.html", help="the HTML page to write")
    p.set_defaults(fn=cmd_trend)

    return {}
