"""Continuing from an earlier run (model.continue_from): the parent's checks, its lineage, and the
weights and learning rate a continued run starts from.

The parent is resolved once, when the workflow is parsed: a link such as results/current becomes the
run folder it points at, and that folder is what every job sees, so a link moved later (a promotion)
changes no running job. Each refusal names the key, the parent run and both values, before any job.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

import yaml
from llmft.core.assets import build_tokenizer
from llmft.core.config import BUILTIN_MODEL, ConfigError, is_run_name
from llmft.core.io import read_json, read_optional
from llmft.core.settings import Config, Model, replace

KEY = "config key model.continue_from"
# prepare_data's record of every train row of the split (before a continued run's selection): sorted
# distinct 64-bit content keys, the identity dedup and the split use. A continued run's new rows are
# the ones whose key its parent's file lacks.
TRAIN_KEYS_FILE = "train_keys.u64"
# A run's lineage record, beside its other folders (llmft.core.lineage_record writes it).
LINEAGE_FILE = "lineage.json"


def parent_of(cfg: Config, base_dir: str | Path = ".") -> Path | None:
    """The parent run folder of a config (model.continue_from resolved), or None."""
    if not cfg.model.continues:
        return None
    path = Path(cfg.model.continue_from)
    return path if path.is_absolute() else Path(base_dir) / path


def _display(path: Path, base_dir: Path) -> str:
    try:
        return os.path.relpath(path, base_dir) if path.is_relative_to(base_dir) else str(path)
    except ValueError:
        return str(path)


def resolve(cfg: Config, base_dir: str | Path = ".") -> tuple[Config, dict | None]:
    """Check model.continue_from; return the config with it set to the run folder it names (a link
    followed), and that parent's lineage head (lineage_head), or None when the config does not
    continue (the config then as it was)."""
    base_dir = Path(base_dir).resolve()
    given = cfg.model.continue_from
    if not cfg.model.continues:
        return cfg, None
    path = Path(given) if Path(given).is_absolute() else base_dir / given
    if not path.exists():
        raise ConfigError(f"{KEY}: {given} does not exist (no run folder there); run it first, or set null")
    real = path.resolve()
    if not real.is_dir() or not is_run_name(real.name):
        raise ConfigError(f"{KEY}: {given} is not a run folder results/<run>")
    clash = sorted({"adapter_name_or_path", "create_new_adapter"} & set(cfg.sft.extra))
    if clash:
        raise ConfigError(
            f"config key sft.extra.{clash[0]}: set by model.continue_from (the parent's adapter, trained "
            "on); remove it"
        )
    if real.name == cfg.run:
        real = _recorded_parent(cfg, base_dir, given)
    shown = _display(real, base_dir)
    cfg = replace(cfg, "model.continue_from", shown)
    _check_finished(real, cfg.sft.finetuning_type)
    # paths as the jobs see them: relative to the working directory
    head = lineage_head(Path(shown), cwd=base_dir)
    _check_compatible(cfg, real, head, base_dir)
    return cfg, head


def _recorded_parent(cfg: Config, base_dir: Path, given: str) -> Path:
    """A link to this run itself (results/current after the run was promoted): the parent this run
    recorded when it trained, else a refusal."""
    recorded = read_optional(base_dir / "results" / cfg.run / "sft" / "config.json", {}) or {}
    parent = (recorded.get("model") or {}).get("continue_from")
    if parent and Path(parent).name != cfg.run and (base_dir / parent).is_dir():
        return (base_dir / parent).resolve()
    raise ConfigError(
        f"{KEY}: {given} is run {cfg.run!r} itself (config key run); a run continues from an "
        "earlier run: name another one"
    )


def _check_finished(parent: Path, kind: str) -> None:
    """The parent ran to the end (run_problems: its page's summary.json, a whole published model and
    LoRA's adapter) and left what a continued run reads: its rendered YAML and prepare_data's train
    keys."""
    name = parent.name
    stats = read_optional(parent / "data" / "stats.json", {}) or {}
    # a run prepared before train_keys.u64 existed trained every train row: its train.jsonl has them
    keys = f"data/{TRAIN_KEYS_FILE}" if "continue" in stats else "data/train.jsonl"
    need = ["report/summary.json", "sft/llamafactory.yaml", "sft/model/config.json", keys, "data/stats.json"]
    if kind == "lora":
        need += ["sft/adapter/adapter_config.json", "sft/adapter/adapter_model.safetensors"]
    missing = [n for n in need if not (parent / n).is_file()]
    if missing:
        raise ConfigError(
            f"{KEY}: run {name!r} is not a finished run (no {', '.join(missing)}); finish it "
            "(snakemake --config run=" + name + ") or continue from another run"
        )
    problems = run_problems(parent)
    if problems:
        raise ConfigError(f"{KEY}: run {name!r} has a broken published model: " + "; ".join(problems))


def published_problems(run_dir: Path, stages: tuple[str, ...] = ("sft", "preference")) -> list[str]:
    """Whether the run's published folders (each stage's model and LoRA adapter) still hold what
    their stage published: each against its seal (modelfiles.seal_problems; a folder unchanged
    since it was last verified is not read again). A stage whose train_summary.json says it sealed
    its folders and a folder without the seal is a problem too; runs published before seals are
    checked by their headers only."""
    from llmft.core.modelfiles import SEAL, seal_problems

    problems = []
    for stage in stages:
        summary = read_optional(run_dir / stage / "train_summary.json", {})
        sealed = isinstance(summary, dict) and summary.get("seal") == SEAL
        for name in ("model", "adapter"):
            folder = run_dir / stage / name
            if not folder.is_dir():
                continue
            if sealed and not (folder / SEAL).is_file() and (name == "model" or summary.get("adapter")):
                problems.append(f"{folder / SEAL} is missing: the folder was changed since it was published")
            problems += seal_problems(folder)
    return problems


def run_problems(run_dir: Path) -> list[str]:
    """Why a run folder is not a finished run a model can be taken from: no summary.json, no whole
    published model (sft/model), LoRA's adapter missing, a published file changed since it was
    published (published_problems: content hashes, read again only for files that changed)."""
    from llmft.core.modelfiles import folder_problems, safetensors_problem

    if not run_dir.is_dir():
        return [f"{run_dir} does not exist"]
    problems = []
    summary = run_dir / "report" / "summary.json"
    try:
        if not isinstance(read_json(summary), dict):
            problems.append(f"{summary} is not a JSON object")
    except (OSError, ValueError) as exc:
        problems.append(f"{summary} cannot be read ({type(exc).__name__}): the run did not finish")
    model = run_dir / "sft" / "model"
    if not model.is_dir():
        problems.append(f"{model} does not exist: no published model")
    else:
        problems += folder_problems(model)
        if not any(model.glob("*.safetensors")):
            problems.append(f"{model} holds no *.safetensors weights")
    if _run_config(run_dir).get("finetuning_type") == "lora" or (run_dir / "sft" / "adapter").exists():
        adapter = run_dir / "sft" / "adapter"
        weights = adapter / "adapter_model.safetensors"
        if not (adapter / "adapter_config.json").is_file() or not weights.is_file():
            problems.append(f"{adapter} has no adapter_config.json and adapter_model.safetensors")
        elif problem := safetensors_problem(weights):
            problems.append(f"{weights} is not a whole safetensors file: {problem}")
    return problems + published_problems(run_dir, ("sft",))


def _run_config(run_dir: Path) -> dict:
    """The run's sft settings as its sft step read them (sft/config.json), {} when absent."""
    try:
        cfg = read_json(run_dir / "sft" / "config.json")
        return cfg.get("sft", {}) if isinstance(cfg, dict) else {}
    except (OSError, ValueError):
        return {}


