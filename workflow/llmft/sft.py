"""SFT: plan, render the LLaMA-Factory YAML and DeepSpeed JSON, launch one torchrun per node, publish.

`auto` settings come from the memory planner (plan.py), which also refuses a config that cannot
fit before anything is submitted. Checkpoints go to a work folder keyed by a hash of the rendered
config, outside the declared outputs (Snakemake deletes the outputs of a failed job): a retried or
requeued job with the same config resumes from its last checkpoint; a changed config starts fresh.
Each node runs torchrun over llmft.train (LLaMA-Factory's run_exp plus our callbacks); a SIGUSR1 or
SIGTERM makes the workers save a checkpoint and stop, and node 0 requeues the Slurm job.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import yaml

from . import faults, pretokenize, slurm, tracking
from .chat_templates import for_config as template_for_config
from .config import BUILTIN_MODEL, ConfigError, lora_settings
from .io import atomic_path, read_json, read_jsonl, write_json, write_text
from .launch import launch_env, torchrun_command
from .modelfiles import keep_base_structure
from .packing import STAMP_FILE, packed_dir_name, packing_args, source_fingerprint
from .plan import ModelShape, Plan, describe, model_shape, resolve
from .platform import Platform

log = logging.getLogger("llmft.sft")

# History of earlier attempts in the work folder: one JSON line per stop, preemption or divergence.
EVENTS_FILE = "llmft_events.jsonl"
# Below this learning rate a LoRA run barely moves its adapters: the render log says so.
LORA_LOW_LR = 5e-5
# LoRA: the published adapter's folder, beside the merged model's (results/{run}/sft/adapter).
ADAPTER_DIR = "adapter"


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
    cfg: dict,
    base_model: str,
    data_dir: str,
    deepspeed_path: str | None,
    work_root: str,
    plan: Plan,
    platform: Platform,
) -> dict:
    """The LLaMA-Factory training arguments; `sft.extra` wins over our defaults."""
    sft = cfg["sft"]
    vendor = platform.vendor
    args: dict = {
        "model_name_or_path": base_model,
        "trust_remote_code": False,
        "stage": "sft",
        "do_train": True,
        "finetuning_type": sft["finetuning_type"],
        "dataset": "llmft_train",
        "eval_dataset": "llmft_heldout",
        "dataset_dir": data_dir,
        # Snakemake passes the name it resolved; `auto` here only in a hand-made config.
        "template": template_for_config(cfg, base_model)[0],
        "cutoff_len": cfg["data"]["cutoff_len"],
        "preprocessing_num_workers": 1 if vendor == "cpu" else 8,
        "dataloader_num_workers": 0 if vendor == "cpu" else 4,
        "logging_steps": sft["logging_steps"],
        # NaN/inf losses must reach the divergence guard, not be averaged away.
        "logging_nan_inf_filter": False,
        "save_steps": sft["save_steps"],
        "save_total_limit": 2,
        "plot_loss": False,
        # false: a requeued job resumes from the last checkpoint (true deletes it and the log).
        "overwrite_output_dir": False,
        "report_to": tracking.report_to(sft["tracking"]),
        "run_name": cfg["run"],
        "per_device_train_batch_size": plan.micro_batch,
        "gradient_accumulation_steps": plan.gradient_accumulation,
        "learning_rate": sft["learning_rate"],
        "num_train_epochs": sft["num_train_epochs"],
        "max_steps": sft["max_steps"],
        "lr_scheduler_type": sft["lr_scheduler_type"],
        "warmup_ratio": sft["warmup_ratio"],
        "weight_decay": sft["weight_decay"],
        "max_grad_norm": sft["max_grad_norm"],
        "seed": sft["seed"],
        "ddp_timeout": max(1, round(sft["collective_timeout_minutes"] * 60)),
        # varlen is ours (llmft.train switches the model to it); LLaMA-Factory loads SDPA.
        "flash_attn": "sdpa" if plan.attention == "varlen" else plan.attention,
        "disable_gradient_checkpointing": not plan.gradient_checkpointing,
        "per_device_eval_batch_size": plan.micro_batch,
        "eval_strategy": "steps",
        # Neat packing: LLaMA-Factory's mask holds sample indices, not 0/1, and llmft.varlen's
        # batches carry no padding at all: count all tokens.
        "include_num_input_tokens_seen": "all" if plan.packing == "neat" else "non_padding",
        "eval_steps": sft["logging_steps"] * 5,
    }
    if plan.packing == "neat":
        args["neat_packing"] = True
    elif plan.packing == "plain":
        args["packing"] = True
    if plan.liger and not plan.compile:
        # With compiled layers llmft.train applies Liger's fused loss alone (its other kernels do
        # not compile under dynamo; the compiler fuses those operations itself).
        args["enable_liger_kernel"] = True
    if sft["precision"] == "bf16":
        args["bf16"] = True
    elif sft["precision"] == "fp16":
        args["fp16"] = True
    if vendor == "cpu" and sft["precision"] != "fp32":
        args["use_cpu"] = True  # transformers refuses half precision on CPU without it
    args.update(finetuning_args(sft))
    if deepspeed_path:
        args["deepspeed"] = deepspeed_path
    elif platform.world_size > 1:
        # LLaMA-Factory's DDP default (True) costs an extra pass each step.
        args["ddp_find_unused_parameters"] = False
    args.update(sft["extra"])
    # prepare_data tokenized the rows once, exactly as LLaMA-Factory would: load them instead of
    # tokenizing on the GPU nodes, unless an argument changes what its preprocessing makes. A run
    # that packs loads the rows pack_data packed from them on the CPU side, as LLaMA-Factory would.
    blocking = pretokenize.blockers(args)
    packs = packing_args(args) is not None
    if packs and not set(blocking) - {"packing", "neat_packing"}:
        args["tokenized_path"] = f"{data_dir}/{packed_dir_name(packing_args(args))}"
    elif blocking:
        log.info("not using the pre-tokenized data: %s change LLaMA-Factory's preprocessing", blocking)
    else:
        args["tokenized_path"] = f"{data_dir}/{pretokenize.TOKENIZED_DIR}"
    digest = hashlib.sha256(json.dumps(args, sort_keys=True, default=str).encode()).hexdigest()
    args["output_dir"] = f"{work_root}/sft-{digest[:12]}"
    return args


def finetuning_args(sft: dict) -> dict:
    """LLaMA-Factory's arguments for sft.finetuning_type's own keys (LoRA / QLoRA, freeze)."""
    kind = sft["finetuning_type"]
    if kind == "lora":
        out = lora_settings(sft)
        if sft["quantization_bit"] != "none":
            out["quantization_bit"] = sft["quantization_bit"]
        return out
    if kind == "freeze":
        return {"freeze_trainable_layers": sft["freeze_trainable_layers"]}
    return {}


def check_finetuning(sft: dict, shape: ModelShape) -> None:
    """What the model's shape decides: freeze cannot train more layers than there are (LLaMA-Factory
    would silently train them all)."""
    n = sft["freeze_trainable_layers"]
    if sft["finetuning_type"] == "freeze" and abs(n) > shape.layers:
        raise ConfigError(
            f"config key sft.freeze_trainable_layers: {n} but the model has {shape.layers} decoder layers; "
            f"choose at most {shape.layers} (or finetuning_type: full to train every layer)"
        )


def tiny_shape(tiny: dict) -> ModelShape:
    """The shape of builtin:tiny (assets.build_tiny_model) before it is built."""
    hidden, layers, heads, vocab = (tiny[k] for k in ("hidden_size", "num_layers", "num_heads", "vocab_size"))
    shape = ModelShape("llama", hidden, layers, heads, heads, hidden // heads, 4 * hidden, vocab, True, 0)
    return dataclasses.replace(shape, params=layers * shape.layer_params + vocab * hidden + hidden)


def precheck(cfg: dict) -> Plan:
    """The plan for what the config declares (Platform.declared), made when the workflow is parsed:
    a config that could fit on no node stops before any job. A builtin:tiny model does not exist
    yet then: its shape comes from model.tiny. The plan sft trains with is made later, from the
    nodes' facts (render)."""
    name = cfg["model"]["name_or_path"]
    shape = tiny_shape(cfg["model"]["tiny"]) if name == BUILTIN_MODEL else model_shape(name)
    check_finetuning(cfg["sft"], shape)
    return resolve(cfg, name, Platform.declared(cfg), shape)


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


