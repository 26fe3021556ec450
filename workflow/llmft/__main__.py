"""`python -m llmft <stage> ...`: every stage can be rerun by hand on a node, outside Snakemake.

Each stage takes the config file (validated first) and explicit paths; a bad config is one named
error, exit 2. `check-config` takes Snakemake's own config arguments and prints what they run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from llmft.core.cli import (
    VERIFY_HELP,
    YAML_HELP,
    add_max_rows,
    adder,
    config_of,
    read_sources,
    settings_of,
    template_for,
)
from llmft.core.config import BUILTIN_DATA, WORKFLOW_CONFIG, ConfigError, effective_config
from llmft.core.imports import UNUSED, UNUSED_BY_INFERENCE, hidden
from llmft.core.objective import StageTraining, sft_objective
from llmft.core.settings import Config, replace
from llmft.preference import cli as preference_cli

# The training stages render-sft and plan take (--stage): sft's own config and objective, and each
# other stage's view and objective from its package (a stage's config key is its name).
TRAINING = {"sft": lambda cfg, ref_model=None: StageTraining(cfg, sft_objective), **preference_cli.TRAINING}


def _training(cfg: Config, stage: str, ref_model: str | None = None) -> StageTraining:
    """The config the planner and renderer see, with the stage's objective: sft's, or another stage's."""
    return TRAINING[stage](cfg, ref_model)


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


def cmd_base_model(args) -> int:
    from llmft.core.assets import build_tiny_model

    tiny = settings_of(args).model.tiny
    info = build_tiny_model(args.out, tiny.hidden_size, tiny.num_layers, tiny.num_heads, tiny.vocab_size)
    print(json.dumps(info))
    return 0


def cmd_synthetic(args) -> int:
    from llmft.core.assets import write_synthetic

    n = write_synthetic(args.out, settings_of(args).data.synthetic_rows)
    print(f"wrote {n} synthetic rows to {args.out}")
    return 0


def cmd_prepare_data(args) -> int:
    from llmft.data.prepare import prepare

    settings = settings_of(args)
    d = settings.data
    sources = read_sources(d.sources, "data.sources", {BUILTIN_DATA: args.synthetic})
    template = template_for(settings.model, args.tokenizer)
    prepare(
        sources,
        args.out_dir,
        args.tokenizer,
        template,
        d.cutoff_len,
        d.heldout_fraction,
        d.split_salt,
        d.invalid_rows,
        dedup=dataclasses.asdict(d.dedup),
        clean_text=d.clean_text,
        tokenizer_check=d.tokenizer_check,
        max_row_bytes=d.max_row_bytes,
        workers=int(args.workers or 0),
        max_dropped=d.max_dropped_fraction,
        parent=_continue_parent(settings),
    )
    return 0


def _continue_parent(cfg: Config) -> dict | None:
    """model.continue_from as prepare-data selects rows by it (data.delta.select), or None."""
    from llmft.core.lineage import parent_of
    from llmft.data.delta import parent_keys

    parent = parent_of(cfg)
    if parent is None:
        return None
    return {
        "run": parent.name,
        "keys": parent_keys(parent),
        "fraction": cfg.nightly.replay_fraction,
        "salt": f"{cfg.data.split_salt}:replay:{parent.name}",
    }


def cmd_pack_data(args) -> int:
    """Pack prepare_data's tokenized rows as LLaMA-Factory would for a rendered llamafactory.yaml."""
    import yaml
    from llmft.sft.packing import ensure_packed, pack, prune

    if bool(args.yaml) == bool(args.args_json):
        print("llmft pack-data: give either --yaml or --args-json", file=sys.stderr)
        return 2
    if args.yaml:
        if not args.stamp_out:
            print("llmft pack-data: --yaml needs --stamp-out", file=sys.stderr)
            return 2
        record = ensure_packed(
            yaml.safe_load(open(args.yaml, encoding="utf-8")), args.data_dir, args.tokenizer, args.stamp_out
        )
        print(json.dumps(record))
        out = record.get("path")
    else:
        if not args.out:
            print("llmft pack-data: --args-json needs --out", file=sys.stderr)
            return 2
        counts = pack(
            f"{args.data_dir}/tokenized", args.data_dir, args.out, args.tokenizer, json.loads(args.args_json)
        )
        print(json.dumps(counts))
        out = args.out
    if args.prune and out:
        for name in prune(out):
            print(f"removed {args.data_dir}/{name}: packed for other arguments")
    return 0


