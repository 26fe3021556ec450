"""Config: JSON-schema validation with defaults, then cross-field rules.

Errors name the config key (`sft.learning_rate`) or the path that is wrong, and are raised before
anything is submitted.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from llmft.core.io import path_problem
from llmft.core.schedule import NEEDS_MIN_LR, STEP_KEYS, WSD, reads_ratio

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
# LLaMA-Factory's FP8 arguments: its `fp8: true` goes through Accelerate, which falls back to bf16
# without an error on our stack; sft.fp8 applies FP8 in llmft's training entry instead.
FP8_EXTRA = ("fp8", "fp8_backend", "fp8_enable_fsdp_float8_all_gather")
# sft.extra arguments that would run Python code shipped in the model folder (a remote-code model
# of a type transformers lacks also stops a job at transformers' interactive [y/N] prompt).
REMOTE_CODE_EXTRA = ("trust_remote_code",)

# Bounds on a config's size. Every job gets its slice as one command-line argument (--config-json),
# which Linux caps at 128 KiB; a YAML alias repeated inside aliases ("billion laughs") expands to more
# than memory holds. Both are refused before anything walks the whole config.
MAX_VALUES = 20_000  # values (mappings, lists, scalars) counted as if every alias were written out
MAX_STRING = 8_192  # characters of one string (a path is at most 4096)
MAX_JSON = 64 * 1024  # characters of the whole config as JSON, half the kernel's argument cap


class ConfigError(ValueError):
    """A config value is wrong; the message names the key and what to do."""


def _key(path) -> str:
    parts = [str(p) if not isinstance(p, int) else f"[{p}]" for p in path]
    return ".".join(parts).replace(".[", "[") or "<top level>"


def _fill_defaults(schema: dict, instance: Any) -> Any:
    """Fill defaults depth-first (objects first get their own default, then their keys')."""
    types = schema.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types)  # [object, "null"]
    if not isinstance(instance, dict) or not is_object:
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
    """The config schema, a copy of its one parse per process (callers may change what they get)."""
    return copy.deepcopy(_parsed_schema())


@functools.cache
def _parsed_schema() -> dict:
    # libyaml's loader where PyYAML has it: the same document, ~10x less CPU than the pure-Python
    # one (~0.15 s for this file), paid by every snakemake and llmft process that checks a config
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(SCHEMA_PATH, encoding="utf-8") as fh:
        return yaml.load(fh, Loader=loader)


def validate(raw: dict | None, base_dir: str | Path = ".") -> dict:
    """Validate a raw config dict; return a new dict with every default filled in."""
    schema = load_schema()
    if not isinstance(raw or {}, dict):
        raise ConfigError("config must be a mapping of keys to values")
    check_size(raw or {})
    check_finite(raw or {})
    cfg = copy.deepcopy(raw or {})
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(cfg), key=lambda e: list(e.absolute_path))
    if errors:
        raise ConfigError(_describe(errors[0]))
    _source_keys(cfg)  # before defaults: which keys the user wrote
    cfg = _fill_defaults(schema, cfg)
    for _key, src in _all_sources(cfg):
        if "dataset_info" in src:  # the entry decides them; the validated config stays valid input
            src.pop("format", None)
            src.pop("split", None)
    errors = sorted(validator.iter_errors(cfg), key=lambda e: list(e.absolute_path))
    if errors:
        raise ConfigError(_describe(errors[0]))
    _cross_checks(cfg, Path(base_dir))
    return cfg


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _alias_key(path: tuple) -> str:
    """The key a runaway value sits under: its mapping keys up to the first list index, three deep."""
    keys = []
    for part in path[:3]:
        if not isinstance(part, str):
            break
        keys.append(part)
    return _key(keys)


