"""The training stage's CLI commands (lineage, render-sft, plan, pack-data, sft check / launch /
finalize), which llmft.__main__ collects. render-sft and plan serve every training stage (--stage):
sft's own objective, or another stage's view and objective, given by llmft.__main__."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable

from llmft.core.cli import VERIFY_HELP, YAML_HELP, config_of, settings_of
from llmft.core.imports import UNUSED
from llmft.core.objective import StageTraining
from llmft.core.settings import Config

# A training stage: its config view and objective for the planner and renderer, from the run's config
# (and the reference model's folder where it is not the model the stage starts from).
Training = Callable[..., StageTraining]


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


def cmd_render_sft(args, training: dict[str, Training]) -> int:
    """Plan from the facts verify_env measured on the nodes, then render the YAML and DeepSpeed JSON."""
    from llmft.core.io import write_json
    from llmft.core.platform import read_platform
    from llmft.sft.render import render

    raw = config_of(args)
    cfg = Config.from_dict(raw)
    platform = read_platform(cfg, args.verify)
    staged = training[args.stage](cfg, args.ref_model or None)
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


def cmd_plan(args, training: dict[str, Training]) -> int:
    """Print what `sft` would run with and the memory it needs; exit 2 if it cannot fit.

    With --facts (a verify.json) the plan is the one render_sft_config makes for those nodes;
    without, it is made from what the config declares (hardware.gpu_model, hardware.vendor).
    """
    from llmft.core.platform import Platform, read_platform
    from llmft.sft.plan import describe, resolve
    from llmft.sft.render import config_shape

    settings = settings_of(args)
    staged = training[args.stage](settings)
    cfg = staged.cfg
    platform = read_platform(settings, args.facts) if args.facts else Platform.declared(settings)
    model = args.model or cfg.model.name_or_path
    plan = resolve(cfg, model, platform, config_shape(cfg, model), staged.objective_for(platform))
    if args.json:
        print(json.dumps({**plan.to_json(), "platform": platform.to_json()}, indent=2))
    else:
        print(f"platform: {platform.describe()}\n  ({platform.source})\n{describe(plan)}")
    return 0


def cmd_sft_check(args, verify_gate: Callable) -> int:
    """Before any node starts: the verify_env gate, and the packed data the YAML names."""
    from llmft.sft.render import check_packed_yaml

    verify_gate(settings_of(args).verify, args.verify)
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


def _stage_option(p, training: dict) -> None:
    p.add_argument(
        "--stage",
        choices=tuple(training),
        default="sft",
        help="the training stage: sft, or the preference stage (the config's preference section)",
    )


def register(sub, add, training: dict[str, Training], verify_gate: Callable) -> dict:
    """Add the training stage's commands through llmft.core.cli.adder's `add` (and `sub` for the
    sft group): `training`, the stages render-sft and plan take (--stage); `verify_gate`, verify_env's
    gate (llmft.env.verify.gate) that `sft check` applies. Return the packages each command's libraries
    would import for nothing there (llmft.core.imports.hidden)."""
    render_sft = functools.partial(cmd_render_sft, training=training)
    plan = functools.partial(cmd_plan, training=training)
    sft_check = functools.partial(cmd_sft_check, verify_gate=verify_gate)
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
        render_sft,
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
    _stage_option(p, training)
    p = add(
        "plan",
        plan,
        "model?=a model folder (default: model.name_or_path; builtin:tiny is model.tiny's shape)",
        f"facts?={VERIFY_HELP}: plan for those nodes, not for what the config declares",
        help="per-GPU memory plan for the sft config; refuse if it cannot fit",
    )
    p.add_argument("--json", action="store_true", help="the whole plan as JSON")
    _stage_option(p, training)
    steps = sub.add_parser(
        "sft", help="check, launch on every node, finalize: sft or the preference stage, as the YAML says"
    ).add_subparsers(dest="step", required=True)
    add(
        "check",
        sft_check,
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
    return {cmd_sft_finalize: UNUSED + ("torchao",)}  # LoRA's merge loads LLaMA-Factory's export