def cmd_verify_env(args) -> int:
    from llmft.env.verify import run_verify

    return run_verify(settings_of(args), args.out)


def cmd_lineage(args) -> int:
    """The run's lineage.json: where it starts, its data delta, the tokens the plan for the nodes'
    facts trains against a full retrain, the stack it trains on."""
    from llmft.core import lineage_record
    from llmft.core.platform import read_platform
    from llmft.sft.render import planned_steps

    cfg = settings_of(args)
    steps = planned_steps(cfg, args.base_model, read_platform(cfg, args.verify))
    lineage_record.make(cfg, args.base_model, args.data_dir, args.verify, steps, args.out)
    return 0


def cmd_render_sft(args) -> int:
    """Plan from the facts verify_env measured on the nodes, then render the YAML and DeepSpeed JSON."""
    from llmft.core.io import write_json
    from llmft.core.platform import read_platform
    from llmft.sft.render import render

    raw = config_of(args)
    cfg = Config.from_dict(raw)
    platform = read_platform(cfg, args.verify)
    staged = _training(cfg, args.stage, args.ref_model or None)
    render(
        staged.cfg,
        args.base_model,
        args.data_dir,
        args.out_yaml,
        args.out_deepspeed,
        args.work_root,
        platform,
        objective_for=staged.objective_for,
        check_data=staged.check_data,
        lineage_json=args.lineage or None,
    )
    if args.out_config:
        # The config sft's three steps read (`--config`): the slice this render was made from.
        write_json(args.out_config, json.loads(args.config_json) if args.config_json else raw)
    return 0


def cmd_plan(args) -> int:
    """Print what `sft` would run with and the memory it needs; exit 2 if it cannot fit.

    With --facts (a verify.json) the plan is the one render_sft_config makes for those nodes;
    without, it is made from what the config declares (hardware.gpu_model, hardware.vendor).
    """
    from llmft.core.platform import Platform, read_platform
    from llmft.sft.plan import describe, resolve
    from llmft.sft.render import config_shape

    settings = settings_of(args)
    staged = _training(settings, args.stage)
    cfg = staged.cfg
    platform = read_platform(settings, args.facts) if args.facts else Platform.declared(settings)
    model = args.model or cfg.model.name_or_path
    plan = resolve(cfg, model, platform, config_shape(cfg, model), staged.objective_for(platform))
    if args.json:
        print(json.dumps({**plan.to_json(), "platform": platform.to_json()}, indent=2))
    else:
        print(f"platform: {platform.describe()}\n  ({platform.source})\n{describe(plan)}")
    return 0


def cmd_sft_check(args) -> int:
    """Before any node starts: the verify_env gate, and the packed data the YAML names."""
    from llmft.env.verify import gate
    from llmft.sft.render import check_packed_yaml

    gate(settings_of(args).verify, args.verify)
    check_packed_yaml(args.yaml)
    return 0


def cmd_sft_launch(args) -> int:
    """This node's torchrun (once per node, under srun on several)."""
    from llmft.sft.run import launch

    rc = launch(settings_of(args), args.yaml, worker="llmft.worker")
    if rc:
        print(f"[llmft] training failed with exit code {rc}", file=sys.stderr)
    return rc


def cmd_sft_finalize(args) -> int:
    """After every node's launcher: publish the model (and LoRA's adapter) and the summary."""
    from llmft.sft.publish import finalize

    config_of(args)  # the rule passes the config its steps share: a bad one stops here, named, not later
    finalize(args.yaml, args.model_out, args.summary_out)
    return 0


def cmd_evaluate(args) -> int:
    from llmft.evaluate.run import evaluate

    evaluate(
        settings_of(args),
        args.model,
        args.heldout,
        args.out_dir,
        label=args.label,
        processes=args.processes,
        threads=args.threads,
        max_rows=args.max_rows,
    )
    return 0


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


def cmd_report(args) -> int:
    from llmft.report.page import build_report

    raw = config_of(args)
    build_report(
        Config.from_dict(raw),
        args.run_dir,
        args.out_dir,
        args.results_dir,
        stage_pages=preference_cli.pages(),
        validated=raw,
    )
    return 0


