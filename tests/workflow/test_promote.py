"""The promoted model through the real nightly on the local profile: a night that trains and promotes,
`llmft promote` / `llmft rollback` on copies of that real run, retention that keeps what the promoted
model descends from, the gate comparing both models on the same held-out rows, and refusals before
any job."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from llmft.core.assets import synthetic_rows
from llmft.nightly.run import retain

from tests.conftest import BIN, REPO, make_workdir, place_verify, reuse_verify, snakemake_env

pytestmark = pytest.mark.workflow

NIGHT = {
    "data__sources": [{"path": "data/rows.jsonl", "format": "alpaca", "weight": 1.0}],
    "sft__max_steps": 30,
    "sft__logging_steps": 10,
    "eval__max_rows": 48,  # the page's rows: fewer than the held-out split (61, then 65 rows)
    "nightly__metric": "eval_loss",
    "nightly__tolerance": 0.5,
}
ROWS = synthetic_rows(700, seed=11)


def write_rows(path: Path, rows: list[dict], mode: str = "w") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, mode) as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


def llmft(work: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python -m llmft ...` in the working directory, as a user types it."""
    return subprocess.run(
        [str(BIN / "python"), "-m", "llmft", *args],
        cwd=work, env=snakemake_env("local"), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def night(work: Path, run: str) -> subprocess.CompletedProcess:
    profile = str(REPO / "profiles" / "local")
    return llmft(work, "nightly", "--run", run, "--profile", profile, "--", "-s", str(REPO / "Snakefile"))


def state(results: Path) -> dict:
    return json.loads((results / "nightly/state.json").read_text())


@pytest.fixture(scope="module")
def night1(tmp_path_factory):
    """One real night (retrain mode, nothing promoted yet): it trains and promotes."""
    work = make_workdir(tmp_path_factory.mktemp("nightly"), **NIGHT)
    write_rows(work / "data/rows.jsonl", ROWS[:500])
    reuse_verify(work, "night1")  # this machine's verify_env report: nothing here asserts on it
    proc = night(work, "night1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return work


def copy_run(src: Path, results: Path, name: str) -> Path:
    """A copy of a real finished run under another name (its training work folder left out)."""
    shutil.copytree(src, results / name, ignore=shutil.ignore_patterns("work"), symlinks=True)
    summary = results / name / "report/summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "run": name}))
    return results / name


@pytest.fixture
def runs(night1, tmp_path):
    """A scratch results/ holding three copies (a, b, c) of the real night's run, nothing promoted."""
    work = tmp_path / "w"
    results = work / "results"
    for name in ("a", "b", "c"):
        copy_run(night1 / "results/night1", results, name)
    return work, results


def test_the_first_night_promotes_and_records_who_when_why(night1):
    results = night1 / "results"
    assert os.readlink(results / "current") == "night1"
    assert json.loads((results / "current.json").read_text())["run"] == "night1"
    [entry] = state(results)["promotions"]
    assert entry["action"] == "promote" and entry["from"] is None and entry["to"] == "night1"
    assert "@" in entry["who"] and entry["at"].endswith("+00:00")
    assert entry["why"].startswith("nightly gate: first promoted model")
    # what the gate's next comparison needs: the rows this model was scored on
    summary = json.loads((results / "night1/report/summary.json").read_text())
    assert len(summary["heldout_fingerprint"]) == 16
    assert (
        json.loads((results / "current.json").read_text())["heldout_fingerprint"]
        == summary["heldout_fingerprint"]
    )


def test_promote_and_rollback_move_current_and_record_why(runs):
    work, results = runs
    for run, why in (("a", "first"), ("b", "better on the new rows"), ("c", "try c")):
        proc = llmft(work, "promote", run, "--why", why)
        assert proc.returncode == 0, proc.stderr
        assert os.readlink(results / "current") == run
    proc = llmft(work, "rollback", "--why", "c answers in the wrong language")
    assert proc.returncode == 0, proc.stderr
    assert os.readlink(results / "current") == "b"
    assert json.loads((results / "current.json").read_text())["run"] == "b"
    # c's real page and the trend say what happened to it
    page = (results / "c/report/index.html").read_text()
    assert "Nightly promotion: <b>rolled back</b> (results/current rolled back from here to b by hand" in page
    assert "rolled back: results/current rolled back from here to b" in (results / "trend.html").read_text()
    proc = llmft(work, "rollback", "--why", "b too")
    assert proc.returncode == 0 and os.readlink(results / "current") == "a", proc.stderr
    history = state(results)["promotions"]
    assert [(e["action"], e["from"], e["to"]) for e in history] == [
        ("promote", None, "a"),
        ("promote", "a", "b"),
        ("promote", "b", "c"),
        ("rollback", "c", "b"),
        ("rollback", "b", "a"),
    ]
    assert history[3]["why"] == "c answers in the wrong language" and "@" in history[3]["who"]
    assert state(results)["promoted"] == "a"
    # nothing before a: refused by name, current unchanged
    proc = llmft(work, "rollback")
    assert proc.returncode == 2 and "llmft rollback: no earlier promoted run" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and os.readlink(results / "current") == "a"
    assert not list(results.glob(".current*"))  # no link left half-made


@pytest.mark.reliability(
    fault=(
        "`llmft promote` of a run without summary.json, of one whose published weights are truncated, "
        "of `current`; `llmft rollback` to a run whose folder was deleted"
    ),
    seen=(
        "refused with exit 2, naming the command, the run and the missing or broken file; "
        "`results/current` stays where it was"
    ),
    steps_lost="none",
    data_lost="none",
)
def test_unfinished_or_gone_runs_are_refused_by_name(runs):
    work, results = runs
    assert llmft(work, "promote", "a").returncode == 0
    (results / "b/report/summary.json").unlink()
    weights = next((results / "c/sft/model").glob("*.safetensors"))
    with open(weights, "r+b") as fh:
        fh.truncate(weights.stat().st_size // 2)
    for run, needle in (
        ("b", "llmft promote b: run b is not a finished run: "),
        ("c", "is not a whole safetensors file"),
        ("current", "config key run: 'current' is reserved"),
    ):
        proc = llmft(work, "promote", run)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and os.readlink(results / "current") == "a"
    assert "summary.json cannot be read" in llmft(work, "promote", "b").stderr
    # a rollback target whose folder retention (or a person) deleted
    copy_run(results / "a", results, "d")
    assert llmft(work, "promote", "d").returncode == 0
    shutil.rmtree(results / "a")
    proc = llmft(work, "rollback")
    assert proc.returncode == 2 and "previously promoted run a's folder" in proc.stderr, proc.stderr
    assert os.readlink(results / "current") == "d"


@pytest.mark.reliability(
    fault="a published model changed in place at the same size (one byte flipped, its mtime set back)",
    seen=(
        "`llmft promote` refuses it and `snakemake -n` refuses to build on it (the run itself and a run "
        "continuing from it), each naming the file; an intact copy still promotes"
    ),
    steps_lost="none",
    data_lost="none: the changed model is never trusted",
)
def test_a_published_model_changed_in_place_is_trusted_nowhere(runs):
    """One byte of c's published weights flipped at the same size, its time set back: `llmft promote`
    refuses it, Snakemake refuses to build on it (its own run's page and scores, and a run continuing
    from it), each naming the file."""
    work, results = runs
    weights = next((results / "c/sft/model").glob("*.safetensors"))
    st = weights.stat()
    with open(weights, "r+b") as fh:
        fh.seek(st.st_size - 3)
        byte = fh.read(1)
        fh.seek(st.st_size - 3)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    needle = f"{weights.relative_to(work)} no longer has the content sealed when published"
    proc = llmft(work, "promote", "c")
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert not (results / "current").exists()
    write_rows(work / "data/rows.jsonl", ROWS[:500])
    for run, over in (("c", {}), ("d", {"model__continue_from": "results/c"})):
        make_workdir(work, **NIGHT, **over)
        proc = subprocess.run(
            [str(BIN / "snakemake"), "-n", "-s", str(REPO / "Snakefile"), "--config", f"run={run}"],
            cwd=work, env=snakemake_env("local"), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode != 0 and needle in proc.stderr, proc.stderr[-3000:]
        assert "llmft config error" in proc.stderr and "Traceback" not in proc.stderr
    # the untouched copies still pass: b can be promoted
    assert llmft(work, "promote", "b").returncode == 0


def with_lineage(results: Path, run: str, parent: str | None, chain: list[str]) -> None:
    """The lineage the run's lineage.json records (the shape a continued night's lineage has)."""
    path = results / run / "lineage.json"
    record = json.loads(path.read_text())
    record.update(parent=parent, chain=chain)
    path.write_text(json.dumps(record))


def test_retention_keeps_what_the_promoted_model_descends_from(runs):
    """a <- b <- c (c continued from b, b from a); c promoted after x; keep_runs 1 would delete every
    older night, but a and b are c's ancestors and x is the rollback target: only y goes."""
    work, results = runs
    for name in ("x", "y"):
        copy_run(results / "a", results, name)
    with_lineage(results, "b", "a", ["a"])
    with_lineage(results, "c", "b", ["a", "b"])
    for run in ("x", "c"):
        assert llmft(work, "promote", run).returncode == 0
    st = state(results)
    st["nights"] = [{"run": r, "status": "rejected"} for r in ("a", "b", "x", "y", "c")]
    deleted = retain(results, st, keep=1, keep_promoted=2)
    assert deleted == ["y"]
    assert all((results / r).is_dir() for r in ("a", "b", "c", "x")) and not (results / "y").exists()
    # with keep_promoted 1 the rollback target x may go too; c's ancestors never
    assert retain(results, st, keep=1, keep_promoted=1) == ["x"]
    assert (results / "a").is_dir() and (results / "b").is_dir()


@pytest.mark.reliability(
    fault=(
        "a `nightly.mode: continue` night with nothing promoted yet, with `results/current` pointing at "
        "a deleted run, or at a run whose published model lost its config.json"
    ),
    seen=(
        "refused before any job (exit 2, no run folder), naming `nightly.mode continue`, the run and "
        "the missing file; the night is recorded as refused"
    ),
    steps_lost="none",
    data_lost="none",
)
def test_a_continue_night_without_a_usable_promoted_model_is_refused_before_any_job(runs):
    work, results = runs
    make_workdir(work, **NIGHT, nightly__mode="continue")
    write_rows(work / "data/rows.jsonl", ROWS[:500])
    proc = night(work, "n1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "nightly.mode continue: there is no promoted model yet" in proc.stderr
    assert not (results / "n1").exists() and not (results / "nightly/n1.log").exists()
    assert state(results)["nights"][-1]["status"] == "refused"
    # a dangling link: the promoted run's folder is gone
    (results / "current").symlink_to("gone", target_is_directory=True)
    proc = night(work, "n2")
    assert proc.returncode == 2 and "points at run gone, whose folder" in proc.stderr, proc.stderr
    assert "nightly.mode continue: " in proc.stderr and not (results / "n2").exists()
    # a corrupt one: its published model folder lost its config.json
    os.replace(results / "current", results / "stale")
    (results / "current").symlink_to("a", target_is_directory=True)
    (results / "a/sft/model/config.json").unlink()
    proc = night(work, "n3")
    assert proc.returncode == 2 and "nightly.mode continue: run a is not a finished run" in proc.stderr
    assert "config.json" in proc.stderr and not (results / "n3").exists()
    assert [n["status"] for n in state(results)["nights"]] == ["refused"] * 3


def test_the_fallback_to_retrain_is_said_in_the_log_and_the_state(runs):
    """nightly.fallback: retrain with nothing promoted: the night trains from the base model and says
    so (here its snakemake fails at once on a profile that does not exist: no training needed)."""
    work, results = runs
    make_workdir(work, **NIGHT, nightly__mode="continue", nightly__fallback="retrain")
    write_rows(work / "data/rows.jsonl", ROWS[:500])
    proc = llmft(work, "nightly", "--run", "n1", "--profile", "no such profile")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    note = "no promoted model: retrained from base, as nightly.fallback allows"
    assert f"[nightly] run n1: {note}" in proc.stdout
    assert note in (results / "nightly/n1.log").read_text()
    last = state(results)["nights"][-1]
    assert last["note"] == note and last["started_from"] == "base model" and last["mode"] == "continue"


def test_retrain_every_makes_a_night_retrain_after_that_many_continued_runs(runs):
    """nightly.retrain_every 3 with c promoted two continued runs from its base-model training
    (c <- b <- a): tonight retrains from the base model and says so; at 4, or null, it continues
    from c. (Snakemake fails at once on a profile that does not exist: the start is decided before.)"""
    work, results = runs
    with_lineage(results, "b", "a", ["a"])
    with_lineage(results, "c", "b", ["a", "b"])
    assert llmft(work, "promote", "c").returncode == 0
    write_rows(work / "data/rows.jsonl", ROWS[:500])
    starts = {}
    for run, every in (("n1", 3), ("n2", 4), ("n3", None)):
        make_workdir(work, **NIGHT, nightly__mode="continue", nightly__retrain_every=every)
        proc = llmft(work, "nightly", "--run", run, "--profile", "no such profile")
        assert proc.returncode == 1, proc.stdout + proc.stderr
        last = state(results)["nights"][-1]
        assert last["run"] == run and last["mode"] == "continue"
        over = yaml.safe_load((results / f"nightly/{run}.config.yaml").read_text())
        starts[run] = (last["started_from"], last["note"], over.get("model"), proc.stdout)
    note = (
        "nightly.retrain_every 3: the promoted run c is 2 continued run(s) from a training from the base "
        "model (at most 2 in a row): tonight retrains from the base model on all rows"
    )
    started, said, model, out = starts["n1"]
    assert (started, said, model) == ("base model", note, None)
    assert f"[nightly] run n1: {note}" in out and "training run n1 from the base model" in out
    assert note in (results / "nightly/n1.log").read_text()
    for run in ("n2", "n3"):
        started, said, model, out = starts[run]
        assert (started, said, model) == ("results/c", None, {"continue_from": "results/c"})
        assert f"training run {run} from results/c" in out
    # a rollback to a model trained from the base restarts the count: a continues even at 2
    assert llmft(work, "promote", "a").returncode == 0
    make_workdir(work, **NIGHT, nightly__mode="continue", nightly__retrain_every=2)
    assert llmft(work, "nightly", "--run", "n4", "--profile", "no such profile").returncode == 1
    assert state(results)["nights"][-1]["started_from"] == "results/a"


@pytest.fixture(scope="module")
def night2(night1):
    """A second real night on 25 appended rows (5 %) in continue mode: it starts from the promoted
    night1, which is scored on night2's held-out split for the gate."""
    make_workdir(night1, **NIGHT, nightly__mode="continue")
    write_rows(night1 / "data/rows.jsonl", ROWS[500:525], mode="a")
    place_verify(night1 / "results/night1/env/verify.json", night1, "night2")  # the same machine's
    proc = night(night1, "night2")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return night1, proc


def test_the_gate_scores_both_models_on_every_heldout_row(night2):
    """The page scores the first eval.max_rows (48) rows; the gate scores night2's tuned model and
    the promoted night1 on all of night2's held-out rows (65), and compares those."""
    from llmft.evaluate.run import heldout_fingerprint

    work, proc = night2
    results = work / "results"
    over = yaml.safe_load((results / "nightly/night2.config.yaml").read_text())
    assert over["nightly"] == {"compare_with": "results/night1"}
    s2 = json.loads((results / "night2/report/summary.json").read_text())
    split = [json.loads(line) for line in (results / "night2/data/heldout.jsonl").read_text().splitlines()]
    split1 = (results / "night1/data/heldout.jsonl").read_text().splitlines()
    assert len(split) > len(split1) > s2["heldout_rows"] == 48  # appended rows reached the split
    assert s2["heldout_fingerprint"] == heldout_fingerprint(split[:48])
    everything = {"heldout_rows": len(split), "heldout_fingerprint": heldout_fingerprint(split)}
    promoted = json.loads((results / "night2/eval/promoted/metrics.json").read_text())
    mine = json.loads((results / "night2/eval/gate/metrics.json").read_text())
    # the promoted model and night2's tuned model, each on every row of night2's split
    assert promoted["model"] == "results/night1/sft/model" and mine["model"] == "results/night2/sft/model"
    # with each model's exact match per task of the demo rows (first, last, repeat, count, category)
    assert len(promoted["exact_match_by_task"]) > 1 and len(mine["exact_match_by_task"]) > 1
    assert s2["compared_with"] == {
        "run": "night1",
        "tuned": {m: promoted.get(m) for m in s2["tuned"]},
        **everything,
        "exact_match_by_task": promoted["exact_match_by_task"],
    }
    assert s2["gate"] == {
        "tuned": {m: mine.get(m) for m in s2["tuned"]},
        **everything,
        "exact_match_by_task": mine["exact_match_by_task"],
    }
    # the run page shows the same comparison: both models, the gate's metric first, the same rows
    page = (results / "night2/report/index.html").read_text()
    assert "Nightly gate" in page and f"both on the same {len(split)} held-out rows" in page
    assert "<td>promoted: night1</td>" in page and "eval_loss (gate)" in page
    assert "<th>exact_match[repeat]</th>" in page
    decision = json.loads((results / "night2/promotion.json").read_text())
    old, new = s2["compared_with"]["tuned"]["eval_loss"], s2["gate"]["tuned"]["eval_loss"]
    assert decision["metric"] == {"eval_loss": new}
    assert (
        f"eval_loss {new:.4f} vs current {old:.4f} (run night1) on {len(split)} held-out rows"
        in (decision["reason"])
    ), decision
    # what the next night compares against: night2's scores on those rows
    current = json.loads((results / "current.json").read_text())
    assert current["heldout_fingerprint"] == everything["heldout_fingerprint"]
    assert decision["status"] == "promoted" and os.readlink(results / "current") == "night2"
    history = state(results)["promotions"]
    assert (history[-1]["from"], history[-1]["to"]) == ("night1", "night2")


def test_a_gated_night_runs_its_gate_and_its_report_once(night2):
    """The gate is a job of the night's workflow: its verdict (nightly/gate.json) is the report's
    declared input, so the page shows it the first time it is drawn; the nightly acts on that verdict
    with no second snakemake (no report re-run after the promotion)."""
    work, _ = night2
    results = work / "results"
    log = (results / "nightly/night2.log").read_text()
    jobs = re.findall(r"^\s*(?:local)?rule (\w+):\s*$", log, flags=re.MULTILINE)
    assert jobs.count("report") == 1 and jobs.count("gate") == 1, jobs
    snakemakes = [line for line in log.splitlines() if line.startswith("$ ") and "-m snakemake" in line]
    assert len(snakemakes) == 1 and "--forcerun" not in log, snakemakes
    verdict = json.loads((results / "night2/nightly/gate.json").read_text())
    decision = json.loads((results / "night2/promotion.json").read_text())
    assert (decision["status"], decision["reason"]) == (verdict["status"], verdict["reason"])
    assert verdict["promoted_run"] == "night1" and verdict["kind"] == "heldout"
    page = (results / "night2/report/index.html").read_text()
    assert f"Nightly promotion: <b>{verdict['status']}</b>" in page
    summary = json.loads((results / "night2/report/summary.json").read_text())
    assert summary["promotion"] == {"status": verdict["status"], "reason": verdict["reason"]}
    assert (summary["gate"], summary["compared_with"]) == (verdict["gate"], verdict["compared_with"])


def test_a_continue_night_starts_from_the_promoted_run(night2):
    work, proc = night2
    results = work / "results"
    assert "training run night2 from results/night1" in proc.stdout
    over = yaml.safe_load((results / "nightly/night2.config.yaml").read_text())
    assert over["model"] == {"continue_from": "results/night1"}
    night = state(results)["nights"][-1]
    assert night["mode"] == "continue" and night["started_from"] == "results/night1"
    lineage = json.loads((results / "night2/report/summary.json").read_text())["lineage"]
    assert lineage["parent"] == "night1" and lineage["chain"] == ["night1"]
    assert "results/night1" in lineage["started_from"]


@pytest.mark.reliability(
    fault=(
        "a night whose snakemake refuses the config before any job (here a GPU profile for a CPU "
        "config; the same path carries `model.continue_from`'s checks)"
    ),
    seen=(
        "the night fails with exit 1 and its message and state carry the `llmft config error:` line, "
        "not only a pointer to its log; no run folder"
    ),
    steps_lost="none",
    data_lost="none",
)
def test_a_config_refused_at_dag_time_is_named_by_the_night(tmp_path):
    work = make_workdir(tmp_path)
    profile = str(REPO / "profiles" / "slurm")
    proc = llmft(work, "nightly", "--run", "n1", "--profile", profile, "--", "-s", str(REPO / "Snakefile"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    needle = "snakemake exited 1: llmft config error: the profile requests 8 GPU(s) per node"
    assert f"[nightly] run n1 FAILED: {needle}" in proc.stderr and "Traceback" not in proc.stderr
    assert needle in state(work / "results")["nights"][-1]["reason"]
    assert not (work / "results/n1").exists()
