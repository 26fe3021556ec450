"""verify_env for real on CPU: the probe child, torchrun with gloo over 2 processes, the report.

Also a real hang (a second node that never comes) killed once every node's probe budget and
verify.timeout_seconds have passed, and two
"nodes" on this host, each with its own launcher as `srun --ntasks-per-node=1` would start them.
Slurm's view is given through the SLURM_* variables that slurm.current_allocation reads; `scontrol`
is kept off PATH so no Slurm daemon is asked (the cluster tests do that).
"""

import json
import os
import random
import subprocess
import sys
import time

from tests.conftest import BIN, REPO


def verify(tmp_path, env_extra=None, timeout=180, **overrides):
    """Run `python -m llmft verify-env` on the repo's config plus overrides; (process, out path)."""
    out = tmp_path / "env" / "verify.json"
    env = dict(os.environ, PATH=str(BIN), PYTHONUNBUFFERED="1")
    for key in [k for k in env if k.startswith("SLURM")]:
        env.pop(key)
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "llmft", "verify-env", "--config", str(REPO / "config/config.yaml")]
    if overrides:
        cmd += ["--overrides", json.dumps(overrides)]
    proc = subprocess.Popen(
        cmd + ["--out", str(out)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, out


def slurm_env(job_id, node_rank, nodelist="localhost,ghost"):
    return {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NNODES": "2",
        "SLURM_NODEID": str(node_rank),
        "SLURMD_NODENAME": f"n{node_rank + 1}",
    }


def test_cpu_stage_runs_gloo_over_two_processes(tmp_path):
    t0 = time.monotonic()
    proc, out = verify(tmp_path)
    log, _ = proc.communicate(timeout=180)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, log[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["vendor"] == "cpu" and report["world_size"] == 2
    c = report["collectives"]
    assert c["backend"] == "gloo" and c["world_size"] == 2 and c["sum_ok"]
    assert [r["rank"] for r in c["ranks"]] == [0, 1] and all(r["gemm_tflops"] > 0 for r in c["ranks"])
    for op in ("all_reduce", "all_gather"):
        sizes = [row["bytes"] for row in c["bandwidth"][op]]
        assert len(sizes) == 3 and all(row["busbw_gbs"] > 0 for row in c["bandwidth"][op])
    assert c["transport"]["intra"] == "TCP (gloo)"
    node = report["nodes"][0]
    assert node["packages"]["deepspeed"] and node["attention"]["attention"] == "sdpa"
    assert not (tmp_path / "env" / "verify.failed.json").exists()
    assert "[verify_env] passed" in log
    # Quick on 2 shared cores: the probe's imports overlap the collective check.
    assert wall < 150, f"verify_env took {wall:.0f} s"


def test_a_node_that_never_comes_is_killed_and_reported(tmp_path):
    job = random.randint(1000, 1999)  # above the test cluster's own job ids: no port shared
    t0 = time.monotonic()
    scratch = tmp_path / "scratch"
    proc, out = verify(
        tmp_path,
        dict(slurm_env(job, 0), LLMFT_VERIFY_SCRATCH=str(scratch)),
        hardware={"nodes": 2, "processes_per_node": 1},
        # The other node's probe may take its whole budget: the wait for it is that plus 5 s.
        verify={
            "timeout_seconds": 5,
            "probe_timeout_seconds": 60,
            "canary": False,
            "required_packages": ["torch"],
        },
        sft={"zero_stage": 0},
    )
    log, _ = proc.communicate(timeout=180)
    wall = time.monotonic() - t0
    assert proc.returncode == 1, log[-3000:]
    failed = json.loads((tmp_path / "env" / "verify.failed.json").read_text())
    assert failed == json.loads(out.read_text()) and not failed["ok"]
    bad = {f["check"]: f for f in failed["findings"] if not f["ok"]}
    assert set(bad) == {"collectives:rendezvous"}, bad
    f = bad["collectives:rendezvous"]
    assert "did not all meet within 65 s of the start" in f["message"] and "were killed" in f["message"]
    assert "never all met" in f["fix"]
    assert "srun --nodes=N --ntasks-per-node=1" in f["fix"] and f"localhost:{29500 + job - 2000}" in f["fix"]
    assert failed["nodes"][0]["packages"]["torch"]  # this node's facts are still reported
    assert "FAIL collectives:rendezvous" in log and "fix:" in log
    # The bound holds: the probe's budget plus the 5 s timeout, not a hang.
    assert 65 <= wall < 150, f"took {wall:.0f} s"  # a hang would be cut at 180 s by communicate()
    # torchrun and its workers were ended with it.
    leftover = subprocess.run(["pgrep", "-f", f"--scratch={scratch}/"], capture_output=True)
    assert leftover.stdout == b""


def test_two_nodes_one_report_from_node_zero(tmp_path):
    job = random.randint(1000, 1999)  # above the test cluster's own job ids: no port shared
    # Only torch imported and ZeRO off: the other tests cover the imports; this one the gathering.
    overrides = {
        "hardware": {"nodes": 2, "processes_per_node": 1},
        "verify": {"required_packages": ["torch"]},
        "sft": {"zero_stage": 0},
    }
    procs = [verify(tmp_path, slurm_env(job, rank, "localhost,localhost"), **overrides)[0] for rank in (0, 1)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    report = json.loads((tmp_path / "env" / "verify.json").read_text())
    assert report["ok"] and report["nnodes"] == 2
    assert [n["host"] for n in report["nodes"]] == ["n1", "n2"]  # every node's facts, gathered
    assert report["collectives"]["world_size"] == 2
    assert {r["host"] for r in report["collectives"]["ranks"]} == {"n1", "n2"}
    assert "node rank 0 writes the report" in logs[1] and "[verify_env] passed" not in logs[1]


def test_qlora_config_checks_bitsandbytes_on_the_node(tmp_path):
    """sft.quantization_bit: verify_env runs a bitsandbytes 4-bit layer on the node, or fails naming
    the fix. envs/cpu.txt has no bitsandbytes, so on the CPU environment it is the refusal."""
    import importlib.util

    qlora = {"finetuning_type": "lora", "quantization_bit": 4, "zero_stage": 0}
    overrides = {"sft": qlora, "verify": {"canary": False}}
    proc, out = verify(tmp_path, **overrides)
    log, _ = proc.communicate(timeout=180)
    report = json.loads(out.read_text())
    (finding,) = [f for f in report["findings"] if f["check"].split("@")[0] == "bitsandbytes"]
    if importlib.util.find_spec("bitsandbytes") is None:
        assert proc.returncode == 1 and not report["ok"], log[-3000:]
        assert not finding["ok"] and "not installed" in finding["message"]
        assert "pip install bitsandbytes" in finding["fix"] and "sft.quantization_bit: none" in finding["fix"]
        assert "FAIL" in log and "bitsandbytes" in log
    else:  # a bitsandbytes with a CPU backend (0.46+): its quantized layer runs here
        assert proc.returncode == 0 and finding["ok"], log[-3000:]
        assert "4-bit layer ran on cpu" in finding["message"]
