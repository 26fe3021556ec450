"""Nightly building blocks: fingerprints, the promotion gate, retention, the lock."""

import json
import shlex
import subprocess
import sys

import pytest
import yaml
from llmft.core.config import validate
from llmft.core.settings import Config, Nightly, replace
from llmft.nightly.gate import gate, gate_view, same_rows_reference
from llmft.nightly.lock import Lock, NightlyLocked
from llmft.nightly.promote import promoted_stack, record
from llmft.nightly.run import (
    _configfiles,
    config_fingerprint,
    data_fingerprint,
    nightly,
    retain,
    run_name,
    schedule_lines,
)
from llmft.preference.evaluate import gate_block
from llmft.preference.page import gate_blocks

from tests.conftest import REPO


def summary(run, em, loss=1.0):
    return {"run": run, "tuned": {"exact_match": em, "eval_loss": loss}}


def test_gate_promotes_first_and_within_tolerance():
    assert gate(summary("a", 0.5), None, "exact_match", 0.01)[0]
    ok, why = gate(summary("b", 0.495), summary("a", 0.5), "exact_match", 0.01)
    assert ok and "promoted" in why


def test_gate_rejects_worse_and_says_why():
    ok, why = gate(summary("b", 0.40), summary("a", 0.5), "exact_match", 0.01)
    assert not ok
    assert "rejected" in why and "0.4000" in why and "0.5000" in why and "run a" in why


def test_the_gate_says_better_or_worse_with_the_sign_and_rounding_of_the_scores_it_prints():
    ok, why = gate(summary("b", 0.62944), summary("a", 0.61186), "exact_match", 0.01)
    assert ok and "0.6294 vs current 0.6119" in why and "better by 0.0175, tolerance 0.01" in why
    ok, why = gate(summary("b", 0.605), summary("a", 0.6119), "exact_match", 0.01)
    assert ok and "worse by 0.0069" in why
    ok, why = gate(summary("b", 0, loss=0.42), summary("a", 0, loss=0.5), "eval_loss", 0.01)
    assert ok and "better by 0.0800" in why
    ok, why = gate(summary("b", 0, loss=0.6), summary("a", 0, loss=0.5), "eval_loss", 0.01)
    assert not ok and "rejected" in why and "worse by 0.1000" in why
    assert "the same to 4 decimals" in gate(summary("b", 0.5), summary("a", 0.50001), "exact_match", 0)[1]


def test_gate_lower_is_better_for_loss():
    assert not gate(summary("b", 0, loss=2.0), summary("a", 0, loss=1.0), "eval_loss", 0.1)[0]
    assert gate(summary("b", 0, loss=0.5), summary("a", 0, loss=1.0), "eval_loss", 0.1)[0]


