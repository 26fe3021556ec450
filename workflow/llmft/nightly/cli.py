"""The nightly retrain's CLI commands (gate, nightly, promote, rollback, nightly-schedule), which
llmft.__main__ collects."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable

from llmft.core.cli import settings_of
from llmft.core.config import WORKFLOW_CONFIG, effective_config
from llmft.core.settings import Config


def cmd_gate(args, gate_blocks: Callable) -> int:
    """The nightly gate's verdict (llmft.nightly.gate); a preference metric's sides are scored by the
    preference stage, given to the gate here (a stage imports no other stage)."""
    from pathlib import Path

    from llmft.nightly.gate import write_gate

    verdict = write_gate(settings_of(args), Path(args.run_dir), Path(args.out), gate_blocks)
    print(json.dumps({k: verdict[k] for k in ("run", "metric", "status", "reason")}))
    return 0


def _gate_command(add, gate_blocks: Callable) -> None:
    add(
        "gate",
        functools.partial(cmd_gate, gate_blocks=gate_blocks),
        "run-dir=the run's folder (results/<run>), whose gate evaluations are scored",
        "out=the gate.json to write (results/<run>/nightly/gate.json)",
        help="the nightly gate: this run's model against the promoted one (nightly.compare_with)",
    )


def cmd_nightly(args) -> int:
    from pathlib import Path

    from llmft.nightly.run import nightly, run_name

    # What the snakemake it starts runs (--config is passed on as its --configfile): the gate, the
    # skip's fingerprints and retention read that config, not --config with the schema's defaults.
    cfg, _ = effective_config([args.config])
    results = Path(args.results)
    run = args.run or run_name(results)
    extra = [a for a in args.snakemake_args if a != "--"]
    return nightly(Config.from_dict(cfg), args.profile, run, results, extra, configfile=args.config)


def _move_current(move) -> int:
    """Run a promote/rollback; its refusal is one named line, exit 2 (3: the nightly lock is held)."""
    from llmft.nightly.promote import PromotionError
    from llmft.nightly.run import NightlyLocked

    try:
        print(move())
    except PromotionError as exc:  # its message starts with the command (`llmft promote RUN: ...`)
        print(exc, file=sys.stderr)
        return 2
    except NightlyLocked as exc:
        print(f"llmft: {exc}", file=sys.stderr)
        return 3
    return 0


def cmd_promote(args, show_move: Callable) -> int:
    from pathlib import Path

    from llmft.nightly.promote import promote_command

    return _move_current(lambda: promote_command(Path(args.results), args.run, args.why, show_move))


def cmd_rollback(args, show_move: Callable) -> int:
    from pathlib import Path

    from llmft.nightly.promote import rollback_command

    return _move_current(lambda: rollback_command(Path(args.results), args.why, show_move))


def cmd_nightly_schedule(args) -> int:
    from pathlib import Path

    from llmft.nightly.run import schedule_lines

    # the config the scheduled nights will run: the file merged over config/config.yaml, as nightly does
    cfg, _ = effective_config([args.config])
    lines = schedule_lines(Config.from_dict(cfg).nightly, Path.cwd().resolve(), args.profile, args.config)
    print("# Slurm: paste into `scrontab -e` (`scrontab FILE` would replace your whole table)")
    print(lines["scrontab"])
    print("# cron alternative (on a login node with sbatch access): crontab -e")
    print(lines["crontab"])
    return 0


def _promotion_commands(sub, show_move: Callable) -> None:
    """Moving results/current by hand, recorded in results/nightly/state.json."""
    for name, fn, text in (
        (
            "promote",
            functools.partial(cmd_promote, show_move=show_move),
            "make a finished run the promoted model (results/current)",
        ),
        (
            "rollback",
            functools.partial(cmd_rollback, show_move=show_move),
            "return results/current to the run promoted before the current one",
        ),
    ):
        p = sub.add_parser(name, help=text, description=text + "; takes the nightly lock")
        if name == "promote":
            p.add_argument("run", help="the run's name (a folder under --results)")
        p.add_argument("--why", default="(no reason given)", help="why, recorded in the nightly state")
        p.add_argument("--results", default="results", help="the folder holding the runs")
        p.set_defaults(fn=fn)


def register(sub, add, gate_blocks: Callable, show_move: Callable) -> dict:
    """Add the nightly commands through llmft.core.cli.adder's `add` (and `sub` for promote and
    rollback, which take no config). Given by llmft.__main__ (a stage imports no other stage):
    `gate_blocks`, the preference stage's scoring of a preference metric's two sides
    (llmft.preference.page.gate_blocks); `show_move`, what a promote or rollback tells the runs'
    pages (llmft.report.promotion.show_move). Nothing to hide from their imports."""
    _gate_command(add, gate_blocks)
    p = add(
        "nightly",
        cmd_nightly,
        "run?=the run's name (default: today's date)",
        help="one scheduled retrain (lock, skip, gate, retention)",
        config=False,
    )
    p.add_argument(
        "--config",
        default=WORKFLOW_CONFIG,
        help="a config file merged over config/config.yaml (passed to snakemake as --configfile)",
    )
    p.add_argument("--profile", default="profiles/slurm", help="the Snakemake profile to run with")
    p.add_argument("--results", default="results", help="the folder holding the runs")
    p.add_argument("snakemake_args", nargs=argparse.REMAINDER, help="after --: extra snakemake arguments")
    _promotion_commands(sub, show_move)
    p = add("nightly-schedule", cmd_nightly_schedule, help="print the scrontab / crontab entry", config=False)
    p.add_argument(
        "--config",
        default=WORKFLOW_CONFIG,
        help="the config file the scheduled nights run (as `llmft nightly --config`)",
    )
    p.add_argument("--profile", default="profiles/slurm", help="the Snakemake profile the entry runs with")
    return {}
