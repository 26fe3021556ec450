"""Nightly retrains on the real Slurm test cluster: train + promote, append rows + gate, skip when
nothing changed, and a concurrent start refused by the lock."""

from __future__ import annotations

import json
import os
import random
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest
from llmft.data.assets import synthetic_rows

from tests.conftest import BIN, REPO, make_workdir
from tests.reliability import reliability
from tests.slurm.test_cluster import _cluster_problem, box_args

pytestmark = pytest.mark.slurm

NIGHT = {
    "hardware__allow_cpu_on_gpu_jobs": True,  # CPU ranks in the production profile's GPU jobs
    "data__sources": [{"path": "data/rows.jsonl", "format": "alpaca", "weight": 1.0}],
    "sft__max_steps": 10,
    "sft__logging_steps": 5,
    "eval__max_rows": 24,
    "nightly__keep_runs": 1,
    # held-out loss: deterministic and sensitive, so a damaged night is refused for sure
    "nightly__metric": "eval_loss",
    "nightly__tolerance": 0.02,
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
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.Popen(nightly_cmd(run), cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def finish(proc: subprocess.Popen, timeout: int = 420) -> tuple[int, str]:
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


@reliability(
    fault="a second nightly retrain started while one runs; a night whose model scores worse",
    seen=(
        "the second is refused by the nightly lock (exit 3, naming its pid); a night trained on "
        "noise labels is refused by the gate, naming both held-out losses, and `results/current` "
        "stays on the promoted run"
    ),
    steps_lost="none",
    data_lost="none",
)
def test_three_nights_and_a_concurrent_start(tmp_path):
    work = make_workdir(tmp_path, **NIGHT)
    rows = synthetic_rows(600, seed=11)
    write_rows(work / "data/rows.jsonl", rows[:400])

    # Night 1: trains and, with nothing promoted yet, promotes.
    rc, out = finish(start(work, "night1"))
    assert rc == 0, out[-4000:]
    assert "night1 first promoted model" in out
    assert os.readlink(work / "results/current") == "night1"
    assert json.loads((work / "results/current.json").read_text())["run"] == "night1"

    # Night 2: appended rows whose answers are noise -> trains, and the gate refuses the worse model;
    # a second start while it runs is refused by the lock.
    old = json.loads((work / "results/current.json").read_text())["tuned"]["eval_loss"]
    write_rows(work / "data/rows.jsonl", damaged(rows[400:]), mode="a")
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
    decision = json.loads((work / "results/night2/promotion.json").read_text())
    new = decision["metric"]["eval_loss"]
    assert new > old + NIGHT["nightly__tolerance"], (new, old)
    assert decision["status"] == "rejected", decision
    assert os.readlink(work / "results/current") == "night1"
    assert json.loads((work / "results/current.json").read_text())["run"] == "night1"
    assert f"{new:.4f}" in decision["reason"] and f"{old:.4f}" in decision["reason"]
    page = (work / "results/night2/report/index.html").read_text()
    assert "Nightly promotion: <b>rejected</b>" in page
    trend = (work / "results/trend.html").read_text()
    assert "night2" in trend and "rejected" in trend
    # Retention keeps one run besides the promoted one; the promoted model is never deleted.
    assert (work / "results/night1/sft/model/config.json").is_file()
    assert (work / "results/night2").is_dir()

    # Night 3: nothing new -> skipped, exit 0, no run folder.
    rc, out = finish(start(work, "night3"), timeout=120)
    assert rc == 0 and "nothing changed since run night2" in out, out
    assert not (work / "results/night3").exists()
    statuses = [(n["run"], n["status"]) for n in state(work)["nights"]]
    assert statuses == [("night1", "promoted"), ("night2", "rejected"), ("night3", "skipped")]
    print(f"night2 rejected: {decision['reason']}", file=sys.stderr)