def test_fingerprints_follow_data_and_config_not_run_name(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    cfg = Config.from_dict(validate({"data": {"sources": [{"path": str(data)}]}}))
    fp = data_fingerprint(cfg.data)
    assert config_fingerprint(cfg) == config_fingerprint(replace(cfg, "run", "other"))
    other = Config.from_dict(validate({"sft": {"learning_rate": 1.0}}))
    assert config_fingerprint(cfg) != config_fingerprint(other)
    with open(data, "a") as fh:
        fh.write('{"instruction": "c", "output": "d"}\n')
    assert data_fingerprint(cfg.data) != fp


def test_retention_keeps_last_n_and_the_promoted(tmp_path):
    nights = []
    for i in range(5):
        (tmp_path / f"r{i}").mkdir()
        nights.append({"run": f"r{i}", "status": "promoted" if i == 0 else "rejected"})
    (tmp_path / "r0" / "report").mkdir()
    (tmp_path / "r0" / "report" / "summary.json").write_text('{"run": "r0"}')  # no lineage: from base
    state = {"nights": nights, "promoted": "r0"}
    deleted = retain(tmp_path, state, keep=2)
    assert deleted == ["r1", "r2"]
    assert (tmp_path / "r0").is_dir() and (tmp_path / "r3").is_dir() and not (tmp_path / "r1").exists()


@pytest.mark.reliability(
    fault="`llmft nightly --run` given `../../victim`, `.`, `nightly` or `current`",
    seen="refused with exit 2 naming config key run; nothing is created under results/ (state, lock, log)",
    steps_lost="none",
    data_lost="none",
)
@pytest.mark.parametrize("name", ["../../victim", ".", "nightly", "current"])
def test_a_run_name_that_is_a_path_or_reserved_is_refused_before_anything_is_recorded(tmp_path, capsys, name):
    results = tmp_path / "results"
    assert nightly(Config(), "profiles/local", name, results) == 2
    err = capsys.readouterr().err
    assert f"[nightly] --run {name!r} refused, nothing recorded: config key run" in err
    assert not results.exists()  # no state.json, no lock, no log


@pytest.mark.reliability(
    fault=(
        "a state.json already holding such names (a path out of results/, `.`, `..`, `nightly`, `current`, "
        "a symlink), then a night's retention"
    ),
    seen="retention skips them: it deletes only real run folders directly under results/ that a night made",
    steps_lost="none",
    data_lost="none: the folders outside, `current`, the state and the symlink's target all stay",
)
def test_retention_deletes_only_run_folders_the_nightly_made_directly_under_results(tmp_path):
    """A state.json holding the names an unchecked --run once let in (a path out of results/, `.`,
    the nightly's own folder, the promoted link) deletes none of them and does not crash; the real
    old run goes, and so does nothing a night found already there."""
    results = tmp_path / "x" / "results"
    victim = tmp_path / "victim"
    for folder in (victim, results / "nightly", results / "old", results / "mine", results / "r0" / "report"):
        folder.mkdir(parents=True)
    (results / "r0" / "report" / "summary.json").write_text('{"run": "r0"}')
    (results / "nightly" / "state.json").write_text("{}")
    (results / "current").symlink_to("r0", target_is_directory=True)
    (results / "elsewhere").symlink_to(victim, target_is_directory=True)
    names = ["../../victim", ".", "nightly", "current", "elsewhere", ".."]
    nights = [{"run": n, "status": "failed"} for n in names]
    nights += [
        {"run": "old", "status": "rejected", "created": True},
        {"run": "mine", "status": "failed", "created": False},  # a folder the night found there
        {"run": "r0", "status": "promoted", "created": True},
    ]
    state = {"nights": nights, "promoted": "r0"}
    assert retain(results, state, keep=1) == ["old"]
    assert victim.is_dir() and (results / "nightly" / "state.json").is_file()
    assert (results / "current").is_symlink() and (results / "r0").is_dir() and (results / "mine").is_dir()
    assert [n["run"] for n in state["nights"] if n.get("deleted")] == ["old"]


def test_a_failed_attempt_and_its_rerun_under_the_same_name_are_one_night(tmp_path, monkeypatch, capsys):
    """Two attempts of run n1 whose snakemake fails at once (a profile that does not exist): the state
    holds one night n1, the first attempt under its `attempts`."""
    monkeypatch.chdir(tmp_path)
    results = tmp_path / "results"
    for _ in range(2):
        assert nightly(Config(), "no such profile", "n1", results) == 1
    nights = json.loads((results / "nightly" / "state.json").read_text())["nights"]
    assert [(n["run"], n["status"]) for n in nights] == [("n1", "failed")]
    [attempt] = nights[0]["attempts"]
    assert attempt["status"] == "failed" and "snakemake exited" in attempt["reason"]


def test_lock_refuses_a_second_process(tmp_path):
    path = tmp_path / "lock"
    with Lock(path):
        code = (
            "import sys; from pathlib import Path; from llmft.nightly.lock import Lock, NightlyLocked\n"
            "try:\n    Lock(Path(sys.argv[1])).__enter__()\nexcept NightlyLocked as e:\n"
            "    print(e); sys.exit(3)\n"
        )
        proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
        assert proc.returncode == 3 and "another nightly run holds" in proc.stdout
        assert "pid" in proc.stdout
    with Lock(path):  # released on exit
        pass
    with pytest.raises(NightlyLocked):
        with Lock(path), Lock(path):
            pass


def test_run_name_is_the_date_with_a_suffix(tmp_path):
    assert run_name(tmp_path, "2026-11-30") == "2026-11-30"
    (tmp_path / "2026-11-30").mkdir()
    assert run_name(tmp_path, "2026-11-30") == "2026-11-30.2"


def test_schedule_lines(tmp_path):
    lines = schedule_lines(Nightly(), tmp_path)
    assert lines["scrontab"].startswith("#SCRON --partition=cpu")
    assert "0 2 * * *" in lines["crontab"]
    assert "-m llmft nightly --config config/config.yaml --profile profiles/slurm" in lines["crontab"]
    # the driver outlives sft's own 24 h limit (the profile's runtimes, one stage after the other)
    assert "--time=1-06:15:00" in schedule_lines(Nightly(), REPO)["scrontab"]


def test_the_printed_schedule_runs_the_config_it_was_printed_from(tmp_path):
    """`nightly-schedule --config my.yaml`: the entry's time comes from my.yaml merged over
    config/config.yaml, and the nights it starts run my.yaml, not config/config.yaml alone."""
    mine = tmp_path / "my nightly.yaml"
    mine.write_text(yaml.safe_dump({"nightly": {"schedule": "30 3 * * 1-5"}}))
    res = subprocess.run(
        [sys.executable, "-m", "llmft", "nightly-schedule", "--config", str(mine)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    cron = [line for line in res.stdout.splitlines() if line.startswith("30 3 * * 1-5 ")]
    assert len(cron) == 2, res.stdout  # the scrontab entry and the crontab one
    assert all(f"-m llmft nightly --config {shlex.quote(str(mine))} " in line for line in cron), cron


def test_the_printed_cron_line_runs_on_a_fresh_checkout_with_spaces_and_percent_in_its_path(tmp_path):
    """The line as cron runs it (sh -c, with cron's \\% unescaped): it reaches llmft and logs, even
    where results/nightly/ does not exist yet. No Slurm here: the night itself fails, and says so."""
    repo = tmp_path / "my checkout 100%"
    (repo / "config").mkdir(parents=True)
    (repo / "config/config.yaml").write_text((REPO / "config/config.yaml").read_text())
    line = schedule_lines(Nightly(), repo, profile="no such profile")["crontab"]
    command = line.split(" ", 5)[5].replace("\\%", "%")
    subprocess.run(["sh", "-c", command], timeout=300)
    log = (repo / "results/nightly/cron.log").read_text()
    # llmft's own driver wrote these lines: an import failure ("No module named llmft") or a crash
    # would log a traceback instead
    assert "[nightly] training run " in log and "FAILED: snakemake exited 1" in log, log[-2000:]
    assert "Traceback" not in log and "No module named" not in log, log[-2000:]
    assert any(p.name != "cron.log" for p in (repo / "results/nightly").glob("*.log"))  # the night's own log


@pytest.mark.parametrize(
    "key,value",
    [("schedule", "0 2 * * *\n* * * * * touch PWNED"), ("partition", "cpu\n#SCRON --uid=0")],
    ids=["schedule", "partition"],
)
@pytest.mark.reliability(
    fault="`nightly.schedule` or `nightly.partition` with a newline adding a cron entry or a `#SCRON` line",
    seen="`llmft nightly-schedule` prints no entry and exits 2, naming the key and what it may be",
    steps_lost="none",
    data_lost="none",
)
def test_a_schedule_or_partition_that_adds_a_line_prints_nothing(tmp_path, key, value):
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg.setdefault("nightly", {})[key] = value
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    res = subprocess.run(
        [sys.executable, "-m", "llmft", "nightly-schedule", "--config", str(tmp_path / "config.yaml")],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"config key nightly.{key}: " in res.stderr and "Traceback" not in res.stderr
    assert ("five cron fields" if key == "schedule" else "a Slurm partition name is") in res.stderr
    assert "PWNED" not in res.stdout and "--uid" not in res.stdout


def test_the_gate_compares_on_the_same_heldout_rows_only():
    """The promoted model's scores count only on the rows the new model was scored on: from tonight's
    own scoring of it (compared_with) when there is one, else current.json's when the rows match."""
    current = {"run": "a", "tuned": {"eval_loss": 1.0}, "heldout_fingerprint": "old"}
    new = {"run": "b", "tuned": {"eval_loss": 0.9}, "heldout_fingerprint": "new"}
    ref, why = same_rows_reference(new, current)
    assert ref is None and "run b was scored on held-out rows new and the promoted run a on old" in why
    ref, why = same_rows_reference({**new, "heldout_fingerprint": "old"}, current)
    assert why is None and ref["tuned"] == {"eval_loss": 1.0}
    tonight = {"run": "a", "tuned": {"eval_loss": 1.2}, "heldout_fingerprint": "new"}
    ref, why = same_rows_reference({**new, "compared_with": tonight}, current)
    assert why is None and ref["tuned"] == {"eval_loss": 1.2} and ref["run"] == "a"
    # tonight's scoring of another run than the promoted one does not count
    ref, why = same_rows_reference({**new, "compared_with": {**tonight, "run": "z"}}, current)
    assert ref is None and why.startswith("rejected: not compared")
    assert same_rows_reference(new, None) == (None, None)


def test_the_gate_compares_its_own_scores_over_every_heldout_row():
    """A night scores its tuned model again on the gate's rows (summary `gate`, eval/gate: every
    held-out row), beside the promoted model on the same rows (`compared_with`); the page's scores
    (eval.max_rows rows, fingerprint `first`) are not what the gate compares."""
    page = {"run": "b", "tuned": {"eval_loss": 0.5}, "heldout_rows": 40, "heldout_fingerprint": "first"}
    tonight = {"run": "a", "tuned": {"eval_loss": 1.0}, "heldout_rows": 57, "heldout_fingerprint": "all"}
    night = {**page, "compared_with": tonight}
    ref, why = same_rows_reference(night, {"run": "a"})
    assert ref is None and "run b was scored on held-out rows first" in why
    night["gate"] = {"tuned": {"eval_loss": 1.2}, "heldout_rows": 57, "heldout_fingerprint": "all"}
    ref, why = same_rows_reference(night, {"run": "a"})
    assert why is None
    ok, reason = gate(gate_view(night), ref, "eval_loss", 0.1)
    assert not ok and reason.startswith("rejected: eval_loss 1.2000 vs current 1.0000 (run a) on 57 held-out")


def test_a_state_from_before_the_history_keeps_its_promoted_run_for_rollback():
    state = {"nights": [], "promoted": "old"}
    record(state, "promote", "old", "new", "why")
    assert promoted_stack(state) == ["old", "new"] and state["promoted"] == "new"
    record(state, "rollback", "new", "old", "back")
    assert promoted_stack(state) == ["old"]


def test_promote_and_rollback_wait_for_no_night_they_refuse_while_one_holds_the_lock(tmp_path):
    """A night in progress holds results/nightly/lock: a promotion by hand then would change what the
    night compares against. Both commands are refused with exit 3, naming the holder."""
    with Lock(tmp_path / "nightly" / "lock"):
        for args in (["promote", "r1"], ["rollback"]):
            proc = subprocess.run(
                [sys.executable, "-m", "llmft", *args, "--results", str(tmp_path), "--why", "x"],
                capture_output=True, text=True, cwd=REPO, timeout=120,
            )  # fmt: skip
            assert proc.returncode == 3, proc.stdout + proc.stderr
            assert "another nightly run holds" in proc.stderr and "pid" in proc.stderr
    assert not (tmp_path / "current").exists()


def test_the_nights_overrides_go_in_one_configfile_flag(tmp_path):
    """snakemake keeps only the last --configfile flag: the night's config and its overrides
    (the promoted run to compare with and, continuing, to start from) share one."""
    start = {"promoted": "n1", "continue_from": "results/n1", "note": None}
    args = _configfiles(tmp_path, "n2", start, ["my config.yaml"])
    assert args == ["--configfile", "my config.yaml", str(tmp_path / "nightly" / "n2.config.yaml")]
    over = yaml.safe_load((tmp_path / "nightly" / "n2.config.yaml").read_text())
    assert over == {"model": {"continue_from": "results/n1"}, "nightly": {"compare_with": "results/n1"}}
    nothing = {"promoted": None, "continue_from": None, "note": None}
    assert (
        _configfiles(tmp_path, "n3", nothing, []) == [] and not (tmp_path / "nightly/n3.config.yaml").exists()
    )


def _logps(folder, pairs, fingerprint="pairs-a"):
    """A model's log-probabilities of held-out pairs as evaluate_preference_gate writes them."""
    folder.mkdir(parents=True)
    rows = [
        {"kind": "dpo", "index": i, "prompt": f"p{i}", "chosen": c, "rejected": r}
        | {"chosen_tokens": 3, "rejected_tokens": 3}
        for i, (c, r) in enumerate(pairs)
    ]
    (folder / "logps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows_json = {"model": str(folder), "kind": "dpo", "rows": len(rows), "heldout_fingerprint": fingerprint}
    (folder / "rows.json").write_text(json.dumps(rows_json))


def test_the_gate_on_a_preference_metric_compares_both_preference_models_on_the_same_pairs(tmp_path):
    """nightly.metric preference_accuracy with a promoted model: the night scores its preference model
    and the promoted run's, each against its own sft model (reference sft), on its 4 held-out pairs;
    the verdict names the metric, both scores and the pair count. A summary whose gate scores lack
    the metric (the SFT gate's rows) is a named rejection, not a KeyError."""
    cfg = Config.from_dict(
        validate(
            {"preference": {}, "nightly": {"metric": "preference_accuracy", "compare_with": "results/n1"}}
        )
    )
    gate_dir = tmp_path / "preference" / "gate"
    refs = [(-5.0, -5.0)] * 4
    # implicit reward margins vs its reference: +1, +1, +1, -1 (tonight); +1 on every pair (promoted)
    _logps(gate_dir / "gate", [(-4.0, -5.0), (-4.0, -5.0), (-4.0, -5.0), (-6.0, -5.0)])
    _logps(gate_dir / "gate_reference", refs)
    _logps(gate_dir / "promoted", [(-4.0, -5.0)] * 4)
    _logps(gate_dir / "promoted_reference", refs)
    ours, theirs = gate_blocks(cfg, tmp_path)
    beta = cfg.preference.beta
    assert ours["tuned"]["preference_accuracy"] == 0.75 and theirs["tuned"]["preference_accuracy"] == 1.0
    assert ours["tuned"]["reward_margin"] == round(beta * 0.5, 4) and theirs["run"] == "n1"
    night = {"run": "n2", "tuned": {"exact_match": 0.5}, "gate": ours, "compared_with": theirs}
    ref, why = same_rows_reference(night, {"run": "n1", "tuned": {"exact_match": 0.4}})
    assert why is None
    ok, reason = gate(gate_view(night), ref, "preference_accuracy", 0.01)
    assert not ok and reason.startswith(
        "rejected: preference_accuracy 0.7500 vs current 1.0000 (run n1) on 4 held-out pairs"
    )
    assert gate(gate_view(night), ref, "preference_accuracy", 0.3)[0]
    # the promoted model scored against another row set: not compared
    _logps(gate_dir / "other", [(-4.0, -5.0)] * 4, fingerprint="pairs-b")
    night["compared_with"] = {"run": "n1", **gate_block(cfg.preference, gate_dir / "other", None)}
    assert same_rows_reference(night, {"run": "n1"})[1].startswith("rejected: not compared")
    # the SFT gate's scores carry no preference metric: rejected by name
    sft_night = {"run": "n2", "gate": {"tuned": {"exact_match": 0.5}, "heldout_fingerprint": "r"}}
    ok, reason = gate(
        gate_view(sft_night), {"run": "n1", "tuned": {"exact_match": 0.4}}, "preference_accuracy", 0
    )
    assert (
        not ok
        and reason == "rejected: run n2 has no preference_accuracy score in its summary.json (nightly.metric)"
    )
    ok, reason = gate(gate_view(night), {"run": "n1", "tuned": {"exact_match": 0.4}}, "reward_margin", 0)
    assert not ok and "promoted run n1 has no reward_margin score" in reason
