"""sft, part one: the plan for the nodes that train, rendered as LLaMA-Factory's YAML and DeepSpeed's JSON."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shlex
from collections.abc import Callable
from pathlib import Path

import yaml
from llmft.core import fp8, lineage, lineage_record, schedule
from llmft.core.config import BUILTIN_MODEL, ConfigError
from llmft.core.io import read_json, read_optional, write_json, write_text
from llmft.core.lf import pretokenize
from llmft.core.lf.chat_templates import for_model as template_for_model
from llmft.core.objective import Objective, sft_objective
from llmft.core.platform import Platform
from llmft.core.settings import Config, Sft, TinyModel
from llmft.core.shape import ModelShape, model_shape
from llmft.sft import tracking
from llmft.sft.packing import STAMP_FILE, packed_dir_name, packing_args, source_fingerprint
from llmft.sft.plan import Plan, describe, resolve

log = logging.getLogger("llmft.sft")


# Below this learning rate a LoRA run barely moves its adapters: the render log says so.
LORA_LOW_LR = 5e-5


def deepspeed_config(plan: Plan, platform: Platform) -> dict | None:
    """DeepSpeed JSON; batch size, LR and precision stay "auto" so the LLaMA-Factory YAML owns them."""
    stage = plan.zero_stage
    if stage == 0:
        return None
    gpu = platform.on_gpu
    buckets = plan.buckets
    zero: dict = {
        "stage": stage,
        # overlap needs a side stream: only on GPUs.
        "overlap_comm": gpu,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": buckets["reduce"],
    }
    if stage in (1, 2):
        zero["allgather_partitions"] = True
        if buckets["gather"] != "auto":  # transformers fills no "auto" here: DeepSpeed's default then
            zero["allgather_bucket_size"] = buckets["gather"]
    if stage == 3:
        zero.update(
            {
                "sub_group_size": 1e9,
                "stage3_prefetch_bucket_size": buckets["gather"],
                "stage3_param_persistence_threshold": buckets["persistence"],
                "stage3_max_live_parameters": 1e9,
                "stage3_max_reuse_distance": 1e9,
                # Save a loadable 16-bit model, not only sharded ZeRO checkpoints.
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
        if plan.offload:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
        # No overflow pass in bf16 (it has fp32's range): DeepSpeed's check reads every gradient
        # and waits on an all-reduce each step. A NaN/inf loss or grad norm stops the job through
        # llmft's divergence guard instead, which sees every step a checkpoint holds.
        "bf16": {"enabled": "auto", "check_grad_overflow": False},
        "zero_optimization": zero,
    }


def llamafactory_args(
    cfg: Config,
    base_model: str,
    data_dir: str,
    deepspeed_path: str | None,
    work_root: str,
    plan: Plan,
    platform: Platform,
) -> dict:
    """The LLaMA-Factory training arguments; `sft.extra` wins over our defaults. The plan's objective
    (sft's, or another stage's: llmft.core.objective) adds its own stage, datasets and loss arguments."""
    sft = cfg.sft
    objective = plan.objective
    args = _default_args(cfg, base_model, data_dir, plan, platform)
    args.update(_packing_and_kernel_args(plan))
    args.update(_precision_args(sft.precision, platform.vendor))
    args.update(sft.finetuning_args)
    args.update(_distributed_args(deepspeed_path, platform))
    args.update(objective.trainer_args)
    args.update(sft.extra)
    tokenized = _tokenized_path(args, data_dir) if objective.packs_rows else _row_tokenized(data_dir)
    if tokenized is not None:
        args["tokenized_path"] = tokenized
    digest = hashlib.sha256(json.dumps(args, sort_keys=True, default=str).encode()).hexdigest()
    args["output_dir"] = f"{work_root}/{objective.name}-{digest[:12]}"
    return args


def _row_tokenized(data_dir: str) -> str | None:
    """The rows the data stage tokenized as LLaMA-Factory's preprocessing saves them (never packed),
    when it did; else LLaMA-Factory tokenizes them in the job."""
    path = Path(data_dir) / pretokenize.TOKENIZED_DIR
    return str(path) if path.is_dir() else None


def _default_args(cfg: Config, base_model: str, data_dir: str, plan: Plan, platform: Platform) -> dict:
    """The arguments every run sets, from the config and the plan (before `sft.extra`)."""
    sft = cfg.sft
    vendor = platform.vendor
    return {
        # model.continue_from: the parent's model, or the base and the parent's adapter (LoRA)
        **lineage.start_args(cfg, base_model),
        "trust_remote_code": False,
        "stage": "sft",
        "do_train": True,
        "finetuning_type": sft.finetuning_type,
        "dataset": plan.objective.datasets[0],
        "eval_dataset": plan.objective.datasets[1],
        "dataset_dir": data_dir,
        # Snakemake passes the name it resolved; `auto` here only in a hand-made config.
        "template": template_for_model(cfg.model, base_model)[0],
        "cutoff_len": cfg.data.cutoff_len,
        "preprocessing_num_workers": 1 if vendor == "cpu" else 8,
        "dataloader_num_workers": 0 if vendor == "cpu" else 4,
        "logging_steps": sft.logging_steps,
        # NaN/inf losses must reach the divergence guard, not be averaged away.
        "logging_nan_inf_filter": False,
        "save_steps": sft.save_steps,
        "save_total_limit": 2,
        "plot_loss": False,
        # false: a requeued job resumes from the last checkpoint (true deletes it and the log).
        "overwrite_output_dir": False,
        "report_to": tracking.report_to(sft.tracking),
        "run_name": cfg.run,
        "per_device_train_batch_size": plan.micro_batch,
        "gradient_accumulation_steps": plan.gradient_accumulation,
        # a continued run: a fresh schedule (warmup and decay again) at its own rate, a new optimizer
        "learning_rate": lineage.continue_learning_rate(cfg) if cfg.model.continues else sft.learning_rate,
        "num_train_epochs": lineage.run_epochs(cfg),
        "max_steps": sft.max_steps,
        "lr_scheduler_type": sft.lr_scheduler_type,
        "warmup_ratio": sft.warmup_ratio,
        "weight_decay": sft.weight_decay,
        "max_grad_norm": sft.max_grad_norm,
        "seed": sft.seed,
        "ddp_timeout": max(1, round(sft.collective_timeout_minutes * 60)),
        # varlen is ours (llmft.sft.train switches the model to it); LLaMA-Factory loads SDPA.
        "flash_attn": "sdpa" if plan.attention == "varlen" else plan.attention,
        "disable_gradient_checkpointing": not plan.gradient_checkpointing,
        "per_device_eval_batch_size": plan.micro_batch,
        "eval_strategy": "steps",
        # LLaMA-Factory's own neat packing: its mask holds sample indices, not 0/1, so count all
        # tokens (~1 % padding). llmft.core.varlen's rows carry a 0/1 mask of their real tokens.
        "include_num_input_tokens_seen": "all"
        if plan.packing == "neat" and plan.attention != "varlen"
        else "non_padding",
        "eval_steps": sft.logging_steps * 5,
    }


def _packing_and_kernel_args(plan: Plan) -> dict:
    """Which packing LLaMA-Factory does and whether it loads Liger's kernels, as the plan decided."""
    args: dict = {}
    if plan.packing == "neat":
        args["neat_packing"] = True
    elif plan.packing == "plain":
        args["packing"] = True
    if plan.liger and not plan.compile:
        # With compiled layers llmft.sft.train applies Liger's fused loss alone (its other kernels do
        # not compile under dynamo; the compiler fuses those operations itself).
        args["enable_liger_kernel"] = True
    return args


