"""results/<run>/lineage.json (llmft.core.lineage_record): written once by `llmft lineage`, read by
render-sft (the YAML's header, no lineage data in the YAML itself), the run page and summary.json, the
nightly and retention; a missing or stale record is an error naming the file."""

import json
from pathlib import Path

import pytest
import yaml
from llmft.core.config import ConfigError, validate
from llmft.core.lineage import LINEAGE_FILE, recorded_lineage
from llmft.core.lineage_record import build, make, read, read_for, summary_view
from llmft.core.platform import Platform
from llmft.core.settings import Config, replace
from llmft.sft.render import planned_steps, render

from tests.conftest import REPO, tiny_config

DEMO = Config.from_dict(validate(yaml.safe_load((REPO / "config/config.yaml").read_text()), base_dir=REPO))
DELTA = {
    "new": 90,
    "replayed": 30,
    "removed": 12,
    "train_rows": 120,
    "full_train_rows": 400,
    "tokens": {"trained": 2400, "full_retrain": 8000},
}


def continued(tmp_path: Path, adapter: bool = False) -> Config:
    """A config continuing from run `p` under tmp_path/results, whose own record is two runs deep."""
    parent = tmp_path / "results/p"
    (parent / "sft").mkdir(parents=True)
    if adapter:
        (parent / "sft/adapter").mkdir()
        (parent / "sft/adapter/adapter_config.json").write_text("{}")
    (parent / LINEAGE_FILE).write_text(
        json.dumps({"parent": "o", "base_model": "builtin:tiny", "chain": ["o"]})
    )
    return replace(replace(DEMO, "run", "c"), "model.continue_from", str(parent))


def data_dir(tmp_path: Path, delta: dict | None = DELTA, fingerprint: str = "fp1") -> Path:
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    stats = {"train_rows": 400, "fingerprint": fingerprint, **({"continue": delta} if delta else {})}
    (d / "stats.json").write_text(json.dumps(stats))
    return d


def test_a_run_from_its_base_model_records_its_base_and_every_row_new(tmp_path):
    steps = {"world": 1, "micro_batch": 4, "accumulation": 1, "epochs": 2.0, "retrain_epochs": 2.0,
             "max_steps": -1, "packed": False}  # fmt: skip
    record = build(DEMO, f"results/{DEMO.run}/base_model", {"train_rows": 10}, steps, "abc")
    assert record["parent"] is None and record["started_from"] == record["base_model"] == "builtin:tiny"
    assert record["chain"] == [] and record["replay"] == {"fraction": None} and record["stack"] == "abc"
    # an older stats.json without prepare_data's counts: every train row new, tokens unknown
    assert record["data"] == {"new": 10, "replayed": 0, "removed": 0, "train_rows": 10, "full_train_rows": 10}
    assert summary_view(record) == {
        "parent": None,
        "started_from": "builtin:tiny",
        "base_model": "builtin:tiny",
        "chain": [],
        "data": {"new": 10, "replayed": 0, "removed": 0, "train_rows": 10},
        "tokens": {"trained": None, "full_retrain": None},
        "stack": "abc",
    }


@pytest.mark.parametrize("adapter", [False, True])
def test_a_continued_run_records_parent_weights_chain_delta_replay_tokens_and_stack(tmp_path, adapter):
    cfg = continued(tmp_path, adapter)
    tiny = tiny_config(tmp_path / "tiny")
    verify = tmp_path / "verify.json"
    verify.write_text(json.dumps({"stack": {"hash": "0123456789ab"}}))
    steps = planned_steps(cfg, tiny, Platform.declared(cfg))
    record = make(cfg, tiny, data_dir(tmp_path), verify, steps, tmp_path / LINEAGE_FILE)
    assert json.loads((tmp_path / LINEAGE_FILE).read_text()) == record
    parent = tmp_path / "results/p"
    assert (
        record["parent"] == "p" and record["chain"] == ["o", "p"] and record["base_model"] == "builtin:tiny"
    )
    assert record["started_from"] == str(parent / "sft" / ("adapter" if adapter else "model"))
    assert record["data"] == {
        k: DELTA[k] for k in ("new", "replayed", "removed", "train_rows", "full_train_rows")
    }
    assert record["replay"] == {"fraction": cfg.nightly.replay_fraction}
    assert record["tokens"]["one_pass"] == DELTA["tokens"] and record["tokens"]["steps"] == steps
    assert 0 < record["tokens"]["trained"] < record["tokens"]["full_retrain"]
    assert record["stack"] == "0123456789ab" and record["data_fingerprint"] == "fp1"
    assert recorded_lineage(tmp_path) == record  # what a run continuing from this one reads


def test_render_reads_the_record_and_the_yaml_carries_no_lineage(tmp_path):
    cfg = continued(tmp_path)
    tiny = tiny_config(tmp_path / "tiny")
    platform = Platform.declared(cfg)
    data = data_dir(tmp_path)
    record = make(
        cfg, tiny, data, tmp_path / "none.json", planned_steps(cfg, tiny, platform), tmp_path / "l.json"
    )
    out = tmp_path / "lf.yaml"
    args = render(cfg, tiny, str(data), str(out), str(tmp_path / "ds.json"), "w", platform,
                  lineage_json=str(tmp_path / "l.json"))  # fmt: skip
    assert "lineage" not in args["llmft"] and "cost" not in args["llmft"]
    text = out.read_text()
    assert (
        f"# continues run p from {record['started_from']} (chain: builtin:tiny -> o -> p -> this run);"
        in text
    )
    assert "# rows: 90 new, 30 replayed, 12 removed since p; 120 train rows of 400\n" in text
    n, m = record["tokens"]["trained"], record["tokens"]["full_retrain"]
    assert f"# trains {n:,} tokens, a full retrain would train {m:,}" in text
    assert yaml.safe_load(text) == args


