"""model.continue_from through the whole DAG on the local executor: real LLaMA-Factory training.

Full: run `p` trains the tiny model from its base on rows P; results/current is made a link to it;
run `c` continues from results/current on P less its first rows plus appended rows. LoRA: run `lp`
trains an adapter and is promoted (`llmft promote`); run `lc` is a nightly `mode: continue` night that
continues it and is promoted by the gate. The counts of new, replayed and removed rows are worked out
here from the data files (content keys and the split's side, as prepare_data defines them), and the
weights a continued run started from are compared with its parent's published tensors. The bad
parents at the end are refused by `snakemake -n`, before any job.
"""

import json
import re
import shutil

import pytest
import yaml
from llmft.core.modelfiles import seal_folder
from safetensors.torch import load_file

from tests.conftest import make_workdir, place_verify, reuse_verify, snakemake

pytestmark = pytest.mark.workflow

FAST = {
    "data__dedup__decontaminate": False,  # every row's fate is its side of the split: exact counts
    "sft__num_train_epochs": 2.0,
    "sft__logging_steps": 2,
    "sft__save_steps": 1000,
}
LR = 1.0e-3
N_PARENT, N_REMOVED, N_APPENDED = 300, 20, 60
LORA = {"sft__finetuning_type": "lora", "sft__lora_rank": 8, "sft__learning_rate": 3.0e-3}


def distinct_rows(n: int) -> list[dict]:
    """n synthetic demo rows of distinct content (the generator repeats some)."""
    from llmft.core.assets import synthetic_rows
    from llmft.data.prepare import content_key

    rows, seen = [], set()
    for row in synthetic_rows(4 * n):
        key = content_key(row)
        if key not in seen:
            seen.add(key)
            rows.append(row)
        if len(rows) == n:
            return rows
    raise AssertionError("not enough distinct rows")


ROWS = distinct_rows(N_PARENT + N_APPENDED)
PARENT_ROWS = ROWS[:N_PARENT]
CHILD_ROWS = ROWS[N_REMOVED:]  # the first N_REMOVED rows removed, N_APPENDED rows appended


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_with(work, run, data, **overrides):
    make_workdir(work, **FAST, data__sources=[{"path": data, "format": "alpaca"}], **overrides)
    # this machine's verify_env report: nothing here asserts on it. The four runs differ in no key
    # verify_env reads, so the first run's report (p's) serves the other three.
    first = work / "results/p/env/verify.json"
    if run != "p" and first.is_file():
        place_verify(first, work, run)
    else:
        reuse_verify(work, run)
    return snakemake(work, "--config", f"run={run}")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("continue")
    write_rows(work / "parent.jsonl", PARENT_ROWS)
    write_rows(work / "child.jsonl", CHILD_ROWS)
    return work


@pytest.fixture(scope="module")
def full(work):
    proc = run_with(work, "p", "parent.jsonl", sft__learning_rate=LR)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (work / "results/current").symlink_to("p")
    proc = run_with(work, "c", "child.jsonl", sft__learning_rate=LR, model__continue_from="results/current")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return work


@pytest.fixture(scope="module")
def lora(full):
    """Run lp trains an adapter from the base; `llmft promote lp` makes it results/current; run lc is a
    nightly `mode: continue` night on child.jsonl that keeps training lp's adapter. Returns the
    workdir and the night's output."""
    from tests.workflow.test_promote import llmft, night

    proc = run_with(full, "lp", "parent.jsonl", **LORA)
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = llmft(full, "promote", "lp", "--why", "the LoRA night's parent")
    assert proc.returncode == 0, proc.stderr
    night_cfg = {"nightly__mode": "continue", "nightly__metric": "eval_loss", "nightly__tolerance": 10.0}
    # the page's evaluation and the gate's (nightly.gate_max_rows) on 8 rows: the night stays cheap;
    # one epoch (nightly.continue_epochs) where its parent trained FAST's two
    night_cfg |= {"eval__max_rows": 8, "nightly__gate_max_rows": 8, "nightly__continue_epochs": 1.0}
    make_workdir(
        full, **FAST, **LORA, **night_cfg, data__sources=[{"path": "child.jsonl", "format": "alpaca"}]
    )
    place_verify(full / "results/p/env/verify.json", full, "lc")
    proc = night(full, "lc")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return full, proc


def keys_of(path):
    from llmft.data.prepare import content_key

    return [content_key(json.loads(line)) for line in path.read_text().splitlines()]