def cmd_gate(args) -> int:
    """The nightly gate's verdict (llmft.nightly.gate); a preference metric's sides are scored by the
    preference stage, given to the gate here (a stage imports no other stage)."""
    from pathlib import Path

    from llmft.nightly.gate import write_gate
    from llmft.preference.page import gate_blocks

    verdict = write_gate(settings_of(args), Path(args.run_dir), Path(args.out), gate_blocks)
    print(json.dumps({k: verdict[k] for k in ("run", "metric", "status", "reason")}))
    return 0


def _gate_command(add) -> None:
    add(
        "gate",
        cmd_gate,
        "run-dir=the run's folder (results/<run>), whose gate evaluations are scored",
        "out=the gate.json to write (results/<run>/nightly/gate.json)",
        help="the nightly gate: this run's model against the promoted one (nightly.compare_with)",
    )


def cmd_trend(args) -> int:
    from llmft.report.trend import build_trend

    runs = build_trend(args.results_dir, args.out)
    print(f"trend of {len(runs)} run(s) written to {args.out}")
    return 0


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


def cmd_promote(args) -> int:
    from pathlib import Path

    from llmft.nightly.promote import promote_command
    from llmft.report.promotion import show_move

    return _move_current(lambda: promote_command(Path(args.results), args.run, args.why, show_move))


def cmd_rollback(args) -> int:
    from pathlib import Path

    from llmft.nightly.promote import rollback_command
    from llmft.report.promotion import show_move

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


def _data_commands(add) -> None:
    """Stage 2 and the demo's inputs."""
    add(
        "base-model",
        cmd_base_model,
        "out=the model folder to write",
        help="build the tiny random-init model offline",
    )
    add("synthetic", cmd_synthetic, "out=the JSONL file to write", help="write the synthetic demo dataset")
    p = add(
        "prepare-data",
        cmd_prepare_data,
        "tokenizer=the model folder whose tokenizer tokenizes the rows",
        "out-dir=the folder for train/heldout rows, tokenized rows and stats.json",
        "synthetic?=the synthetic dataset the builtin:synthetic sources read",
        help="check, dedup, split and tokenize the data sources",
    )
    p.add_argument("--workers", default="0", help="tokenizing processes (0 = one per core)")
    p = add(
        "pack-data",
        cmd_pack_data,
        f"yaml?={YAML_HELP}: pack for its arguments (with --stamp-out)",
        "args-json?=LLaMA-Factory's packing arguments as JSON (with --out)",
        "tokenizer=the model folder whose tokenizer tokenized the rows",
        "data-dir=prepare-data's output folder",
        "out?=the packed folder to write (with --args-json)",
        "stamp-out?=the JSON record of what was packed where (with --yaml)",
        help="pack tokenized rows exactly as LLaMA-Factory packs them for this YAML (packing/neat_packing)",
        config=False,
    )
    p.add_argument(
        "--prune", action="store_true", help="remove packed folders for other arguments beside --out"
    )


def _stage_option(p) -> None:
    p.add_argument(
        "--stage",
        choices=tuple(TRAINING),
        default="sft",
        help="the training stage: sft, or the preference stage (the config's preference section)",
    )


def _sft_commands(sub, add) -> None:
    """Stage 3: the lineage, render, plan, and sft's three steps."""
    add(
        "lineage",
        cmd_lineage,
        "base-model=the base model folder",
        f"verify={VERIFY_HELP}: the tokens are counted for the plan made for them",
        "data-dir=prepare-data's output folder",
        "out=the lineage.json to write",
        help="record where the run starts, its data delta, its tokens against a full retrain, its stack",
    )
    p = add(
        "render-sft",
        cmd_render_sft,
        "base-model=the base model folder",
        f"verify={VERIFY_HELP}: the plan is made for them",
        "data-dir=prepare-data's output folder",
        "out-yaml=the llamafactory.yaml to write",
        "out-deepspeed=the DeepSpeed JSON to write",
        "work-root=the folder for checkpoints and the trainer's work",
        "out-config?=the config.json to write for sft's three steps",
        "ref-model?=the preference stage's reference model when it is not the model it starts from",
        "lineage?=the run's lineage.json (python -m llmft lineage): where training starts, what it costs",
        help="plan from the nodes' facts and render the LLaMA-Factory YAML and DeepSpeed JSON",
    )
    _stage_option(p)
    p = add(
        "plan",
        cmd_plan,
        "model?=a model folder (default: model.name_or_path; builtin:tiny is model.tiny's shape)",
        f"facts?={VERIFY_HELP}: plan for those nodes, not for what the config declares",
        help="per-GPU memory plan for the sft config; refuse if it cannot fit",
    )
    p.add_argument("--json", action="store_true", help="the whole plan as JSON")
    _stage_option(p)
    steps = sub.add_parser(
        "sft", help="check, launch on every node, finalize: sft or the preference stage, as the YAML says"
    ).add_subparsers(dest="step", required=True)
    add(
        "check",
        cmd_sft_check,
        f"yaml={YAML_HELP}",
        f"verify={VERIFY_HELP}",
        help="the verify_env gate",
        parent=steps,
    )
    add("launch", cmd_sft_launch, f"yaml={YAML_HELP}", help="one node's launcher (under srun)", parent=steps)
    add(
        "finalize",
        cmd_sft_finalize,
        f"yaml={YAML_HELP}",
        "model-out=the folder to publish the trained model to",
        "summary-out=the train_summary.json to write",
        help="publish the trained model (and LoRA's adapter) and train_summary.json",
        parent=steps,
    )