def test_a_missing_or_stale_record_is_named(tmp_path):
    cfg = continued(tmp_path)
    tiny = tiny_config(tmp_path / "tiny")
    platform = Platform.declared(cfg)
    data = data_dir(tmp_path)
    path = tmp_path / "l.json"

    def render_with(lineage_json):
        render(cfg, tiny, str(data), str(tmp_path / "lf.yaml"), str(tmp_path / "ds.json"), "w", platform,
               lineage_json=lineage_json)  # fmt: skip

    with pytest.raises(ConfigError, match=f"{path} does not exist.*python -m llmft lineage"):
        render_with(str(path))
    with pytest.raises(ConfigError, match="needs its lineage.json"):
        render_with(None)  # a continued run's sft needs it
    steps = planned_steps(cfg, tiny, platform)
    make(cfg, tiny, data, tmp_path / "none.json", steps, path)
    render_with(str(path))
    # the data prepared again since: another fingerprint
    data_dir(tmp_path, fingerprint="fp2")
    with pytest.raises(
        ConfigError, match=f"{path} is stale: it records data_fingerprint 'fp1', this run has 'fp2'"
    ):
        render_with(str(path))
    data_dir(tmp_path)
    # another plan (2 processes, not 1): other tokens
    make(cfg, tiny, data, tmp_path / "none.json", {**steps, "world": steps["world"] + 1}, path)
    with pytest.raises(ConfigError, match=f"{path} is stale: it records steps"):
        render_with(str(path))
    # another run's, another parent's
    with pytest.raises(ConfigError, match="is stale: it records run 'c', this run has 'x'"):
        read_for(path, replace(cfg, "run", "x"), {"fingerprint": "fp1"})
    with pytest.raises(ConfigError, match="is stale: it records parent 'p', this run has None"):
        read_for(path, replace(DEMO, "run", "c"), {"fingerprint": "fp1"})
    path.write_text("[]")
    with pytest.raises(ConfigError, match="is not a lineage record"):
        read(path)


def test_the_page_reads_the_record_and_names_a_missing_or_stale_one(tmp_path):
    from llmft.report.page import build_report

    (tmp_path / "sft").mkdir()
    (tmp_path / "eval/tuned").mkdir(parents=True)
    (tmp_path / "eval/tuned/metrics.json").write_text(json.dumps({"rows": 2, "exact_match": 0.5}))
    (tmp_path / "eval/tuned/predictions.jsonl").write_text("")
    cfg = Config.from_dict(validate({"run": "r"}))
    with pytest.raises(ConfigError, match=f"{tmp_path / LINEAGE_FILE} does not exist"):
        build_report(cfg, str(tmp_path), str(tmp_path / "report"))
    data = data_dir(tmp_path, delta=None)
    record = make(cfg, "m", data, tmp_path / "env/verify.json", {}, tmp_path / LINEAGE_FILE)
    summary = build_report(cfg, str(tmp_path), str(tmp_path / "report"))
    assert summary["lineage"] == summary_view(record) and summary["lineage"]["started_from"] == "m"
    assert "Started from the base model <code>m</code>" in (tmp_path / "report/index.html").read_text()
    (tmp_path / "env").mkdir()
    (tmp_path / "env/verify.json").write_text(json.dumps({"stack": {"hash": "feedbeef0000"}}))
    with pytest.raises(ConfigError, match="is stale: it records stack None, this run has 'feedbeef0000'"):
        build_report(cfg, str(tmp_path), str(tmp_path / "report"))


def test_recorded_reads_lineage_json_else_an_older_runs_summary(tmp_path):
    (tmp_path / "report").mkdir()
    (tmp_path / "report/summary.json").write_text(json.dumps({"lineage": {"parent": "a", "chain": ["a"]}}))
    assert recorded_lineage(tmp_path) == {"parent": "a", "chain": ["a"]}  # made before lineage.json
    (tmp_path / "report/summary.json").write_text(json.dumps({"run": "r"}))
    assert recorded_lineage(tmp_path) == {}  # made before lineage: from its base model
    (tmp_path / "report/summary.json").write_text("[]")
    with pytest.raises(ValueError, match="not a JSON object"):
        recorded_lineage(tmp_path)
    (tmp_path / LINEAGE_FILE).write_text(json.dumps({"parent": "b", "chain": ["a", "b"]}))
    assert recorded_lineage(tmp_path)["chain"] == ["a", "b"]


def test_the_nightly_and_retention_read_the_record(tmp_path):
    """retrain_every's count (continued_runs) and retention (ancestors) follow lineage.json's chain;
    a run made before it, its summary.json's lineage."""
    from llmft.nightly.promote import ancestors
    from llmft.nightly.run import continued_runs

    for run in ("a", "b", "c"):
        (tmp_path / run / "report").mkdir(parents=True)
        (tmp_path / run / "report/summary.json").write_text(json.dumps({"run": run}))
    (tmp_path / "b/report/summary.json").write_text(
        json.dumps({"run": "b", "lineage": {"parent": "a", "chain": ["a"]}})
    )
    (tmp_path / "c" / LINEAGE_FILE).write_text(json.dumps({"parent": "b", "chain": ["a", "b"]}))
    assert continued_runs(tmp_path, "c") == 2 and continued_runs(tmp_path, "a") == 0
    assert ancestors(tmp_path, "c") == {"a", "b"}
