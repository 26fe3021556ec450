"""prepare() for a continued run (model.continue_from): the rows new since the parent, a deterministic
replay sample of its rows sized as a share of what the run trains, the removed ones counted; the
held-out split never moves."""

import pytest
from llmft.core.assets import synthetic_rows
from llmft.core.config import ConfigError, validate
from llmft.core.io import read_jsonl
from llmft.core.lineage import TRAIN_KEYS_FILE
from llmft.core.lineage import resolve as resolve_parent
from llmft.core.settings import Config
from llmft.core.sources import DataError
from llmft.data.delta import read_keys
from llmft.data.prepare import content_key, is_heldout, prepare

from tests.unit.data.test_prepare import write_rows


def distinct(rows):
    seen, out = set(), []
    for r in rows:
        if content_key(r) not in seen:
            seen.add(content_key(r))
            out.append(r)
    return out


ROWS = distinct(synthetic_rows(1200, seed=3))[:500]
PARENT, CHILD = ROWS[:400], ROWS[25:]  # 25 removed, 100 appended


def prep(tmp_path, tokenizer_dir, rows, name, parent=None, salt="s"):
    src = write_rows(tmp_path / f"{name}.jsonl", rows)
    return prepare(
        [{"path": str(src)}], tmp_path / name, tokenizer_dir, "default", 64, 0.2, salt, parent=parent
    )


def parent_of(tmp_path, fraction=0.3):
    return {
        "run": "p",
        "keys": read_keys(tmp_path / "p" / TRAIN_KEYS_FILE),
        "fraction": fraction,
        "salt": "x",
    }


def test_new_rows_plus_replay_share_and_removed_counted(tmp_path, tokenizer_dir):
    base = prep(tmp_path, tokenizer_dir, PARENT, "p")
    assert base["continue"] == {
        "parent": None,
        "new": base["train_rows"],
        "replayed": 0,
        "removed": 0,
        "train_rows": base["train_rows"],
        "full_train_rows": base["train_rows"],
        "tokens": base["continue"]["tokens"],
    }
    train = {content_key(r) for r in read_jsonl(tmp_path / "p/train.jsonl")}
    # the keys file: the 64-bit content key (sha256's first 8 bytes, as dedup uses) of every train row
    keys = {int.from_bytes(bytes.fromhex(k)[:8], "little") for k in train}
    assert set(read_keys(tmp_path / "p" / TRAIN_KEYS_FILE).tolist()) == keys
    child_train = {content_key(r) for r in CHILD if not is_heldout(content_key(r), 0.2, "s")}
    new, present = child_train - train, child_train & train
    stats = prep(tmp_path, tokenizer_dir, CHILD, "c", parent_of(tmp_path))
    got = {content_key(r) for r in read_jsonl(tmp_path / "c/train.jsonl")}
    # replayed rows are 0.3 of what trains: 3 for every 7 new ones, worked out here by hand
    replayed = round(len(new) * 3 / 7)
    assert 0 < replayed < len(present)
    assert new <= got and len(got & present) == replayed and len(got) == len(new) + replayed
    delta = stats["continue"]
    assert (delta["parent"], delta["new"], delta["replayed"]) == ("p", len(new), replayed)
    assert delta["removed"] == len(train - child_train) > 10
    assert delta["train_rows"] == stats["train_rows"] == len(got)
    assert delta["full_train_rows"] == len(child_train)
    assert 0 < delta["tokens"]["trained"] < delta["tokens"]["full_retrain"]
    # every train row of the split is recorded for the next continuation, not only those that trained
    assert len(read_keys(tmp_path / "c" / TRAIN_KEYS_FILE)) == len(child_train)
    again = prep(tmp_path, tokenizer_dir, CHILD, "again", parent_of(tmp_path))
    assert again["fingerprint"] == stats["fingerprint"]  # the same replay sample every time


@pytest.mark.reliability(
    fault="a continued run whose data.split_salt differs from its parent's (the held-out split would move)",
    seen=(
        "prepare_data stops naming model.continue_from's run and how many of its train rows would be held "
        "out; a continued run with nothing new (so nothing to replay either) stops naming the parent and "
        "nightly.replay_fraction"
    ),
    steps_lost="none",
    data_lost="none: no data folder is left behind",
)
def test_a_moved_split_or_nothing_to_train_stops_the_stage(tmp_path, tokenizer_dir):
    prep(tmp_path, tokenizer_dir, PARENT, "p")
    with pytest.raises(DataError, match=r"\d+ train rows of model.continue_from run 'p' are held out here"):
        prep(tmp_path, tokenizer_dir, CHILD, "c", parent_of(tmp_path), salt="other")
    assert not (tmp_path / "c").exists()
    with pytest.raises(DataError, match=r"nothing is new since model.continue_from run 'p'.*replay_fraction"):
        prep(tmp_path, tokenizer_dir, PARENT, "same", parent_of(tmp_path))
    assert not (tmp_path / "same").exists()


