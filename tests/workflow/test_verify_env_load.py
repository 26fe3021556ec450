"""verify_env's node probe and its collective check keep separate clocks, on a loaded machine.

The demo's verify_env, for real (probe child, numerics canary, torchrun with gloo over 2 processes),
while busy-loop processes keep every core busy: the probe then takes far longer than
verify.timeout_seconds, and the check still passes. A probe over verify.probe_timeout_seconds
fails as a slow probe, naming the part and the budget, while the collective check passes.
"""

import json
import os
import subprocess
import sys
import time

import pytest
from llmft.core.config import validate
from llmft.core.launch import launch_env
from llmft.core.platform import Platform
from llmft.core.settings import Config
from llmft.core.slurm import current_allocation
from llmft.env.rules import judge
from llmft.env.verify import canary_node

from tests.workflow.test_verify_env import verify

HOG_SECONDS = 1800  # each hog ends by itself even if the test process dies


def start_hogs(n: int) -> list[subprocess.Popen]:
    loop = f"import time\nend = time.time() + {HOG_SECONDS}\nwhile time.time() < end: pass"
    return [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


@pytest.mark.reliability(
    fault=(
        "verify_env's node probe slower than `verify.timeout_seconds` (every core busy here; on a GPU node "
        "a cold compile cache, the canary's FP8 leg)"
    ),
    seen="verify_env passes: the probe has its own budget and the collective check is timed from the "
    "moment its processes meet",
    steps_lost="none",
    data_lost="none",
)
def test_verify_env_passes_while_the_cpu_is_saturated(tmp_path):
    # the collective check's budget: its phases once the processes meet take well under a second
    # here, the probe under the hogs 15-40 s; 5 s keeps the probe the longer of the two on a fast
    # machine too (at 20 s a run saw a 19.7 s probe)
    timeout = 5
    hogs = start_hogs(os.cpu_count() or 2)
    try:
        t0 = time.monotonic()
        # A probe budget well above what the probe takes here: the budget is the next test's subject.
        proc, out = verify(tmp_path, verify={"timeout_seconds": timeout, "probe_timeout_seconds": 1500})
        log, _ = proc.communicate(timeout=1800)
        wall = time.monotonic() - t0
        assert all(h.poll() is None for h in hogs), "the CPU hogs ended before verify_env did"
    finally:
        stop(hogs)
    assert proc.returncode == 0, log[-4000:]
    report = json.loads(out.read_text())
    assert report["ok"] and [f for f in report["findings"] if not f["ok"]] == []
    node = report["nodes"][0]
    probe_s = sum(node["probe_seconds"].values())
    # What used to fail: a probe (the canary included) longer than the collective check's timeout.
    assert "canary" in node["probe_seconds"] and probe_s > timeout, node["probe_seconds"]
    phases = report["collectives"]["phases"]
    assert phases["facts_wait_s"] > 0 and report["collectives"]["sum_ok"]
    print(f"verify_env under load: {wall:.0f} s, probe {probe_s:.0f} s, phases {phases}")


@pytest.mark.reliability(
    fault="a node probe over `verify.probe_timeout_seconds`",
    seen=(
        "`probe:timeout` naming the part (node facts or numerics canary), how long it ran, the budget "
        "and the key that raises it; no collective error and no NCCL hint, and the collective check "
        "still passes"
    ),
    steps_lost="none",
    data_lost="none",
)
def test_a_probe_over_its_budget_is_reported_as_slow_not_as_a_broken_collective(tmp_path):
    proc, out = verify(tmp_path, verify={"probe_timeout_seconds": 1})
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, log[-4000:]
    report = json.loads(out.read_text())
    bad = {f["check"]: f for f in report["findings"] if not f["ok"]}
    assert "probe:timeout" in bad and not [c for c in bad if c.startswith("collectives")], bad
    f = bad["probe:timeout"]
    assert "its node facts part was still in '" in f["message"]
    assert "over the probe's budget of 1 s (verify.probe_timeout_seconds)" in f["message"]
    assert "raise verify.probe_timeout_seconds" in f["fix"] and "NCCL" not in f["fix"]
    # The collective check ran on its own clock, and passed.
    assert report["collectives"]["sum_ok"] and report["collectives"]["world_size"] == 2
    assert "FAIL probe:timeout" in log


def test_a_canary_over_what_the_budget_leaves_is_named(tmp_path):
    cfg = Config.from_dict(validate({}))
    env = launch_env(Platform.declared(cfg, vendor="cpu"), current_allocation())
    t0 = time.monotonic()
    got = canary_node(env, tmp_path, {"host": "here", "build": "cpu", "devices": []}, cfg, 3, t0)
    assert time.monotonic() - t0 < 30  # killed when the budget ran out, not left to finish
    err = got["probe_error"]
    assert err["part"] == "numerics canary" and err["timeout_s"] == 3
    f = {f.check: f for f in judge({"host": "here", "probe_error": err}, cfg, "cpu")}["probe:timeout"]
    assert not f.ok and "its numerics canary part was still in '" in f.message
    assert "budget of 3 s (verify.probe_timeout_seconds)" in f.message
    assert "verify.canary: false" in f.fix