def parent_args(parent: Path) -> dict:
    """The LLaMA-Factory arguments the parent trained with (its rendered YAML)."""
    try:
        args = yaml.safe_load((parent / "sft" / "llamafactory.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{KEY}: run {parent.name!r}: sft/llamafactory.yaml unreadable: {exc}") from None
    if not isinstance(args, dict):
        raise ConfigError(f"{KEY}: run {parent.name!r}: sft/llamafactory.yaml is not a mapping")
    return args


def _check_compatible(cfg: Config, parent: Path, head: dict, base_dir: Path) -> None:
    """Same base model, finetuning type, template, tokenizer and held-out split as the parent."""
    name, args = parent.name, parent_args(parent)
    pairs = [
        ("model.name_or_path", cfg.model.name_or_path, head["base_model"], "descends from"),
        (
            "sft.finetuning_type",
            cfg.sft.finetuning_type,
            args.get("finetuning_type", "full"),
            "trained",
        ),
        ("model.template", cfg.model.template, args.get("template"), "used template"),
    ]
    stats = read_optional(parent / "data" / "stats.json", {}) or {}
    data = cfg.data
    pairs += [
        ("data.heldout_fraction", data.heldout_fraction, stats.get("heldout_fraction"), "split with"),
        ("data.split_salt", data.split_salt, stats.get("split_salt"), "split with"),
    ]
    for key, ours, theirs, verb in pairs:
        if ours != theirs:
            why = " (the held-out split would move)" if key.startswith("data.") else ""
            raise ConfigError(
                f"config key {key}: {ours!r}, but model.continue_from run {name!r} {verb} {theirs!r}{why}; "
                "make them the same or train from name_or_path (model.continue_from: null)"
            )
    ours_tok = tokenizer_fingerprint(cfg.model, base_dir)
    theirs_tok = folder_tokenizer(parent / "sft" / "model")
    if ours_tok != theirs_tok:
        raise ConfigError(
            f"config key model.name_or_path: its tokenizer ({ours_tok[:12]}) differs from the one of "
            f"model.continue_from run {name!r} ({theirs_tok[:12]}, sft/model); continue only with the "
            "parent's tokenizer"
        )


def folder_tokenizer(folder: Path) -> str:
    """A tokenizer's identity: a hash of tokenizer.json as parsed (else tokenizer.model's bytes)."""
    tj, tm = folder / "tokenizer.json", folder / "tokenizer.model"
    try:
        if tj.is_file():
            text = json.dumps(json.loads(tj.read_text(encoding="utf-8")), sort_keys=True)
            return hashlib.sha256(text.encode()).hexdigest()
        if tm.is_file():
            return hashlib.sha256(tm.read_bytes()).hexdigest()
    except (OSError, ValueError):
        return "unreadable"
    return "none"


@functools.cache
def _builtin_tokenizer(vocab_size: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        build_tokenizer(tmp, vocab_size)
        return folder_tokenizer(Path(tmp))


def tokenizer_fingerprint(model: Model, base_dir: Path) -> str:
    """This config's tokenizer identity (builtin:tiny's is built, as its rule builds it)."""
    name = model.name_or_path
    if name == BUILTIN_MODEL:
        return _builtin_tokenizer(model.tiny.vocab_size)
    return folder_tokenizer(Path(name) if Path(name).is_absolute() else base_dir / name)


def lineage_head(parent: Path | None, base_model: str | None = None, cwd: Path = Path(".")) -> dict:
    """parent / started_from / base_model / chain of a run whose parent is `parent` (None: a run from
    its base model `base_model`); `parent` as the jobs name it, read relative to `cwd`."""
    if parent is None:
        return {"parent": None, "started_from": base_model, "base_model": base_model, "chain": []}
    try:
        theirs = recorded_lineage(cwd / parent)
    except (OSError, ValueError):
        theirs = {}
    adapter = (cwd / parent / "sft" / "adapter" / "adapter_config.json").is_file()
    started = parent / "sft" / ("adapter" if adapter else "model")
    return {
        "parent": parent.name,
        "started_from": str(started),
        "base_model": theirs.get("base_model") if theirs else _older_base(cwd / parent),
        "chain": [*(theirs.get("chain") or []), parent.name],
    }


def recorded_lineage(run_dir: Path) -> dict:
    """The lineage a finished run recorded: its lineage.json; a run made before lineage.json
    existed: its summary.json's `lineage` ({} for a run made before lineage: from its base model).
    A file it reads that cannot be read raises (OSError, ValueError)."""
    path = run_dir / LINEAGE_FILE
    if path.is_file():
        record = read_json(path)
    else:
        path = run_dir / "report" / "summary.json"
        summary = read_json(path)
        if not isinstance(summary, dict):
            raise ValueError(f"{path} is not a JSON object")
        record = summary.get("lineage") or {}
    if not isinstance(record, dict):
        raise ValueError(f"{path}: the lineage is not a JSON object")
    return record


def _older_base(parent: Path) -> str | None:
    """The base model of a run made before lineage existed (it started from its base): the model its
    YAML trained, builtin:tiny where that is the run's own built base_model folder."""
    try:
        name = str(parent_args(parent).get("model_name_or_path"))
    except ConfigError:
        return None
    return base_model_name(name, parent.name)


def base_model_name(folder: str, run: str) -> str:
    """model.name_or_path as the user wrote it, from the base model folder a stage was given:
    builtin:tiny where that is the run's own built `results/<run>/base_model` folder."""
    return BUILTIN_MODEL if Path(folder) == Path("results") / run / "base_model" else folder


def continue_learning_rate(cfg: Config) -> float:
    """The peak learning rate of a continued run's fresh schedule."""
    night = cfg.nightly
    if night.continue_learning_rate is not None:
        return night.continue_learning_rate
    return night.continue_learning_rate_factor * cfg.sft.learning_rate


def continue_epochs(cfg: Config) -> float:
    """The epochs of a continued run's fresh schedule (nightly.continue_epochs, else sft's)."""
    epochs = cfg.nightly.continue_epochs
    return cfg.sft.num_train_epochs if epochs is None else epochs


def run_epochs(cfg: Config) -> float:
    """The epochs this run trains: continue_epochs in a continued run, else sft.num_train_epochs."""
    return continue_epochs(cfg) if cfg.model.continues else cfg.sft.num_train_epochs


def start_args(cfg: Config, base_model: str) -> dict:
    """LLaMA-Factory's model arguments of a continued run: full/freeze load the parent's published
    model; LoRA loads the base and the parent's adapter, and trains that adapter on (not a new one)."""
    parent = parent_of(cfg)
    if parent is None:
        return {"model_name_or_path": base_model}
    if cfg.sft.finetuning_type == "lora":
        return {
            "model_name_or_path": base_model,
            "adapter_name_or_path": str(parent / "sft" / "adapter"),
            "create_new_adapter": False,
        }
    return {"model_name_or_path": str(parent / "sft" / "model")}


def fed_tokens(rows: int, tokens: int, steps: dict) -> int:
    """The tokens the trainer feeds (what its num_input_tokens_seen counts) when it trains `rows` rows
    holding `tokens` tokens in one pass (prompt + answer, as prepare_data counts them), under
    `steps` (training_steps).

    Every pass gives each of the `world` processes whole micro-batches: ceil(rows / (world x
    micro_batch)) x world x micro_batch rows, the sampler repeating the pass's first rows to fill the
    last ones (Accelerate's even_batches); the repeated rows count at the mean row length. Times
    num_train_epochs; with max_steps set, max_steps x accumulation x world x micro_batch rows instead.
    Packed rows (sft.packing) count one pass's tokens per epoch, the last step's fill not counted."""
    if rows <= 0:
        return 0
    per_row = tokens / rows
    batch = steps["world"] * steps["micro_batch"]
    if steps["max_steps"] > 0:
        return round(steps["max_steps"] * steps["accumulation"] * batch * per_row)
    fed = rows if steps["packed"] else -(-rows // batch) * batch
    return round(steps["epochs"] * fed * per_row)


def training_steps(cfg: Config, plan, world: int) -> dict:
    """What fed_tokens needs of a rendered plan: processes, micro-batch, accumulation, epochs (this
    run's, and a retrain's: sft.num_train_epochs)."""
    return {
        "world": world,
        "micro_batch": plan.micro_batch,
        "accumulation": plan.gradient_accumulation,
        "epochs": run_epochs(cfg),
        "retrain_epochs": cfg.sft.num_train_epochs,
        "max_steps": cfg.sft.max_steps,
        "packed": plan.packing != "off",
    }


def run_cost(delta: dict, steps: dict) -> dict | None:
    """This run's tokens and a full retrain's, as the trainer feeds them (fed_tokens), from
    prepare_data's rows and one-pass tokens (stats.json `continue`); None without those."""
    tokens = delta.get("tokens") or {}
    if not tokens.get("trained") or not delta.get("train_rows"):
        return None
    full_rows = delta.get("full_train_rows") or delta["train_rows"]
    return {
        "trained": fed_tokens(delta["train_rows"], tokens["trained"], steps),
        "full_retrain": fed_tokens(
            full_rows,
            tokens["full_retrain"],
            {**steps, "epochs": steps.get("retrain_epochs", steps["epochs"])},
        ),
        "one_pass": {"trained": tokens["trained"], "full_retrain": tokens["full_retrain"]},
        "steps": steps,
    }


def cost_line(tokens: dict | None) -> str:
    """ "trains N tokens, a full retrain would train M: M/N x fewer": run_cost's figures, the tokens
    the trainer feeds (every epoch, the last step's repeated rows included)."""
    if not tokens or not tokens.get("trained"):
        return ""
    n, m = tokens["trained"], tokens["full_retrain"]
    return f"trains {n:,} tokens, a full retrain would train {m:,}: {m / n:.1f}x fewer"


def chain_text(lineage: dict) -> str:
    """base model -> root run -> ... -> parent -> this run."""
    return " -> ".join([str(lineage.get("base_model")), *(lineage.get("chain") or []), "this run"])