def render(
    cfg: dict,
    base_model: str,
    data_dir: str,
    out_yaml: str,
    out_ds: str,
    work_root: str,
    platform: Platform,
    shape: ModelShape | None = None,
):
    """Plan for `platform`; write llamafactory.yaml (+ the launcher's `llmft:` block) and deepspeed.json."""
    shape = shape or model_shape(base_model)
    check_finetuning(cfg["sft"], shape)
    if cfg["sft"]["finetuning_type"] == "lora" and cfg["sft"]["learning_rate"] < LORA_LOW_LR:
        log.warning(
            "sft.learning_rate %g is low for LoRA: the default 1e-5 is the full-SFT recipe; LoRA usually "
            "trains at about 1e-4 (LLaMA-Factory's LoRA examples)",
            cfg["sft"]["learning_rate"],
        )
    plan = resolve(cfg, base_model, platform, shape)
    log.info("platform: %s (%s)", platform.describe(), platform.source)
    log.info("%s", describe(plan))
    ds = deepspeed_config(plan, platform)
    write_json(out_ds, ds or {"zero_optimization": {"stage": 0}, "disabled": True})
    args = llamafactory_args(cfg, base_model, data_dir, out_ds if ds else None, work_root, plan, platform)
    args["llmft"] = {
        "attention": plan.attention,
        "divergence_factor": cfg["sft"]["divergence_factor"],
        "requeue_on_preempt": cfg["sft"]["requeue_on_preempt"],
        "precision": cfg["sft"]["precision"],
        "finetuning_type": cfg["sft"]["finetuning_type"],
        "cutoff_len": cfg["data"]["cutoff_len"],
        "compile_layers": plan.compile,
        "liger_loss_only": plan.liger and plan.compile,
        "plan": plan.to_json(),
        "platform": platform.to_json(),
        # the run's folder, not one derived from where this YAML is written: the same config renders
        # the same YAML wherever it is written (a login node's preview, the workflow's rule)
        "tracking": tracking.settings(cfg["sft"]["tracking"], f"results/{cfg['run']}/tracking", cfg["run"]),
    }
    header = (
        "# Rendered by llmft from config/config.yaml: edit the config, not this file.\n"
        f"# planned for the nodes' facts, {platform.source}:\n"
        f"#   {platform.describe()}\n"
        f"# world size {platform.world_size} = {platform.nodes} node(s) x "
        f"{platform.processes_per_node} process(es)\n"
        + "".join(f"# {line}\n" for line in describe(plan).splitlines())
        + "# The `llmft:` block is read by llmft's launcher (python -m llmft sft) and removed before\n"
        "# LLaMA-Factory parses the rest; delete it to run this file with plain llamafactory-cli.\n"
    )
    write_text(out_yaml, header + yaml.safe_dump(args, sort_keys=False))
    return args


