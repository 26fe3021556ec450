"""What every stage's CLI commands share (llmft.__main__ collects them): the config argument (a file,
overrides or Snakemake's JSON slice), `add` for a subcommand with its paths, --max-rows, the data
sources as the preparers read them and the chat template's fit check."""

from __future__ import annotations

import argparse
import json

from llmft.core.config import ConfigError, load_file, validate
from llmft.core.settings import Config, Model

CONFIG_HELP = "the config file: YAML, or the JSON render-sft writes"
YAML_HELP = "the llamafactory.yaml render-sft wrote"
VERIFY_HELP = "verify_env's verify.json (the nodes' facts)"


def json_arg(text: str, flag: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{flag}: not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: must be a JSON object of config keys, not {type(value).__name__}")
    return value


def rows_arg(text: str) -> int | str:
    """--max-rows: a positive row count, or all."""
    if text == "all":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive row count or all")
    return int(text)


def add_max_rows(p) -> None:
    """evaluate's and evaluate-preference's --max-rows (the nightly gate passes all, or its cap)."""
    p.add_argument(
        "--max-rows",
        type=rows_arg,
        default=None,
        help="held-out rows scored: N (the first N) or all; default eval.max_rows",
    )


def config_of(args) -> dict:
    """The validated config: a JSON slice from Snakemake, or a YAML file plus overrides."""
    if args.config_json:
        return validate(json_arg(args.config_json, "--config-json"))
    overrides = json_arg(args.overrides, "--overrides") if args.overrides else None
    return load_file(args.config, overrides)


def settings_of(args) -> Config:
    """The validated config as its typed sections, built once for the command (config_of's dict)."""
    return Config.from_dict(config_of(args))


def adder(sub):
    """`add(name, fn, *paths)`: a subcommand taking the config (file, overrides or Snakemake's JSON)
    and the named paths, each `flag=help` (`flag?=help`: optional); `config=False`: no config."""

    def add(name, fn, *paths, help, parent=sub, config=True):
        p = parent.add_parser(name, help=help, description=help)
        if config:
            p.add_argument("--config", default="config/config.yaml", help=CONFIG_HELP)
            p.add_argument("--overrides", default="", help="JSON merged over the config file")
            p.add_argument("--config-json", default="", help="a whole config as JSON (from Snakemake)")
        for spec in paths:
            flag, _, text = spec.partition("=")
            p.add_argument(f"--{flag.rstrip('?')}", required=not flag.endswith("?"), help=text)
        p.set_defaults(fn=fn)
        return p

    return add


def read_sources(items: list[dict], key: str, builtin: dict) -> list[dict]:
    """Source items as the preparers read them: a dataset_info entry resolved to its file, format and
    columns (lfdataset); a builtin path replaced as `builtin` says (kept when it names none)."""
    from llmft.core.lf.lfdataset import LFDatasetError
    from llmft.core.lf.lfdataset import resolve as resolve_lf_entry

    sources = []
    for i, src in enumerate(items):
        if src.get("dataset_info"):
            try:
                entry = resolve_lf_entry(src, where=f"{key}[{i}]", preference=key != "data.sources")
            except LFDatasetError as exc:
                raise ConfigError(str(exc)) from None
            keep = {"path": entry["path"], "format": entry["format"], "attr": entry["attr"]}
            sources.append({k: v for k, v in src.items() if k == "weight"} | keep)
            continue
        sources.append({**src, "path": builtin.get(src["path"], src["path"])})
    return sources


def template_for(model: Model, tokenizer: str) -> str:
    """The model section's template for the model in `tokenizer`, with the fit check of the DAG here
    too: the builtin model's folder did not exist then."""
    from llmft.core.lf.chat_templates import check as check_template
    from llmft.core.lf.chat_templates import for_model as template_for_model

    template, _ = template_for_model(model, tokenizer)
    check_template(template, tokenizer)
    return template