def expected_delta(run_dir):
    """new / present / removed from the data files: the parent's train rows (a run from its base
    trains every train row) and each child row's side of the split."""
    from llmft.data.prepare import content_key, is_heldout

    parent_train = set(keys_of(run_dir / "data/train.jsonl"))
    child_train = {content_key(r) for r in CHILD_ROWS if not is_heldout(content_key(r), 0.1, "llmft")}
    return child_train - parent_train, child_train & parent_train, parent_train - child_train


def summary(run_dir):
    return json.loads((run_dir / "report/summary.json").read_text())


def digest(tensor):
    from llmft.sft.callbacks import tensor_digest

    return tensor_digest(tensor)


@pytest.mark.parametrize("parent, child", [("p", "c"), ("lp", "lc")])
def test_a_continued_run_trains_the_new_rows_and_a_replay_share(full, lora, parent, child):
    results = full / "results"
    new, present, removed = expected_delta(results / parent)
    assert len(new) > 40 and len(removed) > 10  # the data really changed
    # the default nightly.replay_fraction 0.25: one replayed row for every three new ones
    replayed = round(len(new) / 3)
    assert 0 < replayed < len(present)
    trained = keys_of(results / child / "data/train.jsonl")
    assert len(trained) == len(set(trained)) == len(new) + replayed
    assert new <= set(trained) and len(set(trained) & present) == replayed
    lineage = summary(results / child)["lineage"]
    assert lineage["data"] == {
        "new": len(new),
        "replayed": replayed,
        "removed": len(removed),
        "train_rows": len(trained),
    }
    # the tokens the trainer feeds (every epoch, each pass's last micro-batches filled), against a
    # full retrain's: they agree with the trainer's own count (num_input_tokens_seen), up to the
    # lengths of the repeated fill rows, counted at the mean
    tokens = lineage["tokens"]
    assert 0 < tokens["trained"] < tokens["full_retrain"] / 2
    for run, planned in (
        (child, tokens["trained"]),
        (parent, summary(results / parent)["lineage"]["tokens"]),
    ):
        fed = json.loads((results / run / "sft/train_summary.json").read_text())["train_tokens"]
        planned = planned if isinstance(planned, int) else planned["trained"]
        assert planned == pytest.approx(fed, rel=0.03), (run, planned, fed)
    # two epochs of whole 2 x 16-row micro-batches (lc: one, nightly.continue_epochs; a retrain
    # two): the one-pass token count alone is far off
    epochs = 1 if child == "lc" else 2
    assert tokens["steps"]["epochs"] == epochs and tokens["steps"]["retrain_epochs"] == 2
    assert tokens["trained"] >= epochs * tokens["one_pass"]["trained"]
    assert tokens["full_retrain"] >= 2 * tokens["one_pass"]["full_retrain"]
    from llmft.data.prepare import content_key

    # the held-out split never moves: every parent held-out row still in the data is held out again
    held_parent = set(keys_of(results / parent / "data/heldout.jsonl"))
    held_child = set(keys_of(results / child / "data/heldout.jsonl"))
    still_there = held_parent & {content_key(r) for r in CHILD_ROWS}
    assert len(still_there) > 10 and still_there <= held_child and not set(trained) & held_child


def test_full_continue_starts_from_the_parents_published_weights(full):
    results = full / "results"
    start = json.loads((results / "c/sft/train_summary.json").read_text())["start_weights"]
    own = json.loads((results / "p/sft/train_summary.json").read_text())["start_weights"]
    published = load_file(results / "p/sft/model/model.safetensors")[start["name"]]
    assert {k: start[k] for k in ("shape", "sum", "sha256")} == digest(published)
    assert own["sha256"] != start["sha256"]  # the parent itself started elsewhere: its base model
    args = yaml.safe_load((results / "c/sft/llamafactory.yaml").read_text())
    assert args["model_name_or_path"] == "results/p/sft/model"  # the link, resolved
    # a fresh schedule at a quarter of the configured rate (nightly.continue_learning_rate_factor 0.25)
    assert args["learning_rate"] == pytest.approx(LR / 4)
    history = json.loads((results / "c/sft/train_summary.json").read_text())["history"]
    rates = [h["learning_rate"] for h in history if "learning_rate" in h]
    # warmup again to the new peak, then the decay again: never the parent's rate
    assert max(rates) == pytest.approx(LR / 4) and rates[-1] < rates[0]