def check_size(raw: dict) -> None:
    """Refuse a config too big to pass to a job, in time bounded by MAX_VALUES (an alias bomb's shared
    lists are counted as written out, and the count stops at the bound)."""
    count, stack = 0, [((), raw)]
    while stack:
        path, node = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise ConfigError(
                f"config key {_alias_key(path)}: the config holds more than {MAX_VALUES} values (a YAML "
                "alias repeated inside aliases?); write the values out, or remove the key"
            )
        if isinstance(node, dict):
            stack.extend(((*path, str(k)), v) for k, v in node.items())
            strings = [str(k) for k in node]
        elif isinstance(node, list):
            stack.extend(((*path, i), v) for i, v in enumerate(node))
            strings = []
        else:
            strings = [node] if isinstance(node, str) else []
        for text in strings:
            if len(text) > MAX_STRING:
                raise ConfigError(
                    f"config key {_key(path)}: a text of {len(text)} characters; at most {MAX_STRING} "
                    "(every job gets the config on its command line)"
                )
    size = len(json.dumps(raw, default=str))
    if size > MAX_JSON:
        biggest = max(raw, key=lambda k: len(json.dumps(raw[k], default=str)))
        raise ConfigError(
            f"config key {biggest}: the config is {size} characters as JSON, at most {MAX_JSON} (every job "
            "gets it on its command line); shorten the largest values"
        )