def _precision_args(precision: str, vendor: str) -> dict:
    """LLaMA-Factory's precision flags for sft.precision on this vendor."""
    args: dict = {}
    if precision == "bf16":
        args["bf16"] = True
    elif precision == "fp16":
        args["fp16"] = True
    if vendor == "cpu" and precision != "fp32":
        args["use_cpu"] = True  # transformers refuses half precision on CPU without it
    return args


def _distributed_args(deepspeed_path: str | None, platform: Platform) -> dict:
    """DeepSpeed's config under ZeRO; else, on several processes, DDP without its unused-parameter search."""
    if deepspeed_path:
        return {"deepspeed": deepspeed_path}
    if platform.world_size > 1:
        # LLaMA-Factory's DDP default (True) costs an extra pass each step.
        return {"ddp_find_unused_parameters": False}
    return {}


def _tokenized_path(args: dict, data_dir: str) -> str | None:
    """Where LLaMA-Factory loads prepared rows from, or None when it must tokenize them itself."""
    # prepare_data tokenized the rows once, exactly as LLaMA-Factory would: load them instead of
    # tokenizing on the GPU nodes, unless an argument changes what its preprocessing makes. A run
    # that packs loads the rows pack_data packed from them on the CPU side, as LLaMA-Factory would.
    blocking = pretokenize.blockers(args)
    packed = packing_args(args)
    if packed is not None and not set(blocking) - {"packing", "neat_packing"}:
        return f"{data_dir}/{packed_dir_name(packed)}"
    if blocking:
        log.info("not using the pre-tokenized data: %s change LLaMA-Factory's preprocessing", blocking)
        return None
    return f"{data_dir}/{pretokenize.TOKENIZED_DIR}"