def test_the_replay_follows_the_new_rows_not_the_history():
    """A night's replay is sized by its new rows: the same 100 new rows replay as many rows whether
    the parent trained 1 000 rows or 1 000 000; capped at the rows the parent still has."""
    from llmft.data.delta import replay_count

    assert replay_count(100, 1_000, 0.25) == replay_count(100, 1_000_000, 0.25) == 33
    assert replay_count(100, 10, 0.25) == 10
    assert replay_count(100, 1_000, 0.0) == 0 and replay_count(0, 1_000, 0.5) == 0
    assert replay_count(100, 1_000, 0.5) == 100
    # the schema's highest share replays every earlier row once the new rows are few enough
    assert replay_count(179, 3_673, 0.95) == 3_401 and replay_count(179, 3_673, 0.99) == 3_673


def test_no_promoted_model_yet_is_named(tmp_path):
    cfg = validate({"model": {"continue_from": "results/current"}}, base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"model.continue_from: results/current does not exist"):
        resolve_parent(Config.from_dict(cfg), tmp_path)


def test_a_parent_prepared_before_train_keys_existed_reads_them_from_train_jsonl(tmp_path, tokenizer_dir):
    from llmft.core.lineage import lineage_head
    from llmft.data.delta import parent_keys

    src = write_rows(tmp_path / "rows.jsonl", PARENT)
    data = tmp_path / "results/old/data"
    prepare([{"path": str(src)}], data, tokenizer_dir, "default", 64, 0.2, "s")
    recorded = read_keys(data / TRAIN_KEYS_FILE)
    (data / TRAIN_KEYS_FILE).unlink()
    assert parent_keys(tmp_path / "results/old").tolist() == recorded.tolist()
    # its summary.json has no lineage: it started from its base model, named in its YAML
    (tmp_path / "results/old/sft").mkdir()
    (tmp_path / "results/old/sft/llamafactory.yaml").write_text(
        "model_name_or_path: results/old/base_model\n"
    )
    head = lineage_head(tmp_path / "results/old")
    assert head["base_model"] == "builtin:tiny" and head["chain"] == ["old"]


def test_an_adapter_in_sft_extra_is_refused_when_continuing(tmp_path):
    (tmp_path / "results/p").mkdir(parents=True)
    raw = {"model": {"continue_from": "results/p"}, "sft": {"extra": {"adapter_name_or_path": "x"}}}
    with pytest.raises(ConfigError, match=r"sft.extra.adapter_name_or_path: set by model.continue_from"):
        resolve_parent(Config.from_dict(validate(raw, base_dir=tmp_path)), tmp_path)


def test_the_cost_counts_the_tokens_the_trainer_feeds():
    """Each pass feeds whole micro-batches to every process (the first rows repeated to fill the last
    ones, at the mean row length), every epoch; max_steps fixes the rows fed instead."""
    from llmft.core.lineage import cost_line, fed_tokens, run_cost

    steps = {
        "world": 2,
        "micro_batch": 16,
        "accumulation": 1,
        "epochs": 10.0,
        "max_steps": -1,
        "packed": False,
    }
    assert fed_tokens(64, 640, steps) == 6400  # two whole steps a pass: no fill
    assert fed_tokens(65, 650, steps) == 10 * 96 * 10  # a third step: 31 repeated rows of 10 tokens
    assert fed_tokens(65, 650, {**steps, "packed": True}) == 6500
    assert fed_tokens(65, 650, {**steps, "max_steps": 7, "accumulation": 2}) == 7 * 2 * 32 * 10
    cost = run_cost(
        {"train_rows": 65, "full_train_rows": 640, "tokens": {"trained": 650, "full_retrain": 6400}}, steps
    )
    assert (cost["trained"], cost["full_retrain"]) == (9600, 64000)
    assert cost_line(cost) == "trains 9,600 tokens, a full retrain would train 64,000: 6.7x fewer"


def test_nightly_continue_epochs_sets_a_continued_runs_epochs_not_the_retrains():
    """nightly.continue_epochs: the continued run trains that many epochs (the YAML's and the cost's
    trained figure); the full retrain it is compared with keeps sft.num_train_epochs; a run from the
    base model ignores it."""
    from types import SimpleNamespace

    from llmft.core.lineage import continue_epochs, run_cost, training_steps
    from llmft.sft.render import epochs_text

    plan = SimpleNamespace(micro_batch=16, gradient_accumulation=1, packing="off")
    raw = {"sft": {"num_train_epochs": 20.0}, "nightly": {"continue_epochs": 4.0}}
    base = Config.from_dict(validate(raw))
    assert continue_epochs(base) == 4.0  # what a continued run of this config would train
    assert training_steps(base, plan, 2)["epochs"] == 20.0  # but this run is from the base model
    cont = Config.from_dict(validate({**raw, "model": {"continue_from": "results/p"}}))
    steps = training_steps(cont, plan, 2)
    assert (steps["epochs"], steps["retrain_epochs"]) == (4.0, 20.0)
    cost = run_cost(
        {"train_rows": 64, "full_train_rows": 640, "tokens": {"trained": 640, "full_retrain": 6400}}, steps
    )
    assert (cost["trained"], cost["full_retrain"]) == (4 * 640, 20 * 6400)
    assert epochs_text(steps) == "4 epoch(s), a retrain 20"
    unset = Config.from_dict(
        validate({"sft": {"num_train_epochs": 20.0}, "model": {"continue_from": "results/p"}})
    )
    assert continue_epochs(unset) == 20.0 and epochs_text(training_steps(unset, plan, 2)) == "20 epoch(s)"
    with pytest.raises(ConfigError, match=r"nightly\.continue_epochs"):
        validate({"nightly": {"continue_epochs": 0}})
