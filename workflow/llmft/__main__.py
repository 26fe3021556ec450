"""`python -m llmft <command> ...`: every stage can be rerun by hand on a node, outside Snakemake.

Each stage registers its own commands (llmft.<stage>.cli.register); this module collects them, hands
a stage what it takes from another (a stage imports no other stage), and runs the one asked for. Each
command takes the config file (validated first) and explicit paths; a bad config is one named error,
exit 2. `check-config`, the workflow's own check, takes Snakemake's config arguments and prints what
they run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from llmft.benchmarks import cli as benchmarks_cli
from llmft.core.cli import adder
from llmft.core.config import ConfigError, effective_config
from llmft.core.imports import hidden
from llmft.core.objective import StageTraining, sft_objective
from llmft.core.settings import Config, replace
from llmft.data import cli as data_cli
from llmft.env import cli as env_cli
from llmft.evaluate import cli as evaluate_cli
from llmft.nightly import cli as nightly_cli
from llmft.preference import cli as preference_cli
from llmft.report import cli as report_cli
from llmft.sft import cli as sft_cli

# The training stages render-sft and plan take (--stage): sft's own config and objective, and each
# other stage's view and objective from its package (a stage's config key is its name).
TRAINING = {"sft": lambda cfg, ref_model=None: StageTraining(cfg, sft_objective), **preference_cli.TRAINING}


def cmd_check_config(args) -> int:
    """Print the config `snakemake --configfile ... --config ...` would run, merged as Snakemake does,
    after the checks the workflow makes when it builds the DAG, with the template it resolves."""
    from llmft.core.lf.chat_templates import for_workflow as template_for_workflow
    from llmft.core.lineage import resolve as resolve_parent
    from llmft.sft.render import precheck

    cfg, sources = effective_config(args.configfile, args.config, args.directory)
    settings = Config.from_dict(cfg)
    precheck(settings)
    for stage, training in TRAINING.items():
        if stage != "sft" and getattr(settings, stage) is not None:
            staged = training(settings)
            precheck(staged.cfg, staged.objective_for)
    template, _ = template_for_workflow(settings.model, args.directory)
    # model.continue_from: checked, a link resolved to its run
    resolved, _ = resolve_parent(replace(settings, "model.template", template), args.directory)
    # printed as merged (the keys in the order the files gave them), with what the workflow resolves
    cfg["model"].update(template=template, continue_from=resolved.model.continue_from)
    print(f"llmft: {', then '.join(sources)}; the schema's defaults for the rest", file=sys.stderr)
    print(json.dumps(cfg, indent=2))
    return 0


def _check_config_command(sub) -> None:
    """Not a stage: the effective config, taking Snakemake's own config arguments."""
    p = sub.add_parser(
        "check-config",
        help="validate and print the config a snakemake call with the same arguments runs",
        description="Validate and print the config `snakemake --configfile ... --config ...` runs: "
        "config/config.yaml, then each --configfile in order, then --config key=value, each merged "
        "over the last; the schema's defaults for the rest. Checked as the workflow checks it before "
        "any job, with model.template auto resolved.",
    )
    p.add_argument(
        "--configfile", nargs="+", action="extend", default=[], metavar="FILE",
        help="config files merged over config/config.yaml, in order (as snakemake --configfile)",
    )  # fmt: skip
    p.add_argument(
        "--config", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
        help="values merged over the files, read as snakemake --config reads them",
    )  # fmt: skip
    p.add_argument("-d", "--directory", default=".", help="the working directory (as snakemake -d)")
    p.set_defaults(fn=cmd_check_config)


# What one stage's commands take from another's package, imported when the command runs.
def _verify_gate(verify, report_path) -> None:
    from llmft.env.verify import gate

    gate(verify, report_path)


def _gate_blocks(*args, **kwargs):
    from llmft.preference.page import gate_blocks

    return gate_blocks(*args, **kwargs)


def _show_move(*args, **kwargs):
    from llmft.report.promotion import show_move

    return show_move(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmft", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    add = adder(sub)
    _check_config_command(sub)
    HIDDEN.update(data_cli.register(add))
    HIDDEN.update(sft_cli.register(sub, add, TRAINING, _verify_gate))
    HIDDEN.update(env_cli.register(add))
    HIDDEN.update(evaluate_cli.register(add))
    HIDDEN.update(benchmarks_cli.register(add))
    HIDDEN.update(report_cli.register(sub, add, preference_cli.pages))
    HIDDEN.update(nightly_cli.register(sub, add, _gate_blocks, _show_move))
    HIDDEN.update(preference_cli.register(add, evaluate_cli.evaluation))
    return parser


# The commands that load models or LLaMA-Factory's data code, and the installed packages those
# libraries would import for nothing there (llmft.core.imports): 1-4 s less start-up each. Each
# stage's register returns its own.
HIDDEN: dict = {}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    try:
        with hidden(*HIDDEN.get(getattr(args.fn, "func", args.fn), ())):
            return args.fn(args)
    except ConfigError as exc:
        print(f"llmft: config error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        from llmft.core.sources import DataError

        if not isinstance(exc, DataError):
            raise
        print(f"llmft: data error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        from llmft.core.modelfiles import StructureError

        if not isinstance(exc, StructureError):
            raise
        print(f"llmft: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
