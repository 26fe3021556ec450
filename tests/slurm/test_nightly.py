"""Nightly retrains on the real Slurm test cluster, in continue mode: a first night from base, a night
continued on appended rows and promoted, one on a changed software stack (quarantined by its
verify_env job, passed) continued on damaging rows and refused, rollback and promote by hand, a skip
when nothing changed, and a concurrent start refused by the lock."""

from __future__ import annotations

import json
import os
import random
import shutil
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest
from llmft.core.assets import synthetic_rows

from tests.conftest import BIN, REPO, make_workdir, place_verify
from tests.slurm.cluster import fast_poll_env
from tests.slurm.test_cluster import _cluster_problem, box_args
from tests.stacks import record_another_stack

pytestmark = pytest.mark.slurm

OLD_TORCH = "2.12.0+cpu"  # the torch night2's recorded stack is edited to: night 3's stack differs

NIGHT = {
    "hardware__allow_cpu_on_gpu_jobs": True,  # CPU ranks in the production profile's GPU jobs
    "data__sources": [{"path": "data/rows.jsonl", "format": "alpaca", "weight": 1.0}],
    "sft__max_steps": 10,
    "sft__logging_steps": 5,
    "eval__max_rows": 24,
    "nightly__keep_runs": 1,
    "nightly__mode": "continue",
    "nightly__fallback": "retrain",
    "nightly__replay_fraction": 0.2,  # one replayed row for every four new ones
    # twice the default rate: night 3's ten steps on noise rows must move the held-out loss past
    # the tolerance for sure
    "nightly__continue_learning_rate_factor": 0.5,
    # held-out loss: deterministic and sensitive, so a damaged night is refused for sure
    "nightly__metric": "eval_loss",
    "nightly__tolerance": 0.02,
    # the gate scores the first 24 held-out rows, the rows every night shares. On the whole split
    # night 3's own noise rows would be held out too, and the model that learned the noise's
    # characters scores better on those than the promoted one: a held-out gate cannot see damage that
    # its own held-out rows share (eval.benchmarks guards against that). test_promote checks the
    # gate on the whole split.
    "nightly__gate_max_rows": 24,
}


@pytest.fixture(scope="module", autouse=True)
def cluster():
    problem = _cluster_problem()
    if problem:
        pytest.skip(f"Slurm test cluster not up: {problem}; run `bash tests/slurm/cluster-up.sh` as root")


def write_rows(path: Path, rows: list[dict], mode: str = "w") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, mode) as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


def nightly_cmd(run: str) -> list[str]:
    return [
        str(BIN / "python"), "-m", "llmft", "nightly", "--run", run,
        "--profile", str(REPO / "profiles" / "slurm"),
        "--", "-s", str(REPO / "Snakefile"), *box_args(),
    ]  # fmt: skip


def start(work: Path, run: str) -> subprocess.Popen:
    # its snakemake polls the cluster every few seconds (tests/slurm/fastpoll)
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **fast_poll_env())
    return subprocess.Popen(nightly_cmd(run), cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def finish(proc: subprocess.Popen, timeout: int = 900) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def damaged(rows: list[dict], seed: int = 5) -> list[dict]:
    """The rows with their answers replaced by random characters: a night of labels no model can learn,
    long enough that they dominate the held-out tokens they reach."""
    rng = random.Random(seed)
    noise = string.ascii_letters + string.digits
    return [{**r, "output": "".join(rng.choice(noise) for _ in range(24))} for r in rows]


def state(work: Path) -> dict:
    return json.loads((work / "results/nightly/state.json").read_text())


def summary(work: Path, run: str) -> dict:
    return json.loads((work / f"results/{run}/report/summary.json").read_text())


def train_rows(work: Path, run: str) -> list[str]:
    """The run's train split, one canonical JSON text per row (rows are identified by content)."""
    lines = (work / f"results/{run}/data/train.jsonl").read_text().splitlines()
    return [json.dumps(json.loads(line), sort_keys=True) for line in lines if line.strip()]


def reuse_verify_of_night1(work: Path, run: str) -> None:
    """Night 1's verify_env report (run for real, a Slurm job) for `run`: the same node, so night 2
    does not check it again (nothing here asserts on verify_env; test_cluster does)."""
    place_verify(work / "results/night1/env/verify.json", work, run)


def reuse_base_model_of_night1(work: Path, run: str) -> None:
    """Night 1's base model (built by its base_model job on Slurm) for `run`, modification times
    kept: every night builds the same builtin:tiny model, so a later night does not build it again
    (nothing here asserts on the base_model job; test_cluster does)."""
    shutil.copytree(work / "results/night1/base_model", work / f"results/{run}/base_model")


def llmft(work: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "python"), "-m", "llmft", *args], cwd=work, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