def worker_pids(parent: int) -> list[int]:
    """All descendants of a process (torchrun's workers), read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [parent]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _archive(work: Path, name: str) -> None:
    path = work / name
    if not path.exists():
        return
    text = path.read_text()
    try:
        content = json.loads(text)
    except ValueError:
        content = text
    with open(work / EVENTS_FILE, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"file": name, "archived": time.time(), "content": content}) + "\n")
    path.unlink()


def _ignore_usr1() -> None:
    # torchrun has no SIGUSR1 handler and would die of it; ignoring is inherited through exec,
    # and llmft.train installs its own handler in the workers.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def launch(cfg: dict, yaml_path: str) -> int:
    """Run this node's torchrun over llmft.train; forward stop signals; requeue after preemption.

    One launcher per node and work folder at a time (faults.WorkLock); a second is refused.
    """
    alloc = slurm.current_allocation()
    if alloc.nnodes != cfg["hardware"]["nodes"]:
        raise RuntimeError(
            f"the job has {alloc.nnodes} node(s) {alloc.nodes} but hardware.nodes is "
            f"{cfg['hardware']['nodes']}: the Slurm resources and the config disagree"
        )
    if not alloc.job_id:
        # Outside Slurm one node rendezvouses with itself: any free port (or MASTER_PORT), so runs
        # side by side on one machine never collide on a fixed one.
        port = int(os.environ.get("MASTER_PORT") or slurm.free_port())
        alloc = dataclasses.replace(alloc, master_port=port)
    args = yaml.safe_load(Path(yaml_path).read_text())
    work = Path(args["output_dir"])
    work.mkdir(parents=True, exist_ok=True)
    try:
        with faults.WorkLock(work, alloc.node_rank):
            return _launch_locked(cfg, yaml_path, args, work, alloc)
    except faults.WorkBusy as exc:
        print(f"[llmft] {exc}", flush=True)
        return faults.EXIT_BUSY


def _launch_locked(cfg: dict, yaml_path: str, args: dict, work: Path, alloc: slurm.Allocation) -> int:
    # imported here: callbacks pull in transformers, which rendering and planning do not need
    from .callbacks import (
        DIVERGENCE_FILE,
        EXIT_DIVERGED,
        EXIT_PREEMPTED,
        PREEMPTED_FILE,
        STEPS_FILE,
        STOP_REQUEST_FILE,
    )

    ours = args.get("llmft") or {}
    platform = Platform.from_json(ours["platform"])
    if finished(work):
        # The same config trained to the end before (its outputs were deleted, or the job died after
        # training): LLaMA-Factory would "resume" from the final checkpoint and train 0 steps.
        print(f"[llmft] training in {work} had finished: publishing it again, not training", flush=True)
        if alloc.node_rank == 0:
            with open(work / STEPS_FILE, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"republished": time.time()}) + "\n")
        return 0
    if alloc.node_rank == 0:
        # What ended the previous attempt (stop request, preemption, divergence) moves to the event
        # history, so this attempt's markers mean this attempt. Node 0 does it before the rendezvous
        # that every worker waits for.
        for stale in (STOP_REQUEST_FILE, PREEMPTED_FILE, DIVERGENCE_FILE):
            _archive(work, stale)
        # A checkpoint a killed attempt left half-written would be the one LLaMA-Factory resumes
        # from: set it aside, so training resumes from the newest one written whole.
        for warning in faults.set_aside_unsealed(work):
            print(f"[llmft] WARNING: {warning}", flush=True)
        faults.clear_heartbeats(work)
    env = launch_env(platform, alloc)
    host = os.environ.get("SLURMD_NODENAME", alloc.nodes[alloc.node_rank])
    print(
        # the first part in LLaMA-Factory's own launcher wording, which its users grep for
        f"[llmft] Initializing {env['NPROC_PER_NODE']} distributed tasks at: {alloc.master_addr}:"
        f"{alloc.master_port} (node {host}, rank {alloc.node_rank}/{alloc.nnodes}, work {work})",
        flush=True,
    )
    proc = subprocess.Popen(
        torchrun_command(alloc, platform.processes_per_node, "llmft.train", yaml_path),
        env=env,
        preexec_fn=_ignore_usr1,
    )

    def on_signal(signum, _frame):
        name = signal.Signals(signum).name
        print(f"[llmft] {name}: asking the trainer to save a checkpoint and stop", flush=True)
        request = work / STOP_REQUEST_FILE
        if not request.exists():
            request.write_text(json.dumps({"signal": name, "host": host, "time": time.time()}))
        for pid in worker_pids(proc.pid):
            try:
                os.kill(pid, signal.SIGUSR1)
            except OSError:
                pass

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # torchrun reports any worker failure as 1: the workers' marker files say what happened.
    if (work / DIVERGENCE_FILE).exists():
        print(f"[llmft] {json.loads((work / DIVERGENCE_FILE).read_text())['message']}", flush=True)
        return EXIT_DIVERGED
    if (work / PREEMPTED_FILE).exists():
        info = json.loads((work / PREEMPTED_FILE).read_text())
        print(
            f"[llmft] checkpoint saved at step {info['step']} ({info['why']}); exiting to resume", flush=True
        )
        if ours.get("requeue_on_preempt") and alloc.job_id and alloc.node_rank == 0:
            req = subprocess.run(["scontrol", "requeue", alloc.job_id], capture_output=True, text=True)
            print(
                f"[llmft] scontrol requeue {alloc.job_id}: rc {req.returncode} {req.stderr.strip()}",
                flush=True,
            )
        return EXIT_PREEMPTED
    if rc != 0:
        timeout = cfg["sft"]["collective_timeout_minutes"]
        for line in faults.failure_report(work, rc, timeout):
            print(f"[llmft] {line}", flush=True)
    return rc


def finished(work: Path) -> bool:
    """LLaMA-Factory wrote its end-of-training results and the final model (or, for LoRA, the final
    adapter) into the work folder."""
    final = (work / "config.json").is_file() or (work / "adapter_config.json").is_file()
    return (work / "all_results.json").is_file() and final


def attempts_summary(records: list[dict]) -> dict:
    """What the last attempt that trained did, from llmft_steps.jsonl: the step it resumed from, the
    steps it trained, the steps an earlier attempt computed past its last checkpoint (lost), and
    tokens/s over this attempt's own steps (resumed ones are not counted in it)."""
    attempts, current = [], None
    for r in records:
        if "attempt_start" in r:
            current = {
                "start": r["attempt_start"],
                "t0": r["started"],
                "tok0": r.get("tokens") or 0,
                "steps": [],
            }
            attempts.append(current)
        elif "time" in r and "step" in r and current is not None:
            current["steps"].append(r)
    republished = bool(records) and "republished" in records[-1]
    trained = [a for a in attempts if a["steps"]]
    if not trained:
        return {"attempts": len(attempts), "republished_without_training": republished}
    last = trained[-1]
    first, end = last["steps"][0], last["steps"][-1]
    before = [a for a in attempts[: attempts.index(last)] if a["steps"]]
    lost = max(0, before[-1]["steps"][-1]["step"] - last["start"]) if before else 0
    if len(last["steps"]) > 1:
        rate = (end["tokens"] - first["tokens"]) / (end["time"] - first["time"])
    else:
        rate = (end["tokens"] - last["tok0"]) / (end["time"] - last["t0"])
    return {
        "attempts": len(attempts),
        "resumed_from_step": last["start"],
        "steps_trained": end["step"] - last["start"],
        "steps_lost": lost,
        "tokens_per_second": round(rate, 2),
        "republished_without_training": republished,
    }