def _later_commands(sub, add) -> None:
    """Stages 1, 4, 5 and nightly retrains."""
    add(
        "verify-env",
        cmd_verify_env,
        "out=the verify.json to write",
        help="check this node's environment (stage 1)",
    )
    p = add(
        "evaluate",
        cmd_evaluate,
        "model=the model folder to score",
        "heldout=the held-out rows (JSONL)",
        "out-dir=the folder for metrics.json and predictions.jsonl",
        "label=base or tuned",
        help="score a model on the held-out split",
    )
    p.add_argument("--processes", type=int, default=0, help="0 = one per GPU (one on CPU)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per process (0 = torch default)")
    add_max_rows(p)
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
    add(
        "report",
        cmd_report,
        "run-dir=the run's folder (results/<run>)",
        "out-dir=the folder for index.html, summary.json and figures",
        "results-dir?=the folder of every run, for the trend page beside the report",
        help="write the run's HTML report",
    )
    p = sub.add_parser("trend", help="held-out metrics and throughput of every run under --results-dir")
    p.add_argument("--results-dir", default="results", help="the folder holding one folder per run")
    p.add_argument("--out", default="results/trend.html", help="the HTML page to write")
    p.set_defaults(fn=cmd_trend)

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
    _promotion_commands(sub)
    p = add("nightly-schedule", cmd_nightly_schedule, help="print the scrontab / crontab entry", config=False)
    p.add_argument(
        "--config",
        default=WORKFLOW_CONFIG,
        help="the config file the scheduled nights run (as `llmft nightly --config`)",
    )
    p.add_argument("--profile", default="profiles/slurm", help="the Snakemake profile the entry runs with")


def _promotion_commands(sub) -> None:
    """Moving results/current by hand, recorded in results/nightly/state.json."""
    for name, fn, text in (
        ("promote", cmd_promote, "make a finished run the promoted model (results/current)"),
        ("rollback", cmd_rollback, "return results/current to the run promoted before the current one"),
    ):
        p = sub.add_parser(name, help=text, description=text + "; takes the nightly lock")
        if fn is cmd_promote:
            p.add_argument("run", help="the run's name (a folder under --results)")
        p.add_argument("--why", default="(no reason given)", help="why, recorded in the nightly state")
        p.add_argument("--results", default="results", help="the folder holding the runs")
        p.set_defaults(fn=fn)


def _evaluation() -> tuple:
    """evaluate's loss pass and generation, which the preference stage's evaluation runs (given to it
    here: a stage imports no other stage)."""
    from llmft.evaluate.run import answer_nll, evaluate

    return answer_nll, evaluate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmft", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    add = adder(sub)
    _check_config_command(sub)
    _data_commands(add)
    _sft_commands(sub, add)
    _later_commands(sub, add)
    _gate_command(add)
    HIDDEN.update(preference_cli.register(add, _evaluation))
    return parser


# Stages that load models or LLaMA-Factory's data code, and the installed packages those libraries
# would import for nothing there (llmft.core.imports): 1-4 s less start-up each.
HIDDEN = {
    cmd_base_model: UNUSED_BY_INFERENCE + ("deepspeed",),
    cmd_prepare_data: UNUSED + ("torchao",),
    cmd_sft_finalize: UNUSED + ("torchao",),  # LoRA's merge loads LLaMA-Factory's export
    cmd_evaluate: UNUSED_BY_INFERENCE,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    try:
        with hidden(*HIDDEN.get(args.fn, ())):
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