@pytest.mark.reliability(
    fault=(
        "a second nightly retrain started while one runs; a continued night trained on rows made to "
        "damage the model"
    ),
    seen=(
        "the second is refused by the nightly lock (exit 3, naming its pid); the damaged night is "
        "refused by the gate, naming both held-out losses on the same rows, `results/current` stays "
        "on the promoted run, and `llmft rollback` / `llmft promote` then move it, recording why"
    ),
    steps_lost="none",
    data_lost="none",
)
def test_three_nights_and_a_concurrent_start(tmp_path):
    """Night 1 retrains from base; night 2 continues on appended rows and is promoted; night 3
    continues on damaging rows and is refused; rollback and promote by hand; night 4 skips."""
    work = make_workdir(tmp_path, **NIGHT)
    rows = synthetic_rows(700, seed=11)
    write_rows(work / "data/rows.jsonl", rows[:400])

    # Night 1: continue mode with nothing promoted yet: nightly.fallback retrain trains from base.
    rc, out = finish(start(work, "night1"))
    assert rc == 0, out[-4000:]
    assert "no promoted model: retrained from base, as nightly.fallback allows" in out
    assert "night1 first promoted model" in out
    assert os.readlink(work / "results/current") == "night1"
    assert summary(work, "night1")["lineage"]["parent"] is None

    # Night 2: 100 appended rows; continues from night1 (a second start meanwhile is refused by the
    # lock), trains on the new train rows plus the replay share, and the gate promotes it.
    write_rows(work / "data/rows.jsonl", rows[400:500], mode="a")
    reuse_verify_of_night1(work, "night2")
    reuse_base_model_of_night1(work, "night2")
    night2 = start(work, "night2")
    deadline = time.monotonic() + 60
    while not (work / "results/nightly/night2.log").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    blocked = subprocess.run(nightly_cmd("night2b"), cwd=work, capture_output=True, text=True, timeout=60)
    assert blocked.returncode == 3, blocked.stdout + blocked.stderr
    assert "another nightly run holds" in blocked.stderr and "pid" in blocked.stderr
    assert not (work / "results/night2b").exists()
    rc, out = finish(night2)
    assert rc == 0, out[-4000:]
    assert "training run night2 from results/night1" in out
    lineage = summary(work, "night2")["lineage"]
    assert lineage["parent"] == "night1" and lineage["chain"] == ["night1"]
    old_train, new_train = train_rows(work, "night1"), train_rows(work, "night2")
    new = len(set(new_train) - set(old_train))
    assert 0 < new < 100 and lineage["data"]["new"] == new, lineage
    assert lineage["data"]["replayed"] == round(new / 4) > 0 and lineage["data"]["removed"] == 0, lineage
    assert lineage["data"]["train_rows"] == new + lineage["data"]["replayed"], lineage
    # it started from night1's trained weights: its first loss is near where night1 ended, far
    # below a random start's (night1's first loss)
    first = json.loads((work / "results/night1/sft/train_summary.json").read_text())
    cont = json.loads((work / "results/night2/sft/train_summary.json").read_text())
    assert "results/night1" in lineage["started_from"], lineage
    midway = (first["first_loss"] + first["final_loss"]) / 2
    assert cont["first_loss"] < midway, (cont["first_loss"], first["first_loss"], first["final_loss"])
    s2 = summary(work, "night2")
    assert s2["compared_with"]["run"] == "night1"
    # the gate's scores: both models on the same nightly.gate_max_rows held-out rows
    assert s2["compared_with"]["heldout_fingerprint"] == s2["gate"]["heldout_fingerprint"]
    assert s2["gate"]["heldout_rows"] == 24
    # the gate's rows are the page's (gate_max_rows == eval.max_rows): its pass over night2's model
    # took the page's scores of it instead of generating again
    gate_scores = json.loads((work / "results/night2/eval/gate/metrics.json").read_text())
    assert gate_scores["scores_of"] == "tuned" and gate_scores["label"] == "gate", gate_scores
    assert "its scores taken" in (work / "results/night2/logs/evaluate_gate.log").read_text()
    assert os.readlink(work / "results/current") == "night2", out[-2000:]

    # Night 3: appended rows whose answers are noise; continues from night2 and the gate refuses it.
    # night2 recorded another torch than the nodes have now: night 3's verify_env (a Slurm job, run
    # again, not reused) quarantines the stack on its node before any training; it passes and is
    # recorded.
    write_rows(work / "data/rows.jsonl", damaged(rows[500:700]), mode="a")
    recorded = record_another_stack(work / "results/night2", torch=OLD_TORCH)
    reuse_base_model_of_night1(work, "night3")
    rc, out = finish(start(work, "night3"))
    assert rc == 0, out[-4000:]
    verify3 = json.loads((work / "results/night3/env/verify.json").read_text())
    q = verify3["quarantine"]
    assert q["status"] == "passed" and sorted(q["nodes"]) == verify3["stack"]["nodes"] != [], q
    for host, node in q["nodes"].items():
        assert node["action"] == "quarantine" and node["against"] == recorded["hash"], (host, node)
        assert list(node["checks"]) == ["accumulation", "resume", "canary", "eval_drift"], node
        assert all(c["ok"] for c in node["checks"].values()), node["checks"]
        assert [c[0] for c in node["changes"]] == ["torch"] and node["changes"][0][1] == OLD_TORCH
    night3_stack = next(n for n in state(work)["nights"] if n["run"] == "night3")["stack"]
    assert night3_stack["status"] == "passed" and f"torch {OLD_TORCH} -> " in night3_stack["message"]
    decision = json.loads((work / "results/night3/promotion.json").read_text())
    s3 = summary(work, "night3")
    assert s3["lineage"]["parent"] == "night2" and s3["lineage"]["chain"] == ["night1", "night2"]
    old, new_loss = s3["compared_with"]["tuned"]["eval_loss"], decision["metric"]["eval_loss"]
    assert s3["compared_with"]["heldout_fingerprint"] == s3["gate"]["heldout_fingerprint"]
    assert new_loss > old + NIGHT["nightly__tolerance"], (new_loss, old)
    assert decision["status"] == "rejected", decision
    assert f"{new_loss:.4f}" in decision["reason"] and f"{old:.4f}" in decision["reason"]
    assert f"worse by {round(new_loss, 4) - round(old, 4):.4f}" in decision["reason"], decision
    assert os.readlink(work / "results/current") == "night2"
    assert json.loads((work / "results/current.json").read_text())["run"] == "night2"
    page = (work / "results/night3/report/index.html").read_text()
    assert "Nightly promotion: <b>rejected</b>" in page
    trend = (work / "results/trend.html").read_text()
    assert "night3" in trend and "rejected" in trend
    # Retention (keep_runs 1): night3 is the newest; night2 is promoted, night1 its parent: all kept.
    for run in ("night1", "night2", "night3"):
        assert (work / f"results/{run}/sft/model/config.json").is_file(), run

    # By hand: roll back to night1, then promote night2 again; each move recorded with why.
    back = llmft(work, "rollback", "--why", "night2 drifted on the support rows")
    assert back.returncode == 0 and os.readlink(work / "results/current") == "night1", back.stderr
    # night2's page and the trend say so
    page = (work / "results/night2/report/index.html").read_text()
    assert "Nightly promotion: <b>rolled back</b> (results/current rolled back from here to night1" in page
    assert (
        "rolled back: results/current rolled back from here to night1"
        in (work / "results/trend.html").read_text()
    )
    again = llmft(work, "promote", "night2", "--why", "false alarm")
    assert again.returncode == 0 and os.readlink(work / "results/current") == "night2", again.stderr
    moves = [(e["action"], e["from"], e["to"]) for e in state(work)["promotions"]]
    assert moves == [
        ("promote", None, "night1"),
        ("promote", "night1", "night2"),
        ("rollback", "night2", "night1"),
        ("promote", "night1", "night2"),
    ]
    assert [e["why"] for e in state(work)["promotions"][2:]] == [
        "night2 drifted on the support rows",
        "false alarm",
    ]

    # Night 4: nothing new -> skipped, exit 0, no run folder.
    rc, out = finish(start(work, "night4"), timeout=120)
    assert rc == 0 and "nothing changed since run night3" in out, out
    assert not (work / "results/night4").exists()
    statuses = [(n["run"], n["status"]) for n in state(work)["nights"]]
    assert statuses == [("night1", "promoted"), ("night2", "promoted"), ("night3", "rejected"),
                        ("night4", "skipped")]  # fmt: skip
    print(f"night3 rejected: {decision['reason']}", file=sys.stderr)
