"""results/<run>/lineage.json, the one record of a run's lineage: what it started from (its parent
run, the weights or adapter, the chain back to the base model), the data delta since the parent
(new, replayed, removed and train rows) and the replay share, the tokens it trains against a full
retrain, and the hash of the software stack it trains on.

Written once, by the lineage rule (`python -m llmft lineage`, after prepare_data and verify_env);
read by render-sft (the YAML's header lines: where training starts, what it costs), the run page and
summary.json's `lineage`, the nightly (how many continued runs in a row) and retention (every run a
kept run descends from), and by a run that continues from this one (its chain). Each reader names
the file when it is missing or was made for other inputs (stale).
"""

from __future__ import annotations

from pathlib import Path

from llmft.core import lineage, stack
from llmft.core.config import ConfigError
from llmft.core.io import read_json, read_optional, write_json
from llmft.core.settings import Config

# summary.json's `lineage`: the record's head, its four row counts, the tokens and the stack
SUMMARY_DATA_KEYS = ("new", "replayed", "removed", "train_rows")
MAKE_IT = "rerun the lineage rule (python -m llmft lineage)"


def run_head(cfg: Config, base_model: str) -> dict:
    """lineage.lineage_head of a run with this config: from its base model (the folder the stage was
    given, as model.name_or_path names it: a stage's config slice does not carry that key), or
    model.continue_from's run."""
    if not cfg.model.continues:
        return lineage.lineage_head(None, lineage.base_model_name(base_model, cfg.run))
    return lineage.lineage_head(Path(cfg.model.continue_from))


def data_rows(stats: dict) -> dict:
    """prepare_data's row counts (stats.json `continue`); an older stats.json without them: every
    train row was new."""
    delta = stats.get("continue") or {}
    keys = (*SUMMARY_DATA_KEYS, "full_train_rows")
    if not delta:
        rows = stats.get("train_rows")
        return {"new": rows, "replayed": 0, "removed": 0, "train_rows": rows, "full_train_rows": rows}
    return {k: delta.get(k) for k in keys}


def build(cfg: Config, base_model: str, stats: dict, steps: dict, stack_hash: str | None) -> dict:
    """The record of run cfg.run: its head (run_head), prepare_data's rows (`stats`: its
    stats.json), the tokens the trainer feeds under `steps` (lineage.training_steps of the plan
    render-sft makes) and a full retrain's (lineage.run_cost; one pass of each without prepare_data's
    counts), and the software stack's hash (llmft.core.stack)."""
    delta = stats.get("continue") or {}
    tokens = lineage.run_cost(delta, steps) or delta.get("tokens") or {"trained": None, "full_retrain": None}
    return {
        "run": cfg.run,
        **run_head(cfg, base_model),
        "data": data_rows(stats),
        "replay": {"fraction": cfg.nightly.replay_fraction if cfg.model.continues else None},
        "tokens": dict(tokens),
        "stack": stack_hash,
        # what it was made from, so a reader can tell a stale record (check)
        "data_fingerprint": stats.get("fingerprint"),
    }


def make(
    cfg: Config, base_model: str, data_dir: str | Path, verify: str | Path, steps: dict, out: str | Path
) -> dict:
    """Write run cfg.run's lineage.json (`out`) from its base model folder, prepare_data's
    stats.json in `data_dir`, verify_env's report `verify` (the stack) and the plan's `steps`."""
    stats = read_optional(Path(data_dir) / "stats.json", {}) or {}
    found = stack.of_report(read_optional(Path(verify), {}) or {})
    record = build(cfg, base_model, stats, steps, found.get("hash") if isinstance(found, dict) else None)
    write_json(out, record)
    return record


def read(path: str | Path) -> dict:
    """The record at `path`; a missing or unreadable file is an error naming it and how to make it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: the run's lineage is recorded there; {MAKE_IT}")
    try:
        record = read_json(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} cannot be read ({exc}); {MAKE_IT}") from None
    if not isinstance(record, dict) or "parent" not in record:
        raise ConfigError(f"{path} is not a lineage record; {MAKE_IT}")
    return record


def check(path: str | Path, record: dict, **expected) -> None:
    """A stale record is an error naming the file and what differs: each `expected` key (run, parent,
    data_fingerprint, stack, steps: the record's tokens.steps) against what the record holds."""
    held = {**record, "steps": (record.get("tokens") or {}).get("steps")}
    for key, want in expected.items():
        if held.get(key) != want:
            raise ConfigError(
                f"{path} is stale: it records {key} {held.get(key)!r}, this run has {want!r}; {MAKE_IT}"
            )


def read_for(path: str | Path, cfg: Config, stats: dict, **expected) -> dict:
    """read, then check against the run cfg.run, its parent (model.continue_from) and its
    prepare_data's stats.json, and `expected`."""
    record = read(path)
    parent = lineage.parent_of(cfg)
    check(
        path,
        record,
        run=cfg.run,
        parent=parent.name if parent else None,
        data_fingerprint=stats.get("fingerprint"),
        **expected,
    )
    return record


def summary_view(record: dict) -> dict:
    """summary.json's `lineage`: parent, started_from, base_model, chain, the four row counts,
    tokens and stack."""
    head = {k: record.get(k) for k in ("parent", "started_from", "base_model", "chain")}
    data = record.get("data") or {}
    return {
        **head,
        "data": {k: data.get(k) for k in SUMMARY_DATA_KEYS},
        "tokens": dict(record.get("tokens") or {"trained": None, "full_retrain": None}),
        "stack": record.get("stack"),
    }