def check_finite(raw: dict) -> None:
    """Refuse NaN and infinity anywhere (YAML's .nan and .inf, --config's nan): every comparison with
    NaN is false, so no schema minimum or maximum would stop it."""
    stack = [((), raw)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            stack.extend(((*path, str(k)), v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend(((*path, i), v) for i, v in enumerate(node))
        elif isinstance(node, float) and not math.isfinite(node):
            raise ConfigError(f"config key {_key(path)}: {node} is not a finite number; give a number")


def _describe(err: jsonschema.ValidationError) -> str:
    where = _key(err.absolute_path)
    if err.validator == "pattern" and "x-allowed" in err.schema:
        return f"config key {where}: {_short(err.instance)} is not allowed: {err.schema['x-allowed']}"
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
    if err.validator == "maxLength":
        return (
            f"config key {where}: {_short(err.instance)} is {len(err.instance)} characters long, at most "
            f"{err.validator_value}"
        )
    message, full = err.message, repr(err.instance)
    if message.startswith(full):  # jsonschema's messages start with the value: a long one is cut
        message = _short(err.instance) + message[len(full) :]
    return f"config key {where}: {message[:400]}"


def _all_sources(cfg: dict) -> list[tuple[str, dict]]:
    """(key, item) of every data source: data.sources, then preference.data.sources."""
    out = [(f"data.sources[{i}]", s) for i, s in enumerate((cfg.get("data") or {}).get("sources") or ())]
    pref = ((cfg.get("preference") or {}).get("data") or {}).get("sources") or ()
    return out + [(f"preference.data.sources[{i}]", s) for i, s in enumerate(pref)]


def _source_keys(cfg: dict) -> None:
    """A data source is a file (path, with format and split) or a LLaMA-Factory dataset entry
    (dataset_info with name, whose format the entry decides): never a mix."""
    for where, src in _all_sources(cfg):
        where = f"config key {where}"
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


# The builtin sources of preference.data (preference/data.py makes them).
BUILTIN_PREFERENCE = ("builtin:synthetic_pairs", "builtin:synthetic_kto")


def _check_source(i: int, src: dict, base_dir: Path, key: str = "data.sources") -> None:
    """data.sources[i] (or preference.data.sources[i]): a LLaMA-Factory dataset, the builtin, a
    save_to_disk folder or a data file."""
    preference = key != "data.sources"
    if "dataset_info" in src:
        from llmft.core.lf.lfdataset import LFDatasetError, resolve

        try:
            resolve(src, base_dir, where=f"{key}[{i}]", preference=preference)
        except LFDatasetError as exc:
            raise ConfigError(str(exc)) from None
        return
    path = src["path"]
    if path.startswith("builtin:"):
        builtins = BUILTIN_PREFERENCE if preference else (BUILTIN_DATA,)
        if path not in builtins:
            raise ConfigError(
                f"config key {key}[{i}].path: unknown builtin {path!r} (only {', '.join(builtins)})"
            )
        return
    full = Path(path) if Path(path).is_absolute() else base_dir / path
    problem = path_problem(full)
    if problem == "not found":
        raise ConfigError(f"config key {key}[{i}].path: dataset file not found: {full}")
    if problem:
        raise ConfigError(f"config key {key}[{i}].path: {full} {problem}")
    if full.is_dir():
        # A folder counts only when datasets' save_to_disk wrote it (a Dataset or a DatasetDict).
        if not ((full / "state.json").is_file() or (full / "dataset_dict.json").is_file()):
            raise ConfigError(
                f"config key {key}[{i}].path: {full} is a folder but not one written by "
                "datasets' save_to_disk (no state.json or dataset_dict.json)"
            )
        return
    if full.stat().st_size == 0:
        raise ConfigError(f"config key {key}[{i}].path: {full} is empty")
    if full.suffix not in (".json", ".jsonl", ".parquet"):
        raise ConfigError(f"config key {key}[{i}].path: {full.name} is not .json, .jsonl or .parquet")


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
    needs = _remote_code(full)
    if needs:
        raise ConfigError(
            f"config key model.name_or_path: {needs} only loads with the folder's own Python code "
            "(auto_map), which llmft never runs (a job would stop at transformers' [y/N] prompt); use a "
            "model type transformers has built in"
        )

    from llmft.core.modelfiles import folder_problems

    problems = folder_problems(full)
    if problems:
        raise ConfigError("config key model.name_or_path: " + "; ".join(problems))


def _remote_code(folder: Path) -> str | None:
    """The file of a model folder whose model or tokenizer transformers can load only by running code
    shipped in the folder: an auto_map whose model_type / tokenizer_class it lacks. None otherwise."""
    from llmft.core.io import read_optional

    config = read_optional(folder / "config.json", {})
    tok = read_optional(folder / "tokenizer_config.json", {})
    if not (isinstance(config, dict) and isinstance(tok, dict)) or not (
        "auto_map" in config or "auto_map" in tok
    ):
        return None
    import transformers  # only for a folder that ships code: the import takes seconds
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "auto_map" in config and config.get("model_type") not in CONFIG_MAPPING_NAMES:
        return f"{folder / 'config.json'} (model_type {config.get('model_type')!r})"
    cls = str(tok.get("tokenizer_class") or "")
    if "auto_map" in tok and cls and not hasattr(transformers, cls):
        return f"{folder / 'tokenizer_config.json'} (tokenizer_class {cls!r})"
    return None


def _check_lf_names(cfg: dict) -> None:
    """model.template and sft.extra against the installed LLaMA-Factory's names."""
    from llmft.core.lf.lfnames import closest, names

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
    remote = [k for k in REMOTE_CODE_EXTRA if cfg["sft"]["extra"].get(k, False) is not False]
    if remote:
        raise ConfigError(
            f"config key sft.extra.{remote[0]}: llmft never runs Python code from a model folder (a job "
            "would stop at transformers' [y/N] prompt or run the folder's code); remove the key and use a "
            "model type transformers has built in"
        )
    fp8 = [k for k in FP8_EXTRA if k in cfg["sft"]["extra"]]
    if fp8:
        raise ConfigError(
            f"config key sft.extra.{fp8[0]}: LLaMA-Factory's FP8 flag falls back to bf16 without an error "
            "(Accelerate reports fp8 enabled: False); remove it and set sft.fp8 (true or auto), which "
            "llmft applies itself with torchao float8"
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
    for i, src in enumerate(((cfg.get("preference") or {}).get("data") or {}).get("sources") or ()):
        _check_source(i, src, base_dir, "preference.data.sources")
    _check_model(cfg["model"]["name_or_path"], base_dir)
    _check_lf_names(cfg)
    if cfg["sft"]["offload"] is True and cfg["sft"]["zero_stage"] not in (3, "auto"):
        raise ConfigError("config key sft.offload: offload needs sft.zero_stage: 3 (or auto)")
    _finetuning_checks(cfg["sft"], on_cpu=runs_on_cpu(hw))
    _schedule_checks(cfg)
    if cfg.get("preference") is not None:
        _preference_checks(cfg["preference"])
    elif is_preference_metric(cfg["nightly"]["metric"]):
        raise ConfigError(
            f"config key nightly.metric: {cfg['nightly']['metric']} needs a preference stage (config "
            "key preference); set one or gate on another metric"
        )


# nightly.metric values that the preference stage's evaluation produces (held-out pairs, not rows).
PREFERENCE_METRICS = ("preference_accuracy", "reward_margin")
# The held-out metrics of a model's evaluation (evaluate): summary.json's base and tuned, and the
# nightly gate's scores of both models on a held-out nightly.metric.
HELDOUT_METRICS = ("eval_loss", "perplexity", "exact_match", "rouge_1", "rouge_2", "rouge_l", "bleu_4")
# The nightly gate's verdict in a run's folder: written by the gate rule (llmft.nightly.gate), read by
# the run's report and by the nightly.
GATE_FILE = Path("nightly") / "gate.json"


def is_preference_metric(metric: str) -> bool:
    """Whether nightly.metric is scored by the preference stage on its held-out pairs (the config
    check, the DAG's gate jobs and the nightly gate ask this, here only)."""
    return metric in PREFERENCE_METRICS


# preference.* keys that only one method or loss reads: (key, who reads it, the test).
PREFERENCE_ONLY = (
    ("simpo_gamma", "preference.loss: simpo", lambda p: p["method"] == "dpo" and p["loss"] == "simpo"),
    ("ftx", "preference.method: dpo", lambda p: p["method"] == "dpo"),
    ("group_by_length", "preference.method: dpo", lambda p: p["method"] == "dpo"),
    ("padding_free", "preference.method: dpo", lambda p: p["method"] == "dpo"),
    ("kto_desirable_weight", "preference.method: kto", lambda p: p["method"] == "kto"),
    ("kto_undesirable_weight", "preference.method: kto", lambda p: p["method"] == "kto"),
)


@functools.cache
def _preference_defaults() -> dict:
    props = load_schema()["properties"]["preference"]["properties"]
    return {k: v.get("default") for k, v in props.items()}


def _preference_checks(pref: dict) -> None:
    """Keys a method or loss does not read are refused by name, as LLaMA-Factory would ignore them."""
    defaults = _preference_defaults()
    if pref["method"] == "kto" and pref["loss"] != defaults["loss"]:
        raise ConfigError(
            f"config key preference.loss: {pref['loss']!r} but preference.method kto has no loss choice "
            "(LLaMA-Factory's kto stage has its own); remove the key or set method: dpo"
        )
    for key, who, reads in PREFERENCE_ONLY:
        if pref[key] != defaults[key] and not reads(pref):
            raise ConfigError(
                f"config key preference.{key}: {pref[key]!r} is only used with {who}; remove the key"
            )
    if uses_reference(pref) is False and pref["reference"] != "auto":
        raise ConfigError(
            f"config key preference.reference: {pref['reference']!r} but preference.loss "
            f"{pref['loss']} uses no reference model; remove the key (or use loss: sigmoid)"
        )


def uses_reference(pref: dict) -> bool:
    """Whether the preference loss compares the policy with a frozen reference model (LLaMA-Factory's
    use_ref_model: dpo's sigmoid loss, and kto)."""
    return pref["method"] == "kto" or pref["loss"] == "sigmoid"


@functools.cache
def _run_pattern() -> re.Pattern:
    return re.compile(load_schema()["properties"]["run"]["pattern"])


def is_run_name(name: str) -> bool:
    """Whether config key run accepts `name` (the schema's pattern; not current or nightly)."""
    return bool(_run_pattern().fullmatch(name)) and name not in RESERVED_RUNS


@functools.cache
def _sft_defaults() -> dict:
    return {k: v.get("default") for k, v in load_schema()["properties"]["sft"]["properties"].items()}


def sft_default(key: str):
    """The schema's default of sft.<key>."""
    return copy.deepcopy(_sft_defaults()[key])


def _schedule_checks(cfg: dict) -> None:
    """sft.lr_scheduler_type and the preference stage's: what their transformers schedule needs before
    it starts (else the training job fails at its first step), and sft.decay_ratio only where a
    warmup_stable_decay schedule reads it."""
    sft = cfg["sft"]
    kwargs = sft["extra"].get("lr_scheduler_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ConfigError(
            f"config key sft.extra.lr_scheduler_kwargs: {kwargs!r} is not a mapping; write it as one "
            "(e.g. {min_lr_rate: 0.1})"
        )
    stages = [("sft", sft["lr_scheduler_type"], sft["warmup_ratio"])]
    if cfg.get("preference") is not None:
        pref = cfg["preference"]
        stages.append(("preference", pref["lr_scheduler_type"], pref["warmup_ratio"]))
    for where, kind, warmup in stages:
        if kind in NEEDS_MIN_LR and not {"min_lr", "min_lr_rate"} & set(kwargs):
            raise ConfigError(
                f"config key {where}.lr_scheduler_type: {kind} needs min_lr or min_lr_rate in "
                "sft.extra.lr_scheduler_kwargs (e.g. {min_lr_rate: 0.1}); set one, or choose cosine"
            )
        if reads_ratio(kind, kwargs) and warmup + sft["decay_ratio"] > 1:
            raise ConfigError(
                f"config key sft.decay_ratio: {sft['decay_ratio']} and {where}.warmup_ratio {warmup} add up "
                f"to more than all the steps ({where}.lr_scheduler_type: {WSD} warms up, holds the peak "
                "rate, then decays); make their sum at most 1"
            )
    if sft["decay_ratio"] != sft_default("decay_ratio"):
        if all(kind != WSD for _, kind, _ in stages):
            raise ConfigError(
                f"config key sft.decay_ratio: {sft['decay_ratio']!r} is only used with lr_scheduler_type: "
                f"{WSD} (sft.lr_scheduler_type is {sft['lr_scheduler_type']!r}); remove the key or set that "
                "schedule"
            )
        given = sorted(STEP_KEYS & set(kwargs))
        if given:
            raise ConfigError(
                f"config key sft.decay_ratio: {sft['decay_ratio']!r} is not read when "
                f"sft.extra.lr_scheduler_kwargs gives {given[0]}; remove one of the two"
            )


def fp8_blocker(sft: dict) -> str | None:
    """Why the rest of the sft config rules FP8 out, whatever the nodes (None: nothing does)."""
    if sft["precision"] != "bf16":
        return f"sft.precision is {sft['precision']} (FP8 runs with bf16 around its matmuls)"
    if sft["quantization_bit"] != "none":
        return f"sft.quantization_bit is {sft['quantization_bit']} (QLoRA's base is already quantized)"
    return None


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
    if sft["fp8"] is True:
        blocker = fp8_blocker(sft)
        if blocker:
            raise ConfigError(f"config key sft.fp8: true but {blocker}; set sft.fp8: auto or false")
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
    return hardware_layout(cfg["hardware"])


def hardware_layout(hw: dict) -> Layout:
    """The hardware section's processes per node resolved (0: one per GPU, 2 on CPU), and the world size."""
    ppn = hw["processes_per_node"] or (hw["gpus_per_node"] or 2)
    return Layout(hw["nodes"], hw["gpus_per_node"], ppn)


def runs_on_cpu(hw: dict) -> bool:
    """Whether the hardware section's training runs on CPU processes (vendor cpu, or no GPUs per node)."""
    return hw["vendor"] == "cpu" or hw["gpus_per_node"] == 0


def check_yaml_file(path: str | Path) -> None:
    """Refuse a YAML config whose aliases expand past MAX_VALUES values, naming the file and key.

    Run before anything loads the file: Snakemake's own loader copies every mapping an alias repeats,
    so an alias bomb of mappings costs its whole expanded size there. The file is only composed (a
    node graph in which an alias is the node it names), and each node's expanded size is counted
    once: time linear in the file. A file that is missing or not YAML is left to the loader's error.
    """
    try:
        root = yaml.compose(Path(path).read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to read") from None
    sizes: dict[int, int] = {}

    def size(node) -> int:
        if id(node) not in sizes:
            sizes[id(node)] = 1  # a node that contains itself counts once (PyYAML builds such a cycle)
            if isinstance(node, yaml.MappingNode):
                children = [v for kv in node.value for v in kv]
            elif isinstance(node, yaml.SequenceNode):
                children = node.value
            else:
                children = []
            sizes[id(node)] = min(1 + sum(size(c) for c in children), MAX_VALUES + 1)
        return sizes[id(node)]

    if root is None or size(root) <= MAX_VALUES:
        return
    keys, node = [], root
    while isinstance(node, yaml.MappingNode) and len(keys) < 3:  # down the largest value
        key, node = max(node.value, key=lambda kv: size(kv[1]))
        keys.append(str(key.value))
    raise ConfigError(
        f"{path}: config key {_key(keys)} expands to more than {MAX_VALUES} values (a YAML alias "
        "repeated inside aliases?); write the values out, or remove the key"
    )


# The Snakefile's `configfile:`, which Snakemake reads first, relative to the working directory.
WORKFLOW_CONFIG = "config/config.yaml"
# `snakemake --config` keys: what Snakemake accepts.
_CONFIG_ARG_KEY = re.compile(r"[a-zA-Z_][\w-]*\w$")


def read_config_file(path: str | Path) -> dict:
    """The mapping in a YAML config file, or the JSON one render_sft_config writes for sft (JSON is
    read as JSON: YAML would read its `1e-05` as text). A missing, unreadable or malformed file is a
    ConfigError naming it."""
    path = Path(path)
    kind = "JSON" if path.suffix == ".json" else "YAML"
    if kind == "YAML":
        check_yaml_file(path)
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh) if kind == "JSON" else yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it: {exc.strerror or exc}") from None
    except (ValueError, yaml.YAMLError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"config file {path}: not valid {kind}: {' '.join(str(exc).split())}") from None
    if not isinstance(raw, (dict, type(None))):
        raise ConfigError(
            f"config file {path}: must be a mapping of keys to values, not a {type(raw).__name__}"
        )
    return raw or {}


def load_file(path: str | Path, overrides: dict | None = None) -> dict:
    """Read a config file (read_config_file), deep-merge overrides (e.g. from --overrides) over it,
    and validate it."""
    raw = read_config_file(path)
    if overrides:
        raw = deep_merge(raw, overrides)
    return validate(raw, base_dir=Path.cwd())


def parse_config_args(entries: list[str]) -> dict:
    """`snakemake --config key=value ...` as Snakemake reads it: quotes around the value stripped,
    then the first of int, float, True/False and YAML (every scalar in it as text) that reads it."""
    out: dict = {}
    for entry in entries:
        key, sep, text = entry.partition("=")
        if not sep or not _CONFIG_ARG_KEY.match(key):
            raise ConfigError(
                f"--config {entry!r}: not key=value with key a name (as `snakemake --config` takes); "
                "a config file goes in --configfile"
            )
        text = text.strip("'\"")
        out = deep_merge(out, {key: _config_arg_value(text) if text else None})
    return out


def _config_arg_value(text: str):
    for parse in (int, float, {"True": True, "False": False}.__getitem__):
        try:
            return parse(text)
        except (ValueError, KeyError):
            pass
    try:
        return yaml.load(text, Loader=yaml.BaseLoader)
    except yaml.YAMLError:
        return text


def effective_config(configfiles=(), config_args=(), workdir: str | Path = ".") -> tuple[dict, list[str]]:
    """The validated config a `snakemake --configfile F... --config k=v...` run in `workdir` gets,
    merged as Snakemake merges it: WORKFLOW_CONFIG first, then each file in order, then the
    key=value pairs, each deep-merged over the last; then the schema's defaults. Also the sources,
    in that order. Without WORKFLOW_CONFIG Snakemake goes on only when files are given."""
    workdir = Path(workdir)
    base = workdir / WORKFLOW_CONFIG
    if not base.is_file() and not configfiles:
        raise ConfigError(f"config file {base}: not found, and no --configfile given")
    files = ([base] if base.is_file() else []) + [Path(f) for f in configfiles]
    raw: dict = {}
    for path in files:
        raw = deep_merge(raw, read_config_file(path))
    raw = deep_merge(raw, parse_config_args(list(config_args)))
    sources = [str(f) for f in files] + ([f"--config {' '.join(config_args)}"] if config_args else [])
    return validate(raw, base_dir=workdir), sources


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
