"""The dataset preparation stage's CLI commands (base-model, synthetic, prepare-data), which
llmft.__main__ collects."""

from __future__ import annotations

import dataclasses
import json

from llmft.core.cli import read_sources, settings_of, template_for
from llmft.core.config import BUILTIN_DATA
from llmft.core.imports import UNUSED, UNUSED_BY_INFERENCE
from llmft.core.settings import Config


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


def register(add) -> dict:
    """Add the commands of dataset preparation and the demo's inputs through llmft.core.cli.adder's
    `add`; return the packages each command's libraries would import for nothing there
    (llmft.core.imports.hidden)."""
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
    return {
        cmd_base_model: UNUSED_BY_INFERENCE + ("deepspeed",),
        cmd_prepare_data: UNUSED + ("torchao",),
    }
