"""The benchmarks stage's CLI commands (benchmarks, benchmarks-fetch), which llmft.__main__ collects."""

from __future__ import annotations

import sys

from llmft.core.cli import settings_of


def cmd_benchmarks(args) -> int:
    from llmft.benchmarks.run import run_benchmarks
    from llmft.benchmarks.score import BenchmarkError

    try:
        run_benchmarks(
            settings_of(args).eval,
            args.model,
            args.out,
            args.cache_dir,
            threads=args.threads,
            processes=args.processes,
        )
    except BenchmarkError as exc:
        print(f"llmft: benchmark error: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_benchmarks_fetch(args) -> int:
    from pathlib import Path

    from llmft.benchmarks.tasks import fetch

    cache = fetch(settings_of(args).eval, Path.cwd())
    print(f"the data of every task in eval.benchmarks is in {cache}")
    return 0


def register(add) -> dict:
    """Add the stage's commands through llmft.core.cli.adder's `add`; nothing to hide from their imports."""
    p = add(
        "benchmarks",
        cmd_benchmarks,
        "model=the model folder to score",
        "out=the results.json to write",
        "cache-dir=the content-addressed score cache (results/.benchmarks-cache)",
        help="eval.benchmarks (lm-eval) on one model",
    )
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch default)")
    p.add_argument(
        "--processes",
        type=int,
        default=0,
        help="lm-eval processes, each scoring a share of the documents (0 = one per GPU of the job, "
        "1 on CPU; more than 1 on CPU: CPU processes over gloo)",
    )
    add(
        "benchmarks-fetch",
        cmd_benchmarks_fetch,
        help="fill the datasets cache for eval.benchmarks (needs internet)",
    )
    return {}
