"""Config: JSON-schema validation with defaults, then cross-field rules.

Errors name the config key (`sft.learning_rate`) or the path that is wrong, and are raised before
anything is submitted.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from llmft.core.io import path_problem

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / "config.schema.yaml"
BUILTIN_MODEL = "builtin:tiny"
# results/current (the promoted run's link) and results/nightly/ (the nightly's state) are not runs.
RESERVED_RUNS = {"current", "nightly"}
BUILTIN_DATA = "builtin:synthetic"

# LLaMA-Factory keys that the pipeline owns: passing them through `sft.extra` would break the
# stage contract (where outputs go, which data is used), so they are refused by name.
RESERVED_EXTRA = {
    "model_name_or_path",
    "dataset",
    "dataset_dir",
    "eval_dataset",
    "output_dir",
    "deepspeed",
    "stage",
    "do_train",
    "template",
    "cutoff_len",
    "overwrite_output_dir",
    "tokenized_path",
}
# LLaMA-Factory arguments that have their own sft.* key (of the same name): the key, not sft.extra,
# sets them, so the planner and train_summary.json see the value that trains.
OWN_KEYS_EXTRA = {
    "finetuning_type",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "lora_target",
    "quantization_bit",
    "freeze_trainable_layers",
}
# sft keys that only one finetuning_type reads: set to anything but their default under another
# type, they would be silently ignored.
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target", "quantization_bit")
FREEZE_KEYS = ("freeze_trainable_layers",)


class ConfigError(ValueError):
    """A config value is wrong; the message names the key and what to do."""


def _key(path) -> str:
    parts = [str(p) if not isinstance(p, int) else f"[{p}]" for p in path]
    return ".".join(parts).replace(".[", "[") or "<top level>"


def _fill_defaults(schema: dict, instance: Any) -> Any:
    """Fill defaults depth-first (objects first get their own default, then their keys')."""
    if not isinstance(instance, dict) or schema.get("type") != "object":
        if isinstance(instance, list) and "items" in schema:
            return [_fill_defaults(schema["items"], item) for item in instance]
        return instance
    for name, sub in schema.get("properties", {}).items():
        if name not in instance and "default" in sub:
            instance[name] = copy.deepcopy(sub["default"])
        if name in instance:
            instance[name] = _fill_defaults(sub, instance[name])
    return instance


def load_schema() -> dict:
    with open(SCHEMA_PATH, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def validate(raw: dict | None, base_dir: str | Path = ".") -> dict:
    """Validate a raw config dict; return a new dict with every default filled in."""
    schema = load_schema()
    cfg = copy.deepcopy(raw or {})
    if not isinstance(cfg, dict):
        raise ConfigError("config must be a mapping of keys to values")
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(cfg), key=lambda e: list(e.absolute_path))
    if errors:
        raise ConfigError(_describe(errors[0]))
    _source_keys(cfg)  # before defaults: which keys the user wrote
    cfg = _fill_defaults(schema, cfg)
    for src in cfg["data"]["sources"]:
        if "dataset_info" in src:  # the entry decides them; the validated config stays valid input
            src.pop("format", None)
            src.pop("split", None)
    errors = sorted(validator.iter_errors(cfg), key=lambda e: list(e.absolute_path))
    if errors:
        raise ConfigError(_describe(errors[0]))
    _cross_checks(cfg, Path(base_dir))
    return cfg


def _describe(err: jsonschema.ValidationError) -> str:
    where = _key(err.absolute_path)
    if err.validator == "type" and isinstance(err.instance, str) and _is_number(err.instance):
        if "e" in err.instance.lower():
            why = (
                "YAML reads an exponent without a decimal point as a string; write "
                f"{float(err.instance)!r} (e.g. 1.0e-4 for 1e-4)"
            )
        else:
            # quoted in the file, or given on the command line (`--config` passes nested values as text)
            why = f"write it unquoted ({err.instance.strip()}), in the config file rather than in --config"
        return f"config key {where}: {err.instance!r} is text, not a number: {why}"
    if err.validator == "type" and err.instance in ("true", "false", "True", "False"):
        return (
            f"config key {where}: {err.instance!r} is text, not true/false: write it unquoted, in the "
            "config file rather than in --config"
        )
    if err.validator == "additionalProperties":
        extra = sorted(set(err.instance) - set(err.schema.get("properties", {})))
        allowed = ", ".join(sorted(err.schema.get("properties", {})))
        return f"config key {where}: unknown key(s) {extra}; allowed here: {allowed}"
    if err.validator == "pattern" and where == "run":
        return (
            f"config key run: {err.instance!r} is not a valid run name "
            "(letters, digits, '_', '.', '-' only, not starting with '.'; it becomes a folder name)"
        )
    return f"config key {where}: {err.message}"


def _source_keys(cfg: dict) -> None:
    """A data source is a file (path, with format and split) or a LLaMA-Factory dataset entry
    (dataset_info with name, whose format the entry decides): never a mix."""
    for i, src in enumerate((cfg.get("data") or {}).get("sources") or ()):
        where = f"config key data.sources[{i}]"
        if "dataset_info" in src:
            mixed = sorted({"path", "format", "split"} & set(src))
            if mixed:
                raise ConfigError(
                    f"{where}.{mixed[0]}: not with dataset_info (the entry's file_name and formatting "
                    "decide them); remove it"
                )
            if "name" not in src:
                raise ConfigError(f"{where}.name: missing; the entry of {src['dataset_info']} to read")
        elif "path" not in src:
            raise ConfigError(
                f"{where}: needs path (a dataset file) or dataset_info and name (a LLaMA-Factory "
                "dataset_info.json entry)"
            )
        elif "name" in src:
            raise ConfigError(f"{where}.name: only with dataset_info (a LLaMA-Factory dataset_info.json)")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_hardware(hw: dict) -> None:
    if hw["vendor"] in ("cuda", "rocm") and hw["gpus_per_node"] == 0:
        raise ConfigError(
            f"config key hardware.gpus_per_node: 0 but hardware.vendor is {hw['vendor']!r}; "
            "set the GPUs per node (8 on an MI300X node) or vendor: cpu"
        )
    if hw["gpus_per_node"] and hw["processes_per_node"] > hw["gpus_per_node"]:
        raise ConfigError(
            "config key hardware.processes_per_node: "
            f"{hw['processes_per_node']} processes but only {hw['gpus_per_node']} GPUs per node"
        )


def _check_source(i: int, src: dict, base_dir: Path) -> None:
    """data.sources[i]: a LLaMA-Factory dataset, the builtin, a save_to_disk folder or a data file."""
    if "dataset_info" in src:
        from llmft.core.lfdataset import LFDatasetError, resolve

        try:
            resolve(src, base_dir, where=f"data.sources[{i}]")
        except LFDatasetError as exc:
            raise ConfigError(str(exc)) from None
        return
    path = src["path"]
    if path.startswith("builtin:"):
        if path != BUILTIN_DATA:
            raise ConfigError(
                f"config key data.sources[{i}].path: unknown builtin {path!r} (only {BUILTIN_DATA})"
            )
        return
    full = Path(path) if Path(path).is_absolute() else base_dir / path
    problem = path_problem(full)
    if problem == "not found":
        raise ConfigError(f"config key data.sources[{i}].path: dataset file not found: {full}")
    if problem:
        raise ConfigError(f"config key data.sources[{i}].path: {full} {problem}")
    if full.is_dir():
        # A folder counts only when datasets' save_to_disk wrote it (a Dataset or a DatasetDict).
        if not ((full / "state.json").is_file() or (full / "dataset_dict.json").is_file()):
            raise ConfigError(
                f"config key data.sources[{i}].path: {full} is a folder but not one written by "
                "datasets' save_to_disk (no state.json or dataset_dict.json)"
            )
        return
    if full.stat().st_size == 0:
        raise ConfigError(f"config key data.sources[{i}].path: {full} is empty")
    if full.suffix not in (".json", ".jsonl", ".parquet"):
        raise ConfigError(f"config key data.sources[{i}].path: {full.name} is not .json, .jsonl or .parquet")


def _check_model(name: str, base_dir: Path) -> None:
    if name.startswith("builtin:"):
        if name != BUILTIN_MODEL:
            raise ConfigError(
                f"config key model.name_or_path: unknown builtin {name!r} (only {BUILTIN_MODEL})"
            )
        return
    full = Path(name) if Path(name).is_absolute() else base_dir / name
    if not (full / "config.json").is_file():
        raise ConfigError(
            f"config key model.name_or_path: {full} is not a local model folder "
            "(no config.json); this pipeline never downloads from a hub"
        )


def _check_lf_names(cfg: dict) -> None:
    """model.template and sft.extra against the installed LLaMA-Factory's names."""
    from llmft.core.lfnames import closest, names

    lf = names()
    template = cfg["model"]["template"]
    # auto: picked from the model folder when the DAG is built (chat_templates.resolve).
    if template != "auto" and template not in lf["templates"]:
        raise ConfigError(
            f"config key model.template: LLaMA-Factory {lf['llamafactory']} has no template {template!r}"
            + closest(template, lf["templates"])
        )
    unknown = sorted(set(cfg["sft"]["extra"]) - set(lf["arguments"]))
    if unknown:
        raise ConfigError(
            f"config key sft.extra: {unknown} are not LLaMA-Factory {lf['llamafactory']} training arguments"
            + closest(unknown[0], lf["arguments"])
        )
    reserved = sorted(RESERVED_EXTRA & set(cfg["sft"]["extra"]))
    if reserved:
        raise ConfigError(
            f"config key sft.extra: {reserved} are set by the pipeline itself; "
            "use the matching llmft key (model.*, data.*, sft.*) instead"
        )
    own = sorted(OWN_KEYS_EXTRA & set(cfg["sft"]["extra"]))
    if own:
        raise ConfigError(
            f"config key sft.extra: {own} have their own llmft keys: set "
            + ", ".join(f"sft.{k}" for k in own)
            + " instead"
        )


def _cross_checks(cfg: dict, base_dir: Path) -> None:
    if cfg["run"] in RESERVED_RUNS:
        raise ConfigError(
            f"config key run: {cfg['run']!r} is reserved (results/current is the promoted nightly run, "
            "results/nightly/ the nightly's state); choose another name"
        )
    hw = cfg["hardware"]
    _check_hardware(hw)
    for i, src in enumerate(cfg["data"]["sources"]):
        _check_source(i, src, base_dir)
    _check_model(cfg["model"]["name_or_path"], base_dir)
    _check_lf_names(cfg)
    if cfg["sft"]["offload"] is True and cfg["sft"]["zero_stage"] not in (3, "auto"):
        raise ConfigError("config key sft.offload: offload needs sft.zero_stage: 3 (or auto)")
    _finetuning_checks(cfg["sft"], on_cpu=hw["vendor"] == "cpu" or hw["gpus_per_node"] == 0)


@functools.cache
def _sft_defaults() -> dict:
    return {k: v.get("default") for k, v in load_schema()["properties"]["sft"]["properties"].items()}


def sft_default(key: str):
    """The schema's default of sft.<key>."""
    return copy.deepcopy(_sft_defaults()[key])


def _finetuning_checks(sft: dict, on_cpu: bool = False) -> None:
    """The LoRA / freeze / quantization keys: only under the type that reads them, values that work."""
    kind = sft["finetuning_type"]
    for keys, owner in ((LORA_KEYS, "lora"), (FREEZE_KEYS, "freeze")):
        if kind == owner:
            continue
        for key in keys:
            if sft[key] != sft_default(key):
                raise ConfigError(
                    f"config key sft.{key}: {sft[key]!r} is only used with sft.finetuning_type: {owner} "
                    f"(it is {kind!r}); remove the key or set finetuning_type: {owner}"
                )
    target = sft["lora_target"]
    names = target.split(",") if isinstance(target, str) else list(target)
    if "all" in names and len(names) > 1:
        raise ConfigError(
            f"config key sft.lora_target: {target!r} mixes 'all' (every linear layer) with module names; "
            "give either all or the names"
        )
    if len(set(names)) != len(names):
        raise ConfigError(f"config key sft.lora_target: {target!r} names a module twice")
    if sft["freeze_trainable_layers"] == 0:
        raise ConfigError(
            "config key sft.freeze_trainable_layers: 0 trains nothing; n > 0 trains the last n decoder "
            "layers, n < 0 the first -n"
        )
    if sft["quantization_bit"] == 8 and sft["zero_stage"] == 3:
        raise ConfigError(
            "config key sft.quantization_bit: 8-bit bitsandbytes models do not train under ZeRO-3 "
            "(LLaMA-Factory allows only 4-bit there); set quantization_bit: 4 or sft.zero_stage: 0, 2 or auto"
        )
    if sft["quantization_bit"] != "none" and on_cpu and sft["zero_stage"] not in (0, "auto"):
        raise ConfigError(
            f"config key sft.zero_stage: {sft['zero_stage']} with sft.quantization_bit on CPU processes: "
            "bitsandbytes' CPU backend (0.50) trains a quantized model only without DeepSpeed (ZeRO-3 "
            "fails saving its 4-bit weights); set sft.zero_stage: 0 (or auto)"
        )


def lora_settings(sft: dict) -> dict:
    """The adapter settings as LLaMA-Factory reads them (lora_alpha resolved, lora_target a string)."""
    target = sft["lora_target"]
    return {
        "lora_rank": sft["lora_rank"],
        "lora_alpha": 2 * sft["lora_rank"] if sft["lora_alpha"] == "auto" else sft["lora_alpha"],
        "lora_dropout": sft["lora_dropout"],
        "lora_target": target if isinstance(target, str) else ",".join(target),
    }


@dataclass(frozen=True)
class Layout:
    """Hardware layout resolved from the config (processes per node, world size)."""

    nodes: int
    gpus_per_node: int
    processes_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node


def layout(cfg: dict) -> Layout:
    hw = cfg["hardware"]
    ppn = hw["processes_per_node"] or (hw["gpus_per_node"] or 2)
    return Layout(hw["nodes"], hw["gpus_per_node"], ppn)


def load_file(path: str | Path, overrides: dict | None = None) -> dict:
    """Read a YAML config file, or the JSON one render_sft_config writes for sft (plus overrides, e.g.
    from --config), and validate it. JSON is read as JSON: YAML would read its `1e-05` as text."""
    with open(path, encoding="utf-8") as fh:
        raw = (json.load(fh) if Path(path).suffix == ".json" else yaml.safe_load(fh)) or {}
    if overrides:
        raw = deep_merge(raw, overrides)
    return validate(raw, base_dir=Path.cwd())


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