def test_lora_continue_keeps_training_the_parents_adapter(lora):
    results = lora[0] / "results"
    start = json.loads((results / "lc/sft/train_summary.json").read_text())["start_weights"]
    assert "lora_" in start["name"]
    adapter = load_file(results / "lp/sft/adapter/adapter_model.safetensors")
    assert {k: start[k] for k in ("shape", "sum", "sha256")} == digest(
        adapter[start["name"].replace(".default", "")]
    )
    args = yaml.safe_load((results / "lc/sft/llamafactory.yaml").read_text())
    assert args["finetuning_type"] == "lora" and args["create_new_adapter"] is False
    assert args["adapter_name_or_path"] == "results/lp/sft/adapter"  # results/current, resolved
    assert args["model_name_or_path"] == "results/lc/base_model"
    assert args["num_train_epochs"] == 1.0  # nightly.continue_epochs, not sft's 2
    after = load_file(results / "lc/sft/adapter/adapter_model.safetensors")
    assert set(after) == set(adapter)  # the same adapter, trained on: no second one
    assert any(not (after[k] == adapter[k]).all() for k in adapter)


def test_a_lora_continue_night_trains_on_the_promoted_adapter(lora):
    """nightly.mode continue with LoRA: the night starts from results/current's adapter (lp's), keeps
    training that adapter, and its gate promotes the result."""
    work, proc = lora
    results = work / "results"
    assert "training run lc from results/lp" in proc.stdout
    assert summary(results / "lc")["lineage"]["started_from"] == "results/lp/sft/adapter"
    night = json.loads((results / "nightly/state.json").read_text())["nights"][-1]
    assert night["mode"] == "continue" and night["started_from"] == "results/lp"
    assert night["status"] == "promoted" and "(run lp) on 8 held-out rows" in night["reason"]
    assert (results / "current").resolve().name == "lc"


def test_lineage_in_summary_plan_page_and_trend(full, lora):
    results = full / "results"
    head = summary(results / "p")["lineage"]
    assert re.fullmatch(r"[0-9a-f]{12}", head["stack"]), head  # the hash of the stack it trained on
    assert head | {"data": None, "tokens": None, "stack": None} == {
        "parent": None,
        "started_from": "builtin:tiny",
        "base_model": "builtin:tiny",
        "chain": [],
        "data": None,
        "tokens": None,
        "stack": None,
    }
    # the run's one lineage record, which summary.json's lineage is read from; the YAML carries no
    # lineage data (its header's lines about it are comments)
    for run in ("p", "c", "lp", "lc"):
        record, told = (
            json.loads((results / run / "lineage.json").read_text()),
            summary(results / run)["lineage"],
        )
        assert {k: record[k] for k in told if k != "data"} == {k: v for k, v in told.items() if k != "data"}
        assert told["data"].items() <= record["data"].items()
        assert record["run"] == run and record["replay"]["fraction"] == (None if run in ("p", "lp") else 0.25)
        args = yaml.safe_load((results / run / "sft/llamafactory.yaml").read_text())
        assert not {"lineage", "cost"} & set(args["llmft"]), args["llmft"]
    lineage = summary(results / "c")["lineage"]
    assert {k: lineage[k] for k in ("parent", "started_from", "base_model", "chain")} == {
        "parent": "p",
        "started_from": "results/p/sft/model",
        "base_model": "builtin:tiny",
        "chain": ["p"],
    }
    assert summary(results / "lc")["lineage"]["started_from"] == "results/lp/sft/adapter"
    n, m = lineage["tokens"]["trained"], lineage["tokens"]["full_retrain"]
    cost = f"trains {n:,} tokens, a full retrain would train {m:,}: {m / n:.1f}x fewer"
    plan = (results / "c/sft/llamafactory.yaml").read_text()
    assert "# continues run p from results/p/sft/model (chain: builtin:tiny -&gt; p" not in plan
    assert "# continues run p from results/p/sft/model (chain: builtin:tiny -> p -> this run)" in plan
    assert cost in plan
    page = (results / "c/report/index.html").read_text()
    assert "Continued from run <b>p</b>" in page and "builtin:tiny -&gt; p -&gt; this run" in page
    assert cost in page
    assert "Started from the base model" in (results / "p/report/index.html").read_text()
    trend = (results / "lc/report/trend.html").read_text()
    assert "continued from lp (" in trend and "continued from p (" in trend


def copy_run(results, src, dst):
    """A finished run's files that a continued run reads, under another name."""
    parts = (
        "report",
        "lineage.json",
        "sft/model",
        "sft/llamafactory.yaml",
        "data/stats.json",
        "data/train_keys.u64",
    )
    for part in parts:
        s, d = results / src / part, results / dst / part
        d.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if s.is_dir() else shutil.copy)(s, d)
    return results / dst


def break_tokenizer(run):
    tok = json.loads((run / "sft/model/tokenizer.json").read_text())
    tok["model"]["vocab"]["zzzextra"] = len(tok["model"]["vocab"])
    (run / "sft/model/tokenizer.json").write_text(json.dumps(tok))
    seal_folder(run / "sft/model")  # published so: a parent trained with another tokenizer, not a changed one