def _copy_files(src: Path, dst: Path) -> None:
    """The files of a work folder (not its checkpoint folders, nor the launchers' lock files)."""
    for item in src.iterdir():
        if item.is_file() and not item.name.startswith("."):
            shutil.copy2(item, dst / item.name)


def base_dtype(model_dir: str | Path) -> str:
    """The dtype a model folder's config.json declares (transformers' name), float32 if none."""
    cfg = read_json(Path(model_dir) / "config.json")
    cfg = cfg.get("text_config", cfg) if not (cfg.get("dtype") or cfg.get("torch_dtype")) else cfg
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").replace("torch.", "")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "float32"


def merge_adapter(args: dict, adapter_dir: Path, out_dir: Path) -> None:
    """The base model with the LoRA adapter merged in, written to out_dir by LLaMA-Factory's own
    export (`llamafactory-cli export`: PEFT's merge_and_unload on the unquantized base), in the base
    model's dtype, so the result loads as a plain model of the base's structure and size."""
    from llamafactory.train.tuner import export_model

    base = args["model_name_or_path"]
    export_model(
        {
            "model_name_or_path": base,
            "adapter_name_or_path": str(adapter_dir),
            "finetuning_type": "lora",
            "template": args["template"],
            "trust_remote_code": args.get("trust_remote_code", False),
            "export_dir": str(out_dir),
            "export_device": "cpu",
            "infer_dtype": base_dtype(base),
        }
    )
    # LLaMA-Factory also writes an Ollama Modelfile: not part of an HF model folder.
    (out_dir / "Modelfile").unlink(missing_ok=True)


