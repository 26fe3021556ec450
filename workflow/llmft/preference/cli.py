"""The preference stage's CLI commands, which llmft.__main__ collects: prepare-preference,
reference-logps, evaluate-preference, and its training view for render-sft / plan --stage preference
(TRAINING)."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path

from llmft.core.cli import add_max_rows, read_sources, settings_of, template_for
from llmft.core.config import ConfigError
from llmft.core.imports import UNUSED, UNUSED_BY_INFERENCE
from llmft.core.settings import Config
from llmft.preference import stage
from llmft.preference.reference import SHARD_SEQUENCES, STORE

# render-sft and plan's --stage: the config view and objective sft's planner and renderer take.
TRAINING = {"preference": stage.training}


def pages() -> tuple:
    """The stage's part of the run's page (report's build_report takes it)."""
    from llmft.preference import page

    return (page,)


def cmd_prepare_preference(args) -> int:
    from llmft.preference.data import prepare_preference

    cfg = settings_of(args)
    if cfg.preference is None:
        raise ConfigError("config key preference: not set; prepare-preference needs a preference section")
    data = cfg.preference.data
    sources = read_sources(data.sources, "preference.data.sources", {})
    # Texts are cleaned and rows capped as for the SFT data.
    opts = dataclasses.asdict(data) | {
        "clean_text": cfg.data.clean_text,
        "max_row_bytes": cfg.data.max_row_bytes,
        "method": cfg.preference.method,
    }
    template = template_for(cfg.model, args.tokenizer)
    stats = prepare_preference(sources, args.out_dir, args.tokenizer, template, opts)
    print(json.dumps({k: stats[k] for k in ("kind", "train_rows", "heldout_rows", "invalid", "too_long")}))
    return 0


def cmd_reference_logps(args) -> int:
    """The reference step: the reference model's log-probabilities of every tokenized sequence into
    the shared store (only those it lacks), the run's record to --out."""
    import sys

    from llmft.preference.reference import ReferenceError, reference_pass

    cfg = settings_of(args)
    try:
        record = reference_pass(
            args.model, args.data_dir, args.out, dtype=cfg.sft.precision, store_root=args.store,
            processes=args.processes, shard_sequences=args.shard_sequences, batch_budget=args.batch_tokens,
        )  # fmt: skip
    except ReferenceError as exc:
        print(f"llmft: reference error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: record[k] for k in ("sequences", "computed", "reused", "model", "store")}))
    return 0


def _cached_heldout_logps(args, cfg: Config) -> int:
    """evaluate-preference --logps-only --reference-cache: the reference model's log-probabilities of
    the held-out pairs from the reference store (computing only those it lacks), in the gate's files."""
    import sys

    from llmft.preference.reference import ReferenceError, heldout_logps

    limit = cfg.eval.max_rows if args.max_rows is None else args.max_rows
    out = str(Path(args.out_dir) / "logps.jsonl")
    try:
        heldout_logps(args.model, str(Path(args.heldout).parent), out, limit, cfg.sft.precision,
                      store_root=args.reference_cache)  # fmt: skip
    except ReferenceError as exc:
        print(f"llmft: reference error: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_evaluate_preference(args, evaluation: Callable[[], tuple]) -> int:
    """`evaluation()`: evaluate's loss and generation passes (answer_nll, evaluate), which the CLI
    gives the stage: it imports no other stage."""
    from llmft.preference.evaluate import evaluate_model, logps

    cfg = settings_of(args)
    if args.logps_only and args.reference_cache:  # a reference model's, from the reference store
        return _cached_heldout_logps(args, cfg)
    score_answers, generate = evaluation()
    if args.logps_only:  # the nightly gate's pass: log-probabilities only, no generation
        out = str(Path(args.out_dir) / "logps.jsonl")
        logps(cfg, args.model, args.heldout, out, args.threads, args.max_rows, score_answers=score_answers)
        return 0
    evaluate_model(cfg, args.model, args.heldout, args.out_dir, args.label, args.threads,
                   score_answers=score_answers, generate=generate)  # fmt: skip
    return 0


def register(add, evaluation: Callable[[], tuple]) -> dict:
    """Add the stage's commands through llmft.core.cli.adder's `add` (`evaluation`: see
    cmd_evaluate_preference); return the packages each command's libraries would import for nothing
    there (llmft.core.imports.hidden)."""
    evaluate_preference = functools.partial(cmd_evaluate_preference, evaluation=evaluation)
    add(
        "prepare-preference",
        cmd_prepare_preference,
        "tokenizer=the model folder whose tokenizer tokenizes the rows",
        "out-dir=the folder for train/heldout pairs (or KTO rows), tokenized rows and stats.json",
        help="check, dedup, split and tokenize the preference.data sources (pairs or KTO rows)",
    )
    p = add(
        "reference-logps",
        cmd_reference_logps,
        "model=the reference model's folder",
        "data-dir=prepare_preference's folder (its tokenized/ train and held-out sequences)",
        "out=the run's record (JSON): model and sequence fingerprints, the shards holding them",
        help="the reference model's log-probabilities of every preference sequence, cached by content",
    )
    p.add_argument("--store", default=STORE, help=f"the shared store (default {STORE})")
    p.add_argument("--processes", type=int, default=0, help="0 = one per GPU (one on CPU)")
    p.add_argument("--shard-sequences", type=int, default=SHARD_SEQUENCES, help="sequences per shard file")
    p.add_argument(
        "--batch-tokens", type=int, default=0, help="tokens per forward batch (0 = from free memory)"
    )
    p = add(
        "evaluate-preference",
        evaluate_preference,
        "model=the model folder to score",
        "heldout=the preference stage's held-out pairs or KTO rows (JSONL)",
        "out-dir=the folder for logps.jsonl, metrics.json and predictions.jsonl",
        "label=base, tuned (sft) or preference",
        help="a model's log-probabilities of the held-out preference answers, and generation metrics",
    )
    p.add_argument("--threads", type=int, default=0, help="CPU threads per process (0 = torch default)")
    p.add_argument(
        "--logps-only",
        action="store_true",
        help="log-probabilities only (logps.jsonl, rows.json), no generation: the nightly gate's pass",
    )
    p.add_argument(
        "--reference-cache",
        default="",
        help="with --logps-only: a reference model's log-probabilities from this reference store "
        f"({STORE}; prepare_preference's tokenized pairs beside --heldout), not evaluate's pass",
    )
    add_max_rows(p)
    return {
        cmd_prepare_preference: UNUSED + ("torchao",),
        cmd_reference_logps: UNUSED_BY_INFERENCE,
        evaluate_preference: UNUSED_BY_INFERENCE,
    }