def check_finetuning(sft: Sft, shape: ModelShape) -> None:
    """What the model's shape decides: freeze cannot train more layers than there are (LLaMA-Factory
    would silently train them all)."""
    n = sft.freeze_trainable_layers
    if sft.finetuning_type == "freeze" and abs(n) > shape.layers:
        raise ConfigError(
            f"config key sft.freeze_trainable_layers: {n} but the model has {shape.layers} decoder layers; "
            f"choose at most {shape.layers} (or finetuning_type: full to train every layer)"
        )


def tiny_shape(tiny: TinyModel) -> ModelShape:
    """The shape of builtin:tiny (assets.build_tiny_model) before it is built."""
    hidden, layers, heads, vocab = tiny.hidden_size, tiny.num_layers, tiny.num_heads, tiny.vocab_size
    shape = ModelShape("llama", hidden, layers, heads, heads, hidden // heads, 4 * hidden, vocab, True, 0)
    return dataclasses.replace(shape, params=layers * shape.layer_params + vocab * hidden + hidden)


def config_shape(cfg: Config, name: str) -> ModelShape:
    """The shape of model `name`: a folder's config.json, or for builtin:tiny, which a rule builds
    later, model.tiny's."""
    return tiny_shape(cfg.model.tiny) if name == BUILTIN_MODEL else model_shape(name)


# A stage's objective on a platform (llmft.core.objective.StageTraining).
ObjectiveFor = Callable[[Platform], Objective]


def precheck(cfg: Config, objective_for: ObjectiveFor = sft_objective) -> Plan:
    """The plan for what the config declares (Platform.declared), made when the workflow is parsed:
    a config that could fit on no node stops before any job. The plan sft trains with is made
    later, from the nodes' facts (render). `objective_for`: the stage's objective on a platform
    (another stage's config view, e.g. llmft.preference.stage.view, with its objective)."""
    name = cfg.model.name_or_path
    shape = config_shape(cfg, name)
    check_finetuning(cfg.sft, shape)
    platform = Platform.declared(cfg)
    return resolve(cfg, name, platform, shape, objective_for(platform))


def planned_steps(cfg: Config, base_model: str, platform: Platform) -> dict:
    """lineage.training_steps of the plan render makes for sft on `platform` (what the lineage record's
    tokens are counted under)."""
    shape = model_shape(base_model)
    check_finetuning(cfg.sft, shape)
    plan = resolve(cfg, base_model, platform, shape, sft_objective(platform))
    return lineage.training_steps(cfg, plan, platform.world_size)


def continue_text(cfg: Config, record: dict) -> str:
    """The plan's lines on where training starts and, for a continued run, what it trains and costs:
    the lineage record's head, rows and tokens (llmft.core.lineage_record)."""
    if record["parent"] is None:
        return f"starts from the base model {record['base_model']}"
    delta, chain = record.get("data") or {}, lineage.chain_text(record)
    lines = [
        f"continues run {record['parent']} from {record['started_from']} (chain: {chain});"
        f" fresh schedule at learning rate {lineage.continue_learning_rate(cfg):g}, new optimizer state",
        f"rows: {delta.get('new')} new, {delta.get('replayed')} replayed, {delta.get('removed')} removed"
        f" since {record['parent']}; {delta.get('train_rows')} train rows of {delta.get('full_train_rows')}",
    ]
    cost = record.get("tokens") or {}
    line = lineage.cost_line(cost) if cost.get("steps") else ""
    if line:
        steps = cost["steps"]
        how = (f"{steps['max_steps']} steps" if steps["max_steps"] > 0 else epochs_text(steps)) + (
            ""
            if steps["packed"]
            else f", each pass's last micro-batches filled to {steps['world']} x {steps['micro_batch']} rows"
        )
        lines.append(f"{line} (tokens the trainer feeds: {how})")
    return "\n".join(lines)


def start_record(
    cfg: Config, base_model: str, data_dir: str, lineage_json: str | None, steps: dict | None
) -> dict:
    """What render says of where training starts: the run's lineage.json (`lineage_json`, checked
    against this run, its data and, where the stage's objective continues the run, the plan's
    `steps`); without one, the head of a run from its base model (another stage's render, a preview)."""
    if lineage_json is None:
        if steps is not None and cfg.model.continues:
            raise ConfigError(
                "model.continue_from: rendering a continued run needs its lineage.json (render-sft "
                "--lineage results/<run>/lineage.json, from python -m llmft lineage)"
            )
        return lineage_record.run_head(cfg, base_model)
    stats = read_optional(Path(data_dir) / "stats.json", {}) or {}
    record = lineage_record.read_for(lineage_json, cfg, stats)
    if steps is not None and (record.get("tokens") or {}).get("steps") is not None:
        lineage_record.check(lineage_json, record, steps=steps)
    return record


def epochs_text(steps: dict) -> str:
    """ "N epoch(s)", and a retrain's where nightly.continue_epochs makes them differ."""
    retrain = steps.get("retrain_epochs", steps["epochs"])
    text = f"{steps['epochs']:g} epoch(s)"
    return text if retrain == steps["epochs"] else f"{text}, a retrain {retrain:g}"


def check_packed(args: dict, data_dir: str) -> None:
    """The packed rows at tokenized_path must be pack-data's, for these arguments, from the current
    tokenized rows: refuse stale ones (the folder is named by the arguments; its stamp says what
    was packed from what)."""
    path = Path(args["tokenized_path"])
    want = packing_args(args)
    if not (path / STAMP_FILE).is_file():
        how = shlex.join(
            ["python", "-m", "llmft", "pack-data", "--args-json", json.dumps(want), "--tokenizer",
             str(args["model_name_or_path"]), "--data-dir", str(data_dir), "--out", str(path)]
        )  # fmt: skip
        if path.exists():
            log.warning("%s was not made by pack-data (LLaMA-Factory's own save?); to make it: %s", path, how)
        else:
            log.warning("%s is not packed yet: LLaMA-Factory would pack on the GPU nodes; run %s", path, how)
        return
    stamp = read_json(path / STAMP_FILE)
    if stamp["args"] != want:
        raise ConfigError(
            f"{path} was packed for {stamp['args']}, this config packs for {want}: "
            "rerun pack_data (python -m llmft pack-data)"
        )
    current = source_fingerprint(Path(data_dir) / pretokenize.TOKENIZED_DIR)
    if current and stamp.get("source") and stamp["source"] != current:
        raise ConfigError(
            f"{path} was packed from an earlier prepare_data run ({stamp['source']}, now {current}): "
            "rerun pack_data (python -m llmft pack-data)"
        )
    log.info("sft loads packed rows from %s (%s)", path, want)


def check_packed_yaml(yaml_path: str) -> None:
    """Before training: packed rows the YAML loads must be pack_data's, for these arguments."""
    args = yaml.safe_load(Path(yaml_path).read_text())
    data_dir = args.get("dataset_dir", "")
    if packs_from_pack_data(args, data_dir):
        check_packed(args, data_dir)


def packs_from_pack_data(args: dict, data_dir: str) -> dict | None:
    """The packing arguments when the YAML loads rows that pack_data packs, else None."""
    pargs = packing_args(args)
    if pargs and args.get("tokenized_path") == f"{data_dir}/{packed_dir_name(pargs)}":
        return pargs
    return None


def decay_ratio(args: dict, sft: Sft) -> float | None:
    """sft.decay_ratio where the rendered schedule is warmup_stable_decay and the config gives none
    of its phases in steps (sft.extra.lr_scheduler_kwargs); else None."""
    reads = schedule.reads_ratio(args.get("lr_scheduler_type"), args.get("lr_scheduler_kwargs"))
    return sft.decay_ratio if reads else None


def _yaml_header(platform: Platform, plan: Plan, decay: float | None, start: str) -> str:
    """The comment lines above the rendered YAML: the nodes, the plan, FP8 and the schedule's decay,
    where training starts, and the `llmft:` block's use."""
    return (
        "# Rendered by llmft from config/config.yaml: edit the config, not this file.\n"
        f"# planned for the nodes' facts, {platform.source}:\n"
        f"#   {platform.describe()}\n"
        f"# world size {platform.world_size} = {platform.nodes} node(s) x "
        f"{platform.processes_per_node} process(es)\n"
        + "".join(f"# {line}\n" for line in describe(plan).splitlines())
        + (
            f"# FP8 planned: the layers that ran in float8 are counted on the model that trains, in "
            f"{fp8.FP8_FILE} beside the checkpoints, train_summary.json and the run page\n"
            if plan.fp8
            else ""
        )
        + (
            f"# lr_scheduler_type {schedule.WSD}: its decay is the last {decay:g} of the optimizer steps "
            "(sft.decay_ratio), which llmft's launcher\n# turns into steps; plain llamafactory-cli "
            "needs lr_scheduler_kwargs.num_decay_steps instead\n"
            if decay is not None
            else ""
        )
        + "".join(f"# {line}\n" for line in start.splitlines())
        + "# The `llmft:` block is read by llmft's launcher (python -m llmft sft) and removed before\n"
        "# LLaMA-Factory parses the rest; delete it to run this file with plain llamafactory-cli.\n"
    )


def render(
    cfg: Config,
    base_model: str,
    data_dir: str,
    out_yaml: str,
    out_ds: str,
    work_root: str,
    platform: Platform,
    shape: ModelShape | None = None,
    objective_for: ObjectiveFor = sft_objective,
    check_data: Callable[[Objective, str], None] | None = None,
    lineage_json: str | None = None,
):
    """Plan for `platform`; write llamafactory.yaml (+ the launcher's `llmft:` block) and deepspeed.json.
    cfg is sft's config or another stage's view of it (llmft.preference.stage.view), trained for
    `objective_for(platform)`; `check_data(objective, data_dir)` refuses data the planned objective
    cannot train on. `lineage_json`: the run's lineage.json, which the header's lines on where
    training starts and what it costs come from (required for a continued run's sft)."""
    sft = cfg.sft
    shape = shape or model_shape(base_model)
    check_finetuning(sft, shape)
    objective = objective_for(platform)
    if objective.announce:
        log.info("%s, learning rate %g", objective.announce, sft.learning_rate)
    elif sft.finetuning_type == "lora" and sft.learning_rate < LORA_LOW_LR:
        log.warning(
            "sft.learning_rate %g is low for LoRA: the default 1e-5 is the full-SFT recipe; LoRA usually "
            "trains at about 1e-4 (LLaMA-Factory's LoRA examples)",
            sft.learning_rate,
        )
    plan = resolve(cfg, base_model, platform, shape, objective)
    if check_data is not None:
        check_data(objective, data_dir)
    log.info("platform: %s (%s)", platform.describe(), platform.source)
    log.info("%s", describe(plan))
    steps = lineage.training_steps(cfg, plan, platform.world_size) if objective.continues else None
    start = continue_text(cfg, start_record(cfg, base_model, data_dir, lineage_json, steps))
    log.info("%s", start)
    ds = deepspeed_config(plan, platform)
    write_json(out_ds, ds or {"zero_optimization": {"stage": 0}, "disabled": True})
    args = llamafactory_args(cfg, base_model, data_dir, out_ds if ds else None, work_root, plan, platform)
    args["llmft"] = {
        "attention": plan.attention,
        "divergence_factor": sft.divergence_factor,
        "requeue_on_preempt": sft.requeue_on_preempt,
        "precision": sft.precision,
        "finetuning_type": sft.finetuning_type,
        "cutoff_len": cfg.data.cutoff_len,
        "compile_layers": plan.compile,
        "liger_loss_only": plan.liger and plan.compile,
        "plan": plan.to_json(),
        "platform": platform.to_json(),
        # the run's folder, not one derived from where this YAML is written: the same config renders
        # the same YAML wherever it is written (a login node's preview, the workflow's rule)
        "tracking": tracking.settings(sft.tracking, f"results/{cfg.run}/tracking", cfg.run),
    }
    if plan.static_tokens:  # llmft.sft.train pads every flattened micro-batch to this many tokens
        args["llmft"]["static_tokens"] = plan.static_tokens
    if plan.compile_tuning:  # llmft.sft.train turns on Inductor's coordinate-descent tuning
        args["llmft"]["compile_tuning"] = True
    if plan.padding_free:  # the training worker installs the objective's padding-free forward
        args["llmft"]["padding_free"] = True
    args["llmft"].update(plan.objective.worker)  # the objective's other trainer patches (llmft.worker)
    if plan.fp8:  # llmft.sft.train converts the loaded model (LLaMA-Factory's own fp8 flag is refused)
        args["llmft"]["fp8"] = {"recipe": fp8.RECIPE, "frozen_cast_once": fp8.cast_once(plan.zero_stage)}
    decay = decay_ratio(args, sft)
    if decay is not None:  # llmft.sft.train turns it into warmup_stable_decay's decay steps
        args["llmft"]["decay_ratio"] = decay
    header = _yaml_header(platform, plan, decay, start)
    write_text(out_yaml, header + yaml.safe_dump(args, sort_keys=False))
    return args
