"""Tests on the real Slurm test cluster (tests/slurm/cluster-up.sh); helpers in tests/slurm/cluster.py.

The upstream stages are built once per session and shared. `slurm_upstream` runs SMALL_RUN (two
nodes x one CPU process, run name `slurm`) through UPSTREAM_RULES on the cluster: verify_env (with
its numerics canary, on both nodes), base_model, synthetic_data and prepare_data. A test that
starts from them takes a copy and runs only the stages after them, e.g.::

    def test_my_fault(slurm_upstream, tmp_path):
        work = slurm_upstream.copy_to(tmp_path / "w", sft__max_steps=30, sft__save_steps=10)
        proc = cluster_run(work, f"results/{RUN}/sft/train_summary.json")
        assert not rebuilt_upstream(proc.stdout + proc.stderr)

`copy_to` copies the results and Snakemake's records of them (a few MB), so the copy's own stages
(render_sft_config, pack_data, sft, evaluate, report) rerun and the upstream ones do not, unless an
override changes a key they read (then that stage reruns, which `rebuilt_upstream` shows). The copy
keeps the run name `slurm`: every stage's recorded params hold it. Tests of another config (a
missing package, injected node facts, nightly's own data) build their own workdir with make_workdir.

Every test module here skips when the cluster is not up (`cluster`, autouse). All of tests/slurm is
one xdist unit (tests/conftest.py), so `slurm_upstream` is built once, by the first test asking.
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import make_workdir
from tests.slurm.cluster import (
    SMALL_RUN,
    UPSTREAM_TARGETS,
    Upstream,
    _cluster_problem,
    cluster,  # noqa: F401 (autouse: every module of tests/slurm skips without the cluster)
    cluster_run,
    slurm_records,
    submissions,
)


@pytest.fixture(scope="session")
def slurm_upstream(tmp_path_factory) -> Upstream:
    problem = _cluster_problem()
    if problem:
        pytest.skip(f"Slurm test cluster not up: {problem}; run `bash tests/slurm/cluster-up.sh` as root")
    work = make_workdir(tmp_path_factory.mktemp("upstream"), **SMALL_RUN)
    start = time.monotonic()
    proc = cluster_run(work, "--verbose", *UPSTREAM_TARGETS)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    print(f"upstream stages on Slurm: {time.monotonic() - start:.0f} s")
    ids = [i for rule_ids in submissions(log).values() for i in rule_ids]
    return Upstream(work, log, slurm_records(ids))