def truncate_weights(run):
    with open(run / "sft/model/model.safetensors", "r+b") as fh:
        fh.truncate(1000)


BAD = {
    "missing": (None, "results/nosuch", {}, "config key model.continue_from: results/nosuch does not exist"),
    "no summary": (
        lambda r: (r / "report/summary.json").unlink(),
        None,
        {},
        "config key model.continue_from: run 'bad' is not a finished run (no report/summary.json)",
    ),
    "corrupt model": (
        truncate_weights,
        None,
        {},
        "config key model.continue_from: run 'bad' has a broken published model",
    ),
    "tokenizer": (
        break_tokenizer,
        None,
        {},
        r"config key model.name_or_path: its tokenizer \(\w{12}\) differs from the one of "
        r"model.continue_from run 'bad' \(\w{12}, sft/model\)",
    ),
    "template": (
        None,
        None,
        {"model__template": "alpaca"},
        "config key model.template: 'alpaca', but model.continue_from run 'bad' used template 'default'",
    ),
    "finetuning type": (
        None,
        None,
        {"sft__finetuning_type": "freeze"},
        "config key sft.finetuning_type: 'freeze', but model.continue_from run 'bad' trained 'full'",
    ),
    "itself": (
        None,
        "results/p",
        {},
        "config key model.continue_from: results/p is run 'p' itself (config key run)",
    ),
}


@pytest.mark.reliability(
    fault=(
        "model.continue_from naming a missing folder, a run without summary.json, a run whose published "
        "weights are truncated, a run with another tokenizer, template or finetuning type, the run itself"
    ),
    seen=(
        "`snakemake -n` refuses before any job, naming the key (model.continue_from, or the key that "
        "differs with both values) and the parent run or path"
    ),
    steps_lost="none",
    data_lost="none",
)
@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_parent_is_refused_by_name_before_any_job(full, case):
    spoil, target, overrides, needle = BAD[case]
    results = full / "results"
    shutil.rmtree(results / "bad", ignore_errors=True)
    bad = copy_run(results, "p", "bad")
    if spoil:
        spoil(bad)
    make_workdir(
        full,
        **{**FAST, **overrides},
        data__sources=[{"path": "child.jsonl", "format": "alpaca"}],
        model__continue_from=target or "results/bad",
    )
    proc = snakemake(full, "-n", "--config", "run=p" if case == "itself" else "run=nb")
    out = proc.stderr + proc.stdout
    assert proc.returncode != 0 and re.search(needle if case == "tokenizer" else re.escape(needle), out), out[
        -3000:
    ]
    assert "Traceback" not in out and "Job stats" not in out


def test_a_promoted_continued_run_is_not_its_own_parent(full):
    """results/current moved to the continued run itself (the nightly promoted it): the run keeps the
    parent it recorded, so nothing of it reruns."""
    current = full / "results/current"
    current.unlink()
    current.symlink_to("c")
    try:
        make_workdir(
            full,
            **FAST,
            data__sources=[{"path": "child.jsonl", "format": "alpaca"}],
            sft__learning_rate=LR,
            model__continue_from="results/current",
        )
        proc = snakemake(full, "-n", "--config", "run=c")
        out = proc.stderr + proc.stdout
        assert proc.returncode == 0 and "Nothing to be done" in out, out[-3000:]
    finally:
        current.unlink()
        current.symlink_to("p")


def test_a_run_made_before_lineage_existed_can_be_continued_from(full):
    """No train_keys.u64, no continue block in stats.json, no lineage in summary.json: its keys are read
    back from its train.jsonl and its base model from its YAML; the DAG builds."""
    results = full / "results"
    shutil.rmtree(results / "old", ignore_errors=True)
    old = copy_run(results, "p", "old")
    shutil.copy(results / "p/data/train.jsonl", old / "data/train.jsonl")
    (old / "data/train_keys.u64").unlink()
    (old / "lineage.json").unlink()
    for path, key in ((old / "data/stats.json", "continue"), (old / "report/summary.json", "lineage")):
        content = json.loads(path.read_text())
        del content[key]
        path.write_text(json.dumps(content))
    args = yaml.safe_load((old / "sft/llamafactory.yaml").read_text())
    args["model_name_or_path"] = "results/old/base_model"
    (old / "sft/llamafactory.yaml").write_text(yaml.safe_dump(args))
    make_workdir(
        full,
        **FAST,
        data__sources=[{"path": "child.jsonl", "format": "alpaca"}],
        model__continue_from="results/old",
    )
    proc = snakemake(full, "-n", "--config", "run=fromold")
    out = proc.stderr + proc.stdout
    assert proc.returncode == 0 and "prepare_data" in out, out[-3000:]
