"""sft, part three: publish what training made (the model, LoRA's adapter merged or kept, the summary)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from llmft.core.io import atomic_path, read_json, read_jsonl, read_optional, write_json
from llmft.core.modelfiles import SEAL, keep_base_structure, seal_folder
from llmft.core.platform import Platform
from llmft.core.throughput import measured_throughput
from llmft.sft.markers import PARAMS_FILE, START_WEIGHTS_FILE, STEPS_FILE

# LoRA: the published adapter's folder, beside the merged model's (results/{run}/sft/adapter).
ADAPTER_DIR = "adapter"


def attempts_summary(records: list[dict], history: list[dict] = (), world: int = 1) -> dict:
    """What the last attempt that trained did, from llmft_steps.jsonl: the step it resumed from, the
    steps it trained, the steps an earlier attempt computed past its last checkpoint (lost), and its
    throughput over its own measured steps (measured_throughput: resumed steps are not counted in
    it). Over all attempts: the step each started from and the training time they took together
    (each from its start to its last step: LLaMA-Factory's train_runtime is the last attempt's alone)."""
    attempts, current = [], None
    for r in records:
        if "attempt_start" in r:
            current = {"record": r, "start": r["attempt_start"], "t0": r["started"], "steps": []}
            attempts.append(current)
        elif "time" in r and "step" in r and current is not None:
            current["steps"].append(r)
    republished = bool(records) and "republished" in records[-1]
    trained = [a for a in attempts if a["steps"]]
    if not trained:
        return {"attempts": len(attempts), "republished_without_training": republished}
    last = trained[-1]
    end = last["steps"][-1]
    before = [a for a in attempts[: attempts.index(last)] if a["steps"]]
    lost = max(0, before[-1]["steps"][-1]["step"] - last["start"]) if before else 0
    return {
        "attempts": len(attempts),
        "starts": [a["start"] for a in attempts],
        "runtime_s": round(sum(a["steps"][-1]["time"] - a["t0"] for a in trained), 3),
        "resumed_from_step": last["start"],
        "steps_trained": end["step"] - last["start"],
        "steps_lost": lost,
        **measured_throughput(last["steps"], last["record"], list(history), world),
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


def fp8_summary(args: dict, work: Path) -> dict:
    """What ran in float8, as the training entry counted it on the model that trained (FP8_FILE);
    bf16 when FP8 was not planned. Planned but not counted is an error, never a guess."""
    from llmft.core import fp8

    planned = (args.get("llmft") or {}).get("fp8")
    if not planned:
        return {"planned": False, "float8_layers": 0, "summary": "bf16: FP8 not planned (sft.fp8)"}
    report = fp8.read_report(work)
    if report is None:
        raise RuntimeError(f"FP8 was planned but training wrote no {fp8.FP8_FILE} in {work}: see the sft log")
    return {"planned": True, **{k: v for k, v in report.items() if k != "bf16_names"}}


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
    # each folder sealed by content (modelfiles.SEAL) before it is renamed into place
    if kind == "lora":
        with atomic_path(adapter_path, directory=True) as tmp:
            _copy_files(work, tmp)
            seal_folder(tmp)
        with atomic_path(model_path, directory=True) as tmp:
            merge_adapter(args, adapter_path, tmp)
            structure = keep_base_structure(tmp, args["model_name_or_path"])
            seal_folder(tmp)
    else:
        with atomic_path(model_path, directory=True) as tmp:
            _copy_files(work, tmp)
            # the base's structure: a tied head saved once, the base's dtype; refused if it still differs
            structure = keep_base_structure(tmp, args["model_name_or_path"])
            seal_folder(tmp)
        if (adapter_path / "adapter_config.json").is_file():
            # an earlier LoRA config's adapter: not this model's
            shutil.rmtree(adapter_path)
    results = read_json(work / "all_results.json") if (work / "all_results.json").exists() else {}
    steps_file = work / STEPS_FILE
    state = work / "trainer_state.json"
    history = read_json(state)["log_history"] if state.exists() else []
    attempt = attempts_summary(read_jsonl(steps_file) if steps_file.exists() else [], history, world_size)
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
        # core.throughput: over the last attempt's measured steps (llmft_steps.jsonl); LLaMA-Factory's
        # own figure divides every token seen, resumed ones included, by this attempt's time.
        "tokens_per_second_per_gpu": attempt.pop("tokens_per_second_per_gpu", None),
        "throughput_steps": attempt.pop("throughput_steps", None),
        "llamafactory_throughput": entries[-1].get("throughput") if entries else None,
        "attempt": attempt,
        "peak_vram_gib": max((e.get("vram_allocated", 0) for e in entries), default=0) or None,
        "predicted_peak_gib": (args.get("llmft") or {}).get("plan", {}).get("memory", {}).get("peak"),
        "eval_loss": results.get("eval_loss"),
        "model_files": structure,
        "seal": SEAL,  # the published folders carry one: a folder without it was changed since
        # the first trainable tensor as training started (a continued run: its parent's)
        "start_weights": read_optional(work / START_WEIGHTS_FILE),
        **finetuning_summary(args, work, model_path, adapter_path),
        "fp8": fp8_summary(args, work),
        "history": history,
    }
    write_json(summary_out, summary)
    return summary
