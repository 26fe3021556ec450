"""SFT: render the LLaMA-Factory YAML and DeepSpeed JSON, launch one torchrun per node, publish.

Checkpoints go to a work folder keyed by a hash of the rendered config, outside the declared
outputs (Snakemake deletes the outputs of a failed job): a retried or requeued job with the same
config resumes from its last checkpoint; a changed config starts fresh.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from . import hardware, pretokenize, slurm
from .config import layout
from .io import atomic_path, read_json, read_jsonl, write_json, write_text

log = logging.getLogger("llmft.sft")

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def resolve_vendor(cfg: dict) -> str:
    """cpu / cuda / rocm: the config's choice, or what torch was built for when `auto`."""
    vendor = cfg["hardware"]["vendor"]
    if vendor != "auto":
        return vendor
    if cfg["hardware"]["gpus_per_node"] == 0:
        return "cpu"
    import torch

    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


def deepspeed_config(cfg: dict) -> dict | None:
    """DeepSpeed JSON; batch size, LR and precision stay "auto" so the LLaMA-Factory YAML owns them."""
    sft = cfg["sft"]
    stage = sft["zero_stage"]
    if stage == 0:
        return None
    gpu = resolve_vendor(cfg) != "cpu"
    zero: dict = {
        "stage": stage,
        # overlap needs a side stream: only on GPUs.
        "overlap_comm": gpu,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 5e8 if gpu else "auto",
    }
    if stage == 2:
        zero["allgather_partitions"] = True
        zero["allgather_bucket_size"] = 5e8 if gpu else "auto"
    if stage == 3:
        zero.update(
            {
                "sub_group_size": 1e9,
                "stage3_prefetch_bucket_size": 5e8 if gpu else "auto",
                "stage3_param_persistence_threshold": "auto",
                "stage3_max_live_parameters": 1e9,
                "stage3_max_reuse_distance": 1e9,
                # Save a loadable 16-bit model, not only sharded ZeRO checkpoints.
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
        if sft["offload"]:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
    }


def llamafactory_args(
    cfg: dict, base_model: str, data_dir: str, deepspeed_path: str | None, work_root: str
) -> dict:
    """The LLaMA-Factory training arguments; `sft.extra` wins over our defaults."""
    sft = cfg["sft"]
    vendor = resolve_vendor(cfg)
    args: dict = {
        "model_name_or_path": base_model,
        "trust_remote_code": False,
        "stage": "sft",
        "do_train": True,
        "finetuning_type": sft["finetuning_type"],
        "dataset": "llmft_train",
        "eval_dataset": "llmft_heldout",
        "dataset_dir": data_dir,
        "template": cfg["model"]["template"],
        "cutoff_len": cfg["data"]["cutoff_len"],
        "preprocessing_num_workers": 1 if vendor == "cpu" else 8,
        "dataloader_num_workers": 0 if vendor == "cpu" else 2,
        "logging_steps": sft["logging_steps"],
        "save_steps": sft["save_steps"],
        "save_total_limit": 2,
        "plot_loss": False,
        # false: a requeued job resumes from the last checkpoint (true deletes it and the log).
        "overwrite_output_dir": False,
        "report_to": "none",
        "per_device_train_batch_size": sft["per_device_train_batch_size"],
        "gradient_accumulation_steps": sft["gradient_accumulation_steps"],
        "learning_rate": sft["learning_rate"],
        "num_train_epochs": sft["num_train_epochs"],
        "max_steps": sft["max_steps"],
        "lr_scheduler_type": sft["lr_scheduler_type"],
        "warmup_ratio": sft["warmup_ratio"],
        "weight_decay": sft["weight_decay"],
        "max_grad_norm": sft["max_grad_norm"],
        "seed": sft["seed"],
        "ddp_timeout": sft["collective_timeout_minutes"] * 60,
        "flash_attn": sft["flash_attn"],
        "disable_gradient_checkpointing": not sft["gradient_checkpointing"],
        "per_device_eval_batch_size": max(1, sft["per_device_train_batch_size"]),
        "eval_strategy": "steps",
        "include_num_input_tokens_seen": True,
        "eval_steps": sft["logging_steps"] * 5,
    }
    if sft["precision"] == "bf16":
        args["bf16"] = True
    elif sft["precision"] == "fp16":
        args["fp16"] = True
    if vendor == "cpu" and sft["precision"] != "fp32":
        args["use_cpu"] = True  # transformers refuses half precision on CPU without it
    if deepspeed_path:
        args["deepspeed"] = deepspeed_path
    elif layout(cfg).world_size > 1:
        # LLaMA-Factory's DDP default (True) costs an extra pass each step.
        args["ddp_find_unused_parameters"] = False
    args.update(sft["extra"])
    # prepare_data tokenized the rows once, exactly as LLaMA-Factory would: load them instead of
    # tokenizing on the GPU nodes, unless an argument changes what its preprocessing makes.
    blocking = pretokenize.blockers(args)
    if blocking:
        log.info("not using the pre-tokenized data: %s change LLaMA-Factory's preprocessing", blocking)
    else:
        args["tokenized_path"] = f"{data_dir}/{pretokenize.TOKENIZED_DIR}"
    digest = hashlib.sha256(json.dumps(args, sort_keys=True, default=str).encode()).hexdigest()
    args["output_dir"] = f"{work_root}/sft-{digest[:12]}"
    return args


def render(cfg: dict, base_model: str, data_dir: str, out_yaml: str, out_ds: str, work_root: str):
    """Write llamafactory.yaml and deepspeed.json (the latter `{}`-free when ZeRO is off)."""
    ds = deepspeed_config(cfg)
    write_json(out_ds, ds or {"zero_optimization": {"stage": 0}, "disabled": True})
    args = llamafactory_args(cfg, base_model, data_dir, out_ds if ds else None, work_root)
    header = (
        "# Rendered by llmft from config/config.yaml: edit the config, not this file.\n"
        f"# world size {layout(cfg).world_size} = {layout(cfg).nodes} node(s) x "
        f"{layout(cfg).processes_per_node} process(es)\n"
    )
    write_text(out_yaml, header + yaml.safe_dump(args, sort_keys=False))
    return args


def launch_env(cfg: dict, alloc: slurm.Allocation, base_env: dict | None = None) -> dict:
    """Environment for LLaMA-Factory's torchrun launcher on this node."""
    env = dict(os.environ if base_env is None else base_env)
    vendor = resolve_vendor(cfg)
    preset = hardware.collective_preset(vendor, cfg["hardware"]["socket_ifname"], cfg["hardware"]["ib_hca"])
    for key, value in preset.env.items():
        env.setdefault(key, value)
    env.update(OFFLINE_ENV)
    env.setdefault("RECORD_VRAM", "1")  # peak GPU memory in trainer_log.jsonl
    lay = layout(cfg)
    env.update(
        {
            "FORCE_TORCHRUN": "1",
            "NNODES": str(alloc.nnodes),
            "NODE_RANK": str(alloc.node_rank),
            "NPROC_PER_NODE": str(lay.processes_per_node),
            "MASTER_ADDR": alloc.master_addr,
            "MASTER_PORT": str(alloc.master_port),
        }
    )
    if vendor == "cpu":
        # One compute thread per process: 2 processes on 2 cores don't fight.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // lay.processes_per_node)))
        env["CUDA_VISIBLE_DEVICES"] = ""
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def launch(cfg: dict, yaml_path: str) -> int:
    """Run `llamafactory-cli train` on this node (one call per node; rank from the allocation)."""
    alloc = slurm.current_allocation()
    if alloc.nnodes != cfg["hardware"]["nodes"]:
        raise RuntimeError(
            f"the job has {alloc.nnodes} node(s) {alloc.nodes} but hardware.nodes is "
            f"{cfg['hardware']['nodes']}: the Slurm resources and the config disagree"
        )
    env = launch_env(cfg, alloc)
    host = os.environ.get("SLURMD_NODENAME", alloc.nodes[alloc.node_rank])
    print(
        f"[llmft] node {host} rank {alloc.node_rank}/{alloc.nnodes} "
        f"master {alloc.master_addr}:{alloc.master_port} nproc {env['NPROC_PER_NODE']}",
        flush=True,
    )
    cmd = [str(Path(sys.executable).parent / "llamafactory-cli"), "train", yaml_path]
    return subprocess.call(cmd, env=env)


def finalize(yaml_path: str, model_out: str, summary_out: str, world_size: int) -> dict:
    """Publish the trained model atomically and summarise the run from trainer_log.jsonl."""
    args = yaml.safe_load(Path(yaml_path).read_text())
    work = Path(args["output_dir"])
    if not (work / "config.json").is_file():
        raise RuntimeError(f"training left no model in {work}: see the sft log")
    entries = read_jsonl(work / "trainer_log.jsonl") if (work / "trainer_log.jsonl").exists() else []
    with atomic_path(model_out, directory=True) as tmp:
        for item in work.iterdir():
            if item.is_file():
                shutil.copy2(item, tmp / item.name)
    results = read_json(work / "all_results.json") if (work / "all_results.json").exists() else {}
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
        "tokens_per_second": entries[-1].get("throughput") if entries else None,
        "peak_vram_gib": max((e.get("vram_allocated", 0) for e in entries), default=0) or None,
        "eval_loss": results.get("eval_loss"),
        "history": history,
    }
    write_json(summary_out, summary)
    return summary