def _weights_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def finetuning_summary(args: dict, work: Path, model_out: Path, adapter_out: Path) -> dict:
    """What train_summary.json says about the fine-tuning method: type, parameters that trained,
    the adapter's settings, the published sizes."""
    from .callbacks import PARAMS_FILE

    kind = args.get("finetuning_type", "full")
    counted = read_json(work / PARAMS_FILE) if (work / PARAMS_FILE).exists() else {}
    out = {
        "finetuning_type": kind,
        "trainable_params": counted.get("trainable_params"),
        "trained_model_params": counted.get("total_params"),
        "model_bytes": _weights_bytes(model_out),
        "adapter": None,
        "freeze_trainable_layers": args.get("freeze_trainable_layers", 2) if kind == "freeze" else None,
    }
    if kind == "lora":
        adapter_cfg = read_json(adapter_out / "adapter_config.json")
        out["adapter"] = {
            "lora_rank": args.get("lora_rank"),
            "lora_alpha": args.get("lora_alpha"),
            "lora_dropout": args.get("lora_dropout"),
            "lora_target": args.get("lora_target"),
            # the modules PEFT adapted (`all` resolved to names)
            "target_modules": sorted(adapter_cfg.get("target_modules") or []),
            "quantization_bit": args.get("quantization_bit"),
            "adapter_bytes": _weights_bytes(adapter_out),
            "path": str(adapter_out),
        }
    return out


def finalize(yaml_path: str, model_out: str, summary_out: str) -> dict:
    """Publish the trained model atomically and summarise the run from trainer_log.jsonl.

    Full and freeze training publish the work folder's model. LoRA publishes the adapter (the work
    folder's files) beside the model, in `adapter/`, and in `model/` the base with the adapter merged
    in. Each folder is written under a temporary name and renamed when complete."""
    args = yaml.safe_load(Path(yaml_path).read_text())
    world_size = Platform.from_json(args["llmft"]["platform"]).world_size
    work = Path(args["output_dir"])
    kind = args.get("finetuning_type", "full")
    model_path = Path(model_out)
    adapter_path = model_path.with_name(ADAPTER_DIR)
    if kind == "lora" and not (work / "adapter_config.json").is_file():
        raise RuntimeError(f"training left no LoRA adapter in {work}: see the sft log")
    if kind != "lora" and not (work / "config.json").is_file():
        raise RuntimeError(f"training left no model in {work}: see the sft log")
    entries = read_jsonl(work / "trainer_log.jsonl") if (work / "trainer_log.jsonl").exists() else []
    if kind == "lora":
        with atomic_path(adapter_path, directory=True) as tmp:
            _copy_files(work, tmp)
        with atomic_path(model_path, directory=True) as tmp:
            merge_adapter(args, adapter_path, tmp)
            structure = keep_base_structure(tmp, args["model_name_or_path"])
    else:
        with atomic_path(model_path, directory=True) as tmp:
            _copy_files(work, tmp)
            # the base's structure: a tied head saved once, the base's dtype; refused if it still differs
            structure = keep_base_structure(tmp, args["model_name_or_path"])
        if (adapter_path / "adapter_config.json").is_file():
            # an earlier LoRA config's adapter: not this model's
            shutil.rmtree(adapter_path)
    from .callbacks import STEPS_FILE

    results = read_json(work / "all_results.json") if (work / "all_results.json").exists() else {}
    steps_file = work / STEPS_FILE
    attempt = attempts_summary(read_jsonl(steps_file) if steps_file.exists() else [])
    state = work / "trainer_state.json"
    history = read_json(state)["log_history"] if state.exists() else []
    train_logs = [h for h in history if "loss" in h]
    summary = {
        "work_dir": str(work),
        "world_size": world_size,
        "steps": history[-1].get("step") if history else None,
        "first_loss": train_logs[0]["loss"] if train_logs else None,
        "final_loss": train_logs[-1]["loss"] if train_logs else None,
        "train_runtime_s": results.get("train_runtime"),
        "train_samples_per_second": results.get("train_samples_per_second"),
        "train_tokens": results.get("num_input_tokens_seen")
        or (entries[-1].get("total_tokens") if entries else None),
        # Over the steps the last attempt that trained computed itself (llmft_steps.jsonl); LLaMA-Factory's
        # own figure divides every token seen, resumed ones included, by this attempt's time.
        "tokens_per_second": attempt.get("tokens_per_second"),
        "llamafactory_throughput": entries[-1].get("throughput") if entries else None,
        "attempt": attempt,
        "peak_vram_gib": max((e.get("vram_allocated", 0) for e in entries), default=0) or None,
        "predicted_peak_gib": (args.get("llmft") or {}).get("plan", {}).get("memory", {}).get("peak"),
        "eval_loss": results.get("eval_loss"),
        "model_files": structure,
        **finetuning_summary(args, work, model_path, adapter_path),
        "history": history,
    }
    write_json(summary_out, summary)
    return summary
