"""Reading a Slurm allocation."""

import os
import shutil
import socket
import subprocess

import pytest
from llmft.core import slurm
from llmft.core.slurm import current_allocation, expand_nodelist, parse_hostlist, rendezvous_port

HOSTLISTS = [
    ("n1", ["n1"]),
    ("n[1-2]", ["n1", "n2"]),
    ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),  # a range keeps its lower bound's width
    ("n[001-2]", ["n001", "n002"]),
    ("a[1-2],b5,c[9]", ["a1", "a2", "b5", "c9"]),
    ("gpu-a[001-002],gpu-b7", ["gpu-a001", "gpu-a002", "gpu-b7"]),
    # several groups in one name: the cartesian product, the first group varying slowest
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("x[1-2],y[3,5-6]z[7-8]", ["x1", "x2", "y3z7", "y3z8", "y5z7", "y5z8", "y6z7", "y6z8"]),
    ("n1 n2", ["n1", "n2"]),
    ("n[1-2],n1", ["n1", "n2", "n1"]),  # duplicates stay, as scontrol keeps them
]


@pytest.mark.parametrize("nodelist,hosts", HOSTLISTS)
def test_parse_hostlist(nodelist, hosts):
    assert parse_hostlist(nodelist) == hosts


def test_parse_hostlist_keeps_a_suffix_after_the_last_group():
    # Slurm rejects this form; some site wrappers print it, and expanding it costs nothing.
    assert parse_hostlist("mi300x-[008-010]-ib") == ["mi300x-008-ib", "mi300x-009-ib", "mi300x-010-ib"]


@pytest.mark.parametrize("bad", ["n[2-1]", "n[1-2", "n[1-2]]", "n[a-b]", "n[]"])
def test_parse_hostlist_rejects_malformed_lists(bad):
    with pytest.raises(ValueError):
        parse_hostlist(bad)


def test_expand_nodelist_falls_back_to_the_parser_without_scontrol(monkeypatch):
    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)
    assert expand_nodelist("rack[1-2]-node[01-02]") == parse_hostlist("rack[1-2]-node[01-02]")


def test_expand_nodelist_prefers_scontrol_and_falls_back_when_it_fails(monkeypatch):
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        # scontrol without a config source prints nothing on stdout (and exits 0 for a bad list)
        ok = cmd[-1] == "n[1-2]"
        return subprocess.CompletedProcess(cmd, 0 if ok else 1, "n1\nn2\n" if ok else "", "")

    monkeypatch.setattr(slurm.shutil, "which", lambda name: "/usr/bin/scontrol")
    monkeypatch.setattr(slurm.subprocess, "run", fake_run)
    assert expand_nodelist("n[1-2]") == ["n1", "n2"]
    assert expand_nodelist("g[7-8]") == ["g7", "g8"]  # scontrol failed: the parser answered
    assert calls[0] == ["scontrol", "show", "hostnames", "n[1-2]"]


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol is not installed")
@pytest.mark.parametrize("nodelist", [h for h, _ in HOSTLISTS])
def test_parse_hostlist_matches_scontrol(nodelist, tmp_path):
    env = dict(os.environ)
    if "SLURM_CONF" not in env:  # `show hostnames` needs a config source, not a controller
        conf = tmp_path / "slurm.conf"
        conf.write_text("ClusterName=hostlist\nSlurmctldHost=localhost\n")
        env["SLURM_CONF"] = str(conf)
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, env=env, timeout=20
    )
    assert out.stdout.split() == parse_hostlist(nodelist), out.stderr


def test_port_is_per_job_and_in_range():
    assert rendezvous_port("1234") != rendezvous_port("1235")
    assert 29500 <= rendezvous_port("987654") < 31500
    assert rendezvous_port(None) == 29500


def test_allocation_outside_slurm_is_one_local_node_on_a_free_port():
    alloc = current_allocation({})
    assert alloc.nnodes == 1 and alloc.node_rank == 0 and alloc.master_addr == "127.0.0.1"
    with socket.socket() as busy:  # a port another pipeline holds is never handed out
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert all(current_allocation({}).master_port != taken for _ in range(20))


def test_allocation_from_slurm_env():
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[01-04]", "SLURMD_NODENAME": "gpu03"}
    alloc = current_allocation(env)
    assert alloc.nodes == ["gpu01", "gpu02", "gpu03", "gpu04"]
    assert alloc.node_rank == 2 and alloc.master_port == rendezvous_port("77")


def test_allocation_refuses_unknown_node():
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURMD_NODENAME": "other"}
    with pytest.raises(RuntimeError, match="cannot tell this node's rank"):
        current_allocation(env)


@pytest.mark.parametrize(
    "resources,gpus",
    [
        ({"gres": "gpu:mi300x:8"}, 8),
        ({"gres": "'gpu:mi300x:8'"}, 8),  # the quotes a profile keeps
        ({"gres": "gpu:4"}, 4),
        ({"gres": "gpu"}, 1),
        ({"gres": "tmpdisk:100"}, None),
        ({"gpu": 8}, 8),
        ({"slurm_extra": "'--exclusive --gpus-per-node=h100:4'"}, 4),
        ({"slurm_partition": "mi300x"}, None),
    ],
)
def test_gpus_a_rule_requests(resources, gpus):
    assert slurm.gpus_requested(resources) == gpus


MI300X = {"slurm_partition": "mi300x", "gres": "gpu:mi300x:8"}


def test_profile_and_config_that_disagree_are_named():
    gpu_jobs = {rule: MI300X for rule in slurm.GPU_STAGES}
    cpu_jobs = {rule: {"slurm_partition": "cpu"} for rule in slurm.GPU_STAGES}
    assert slurm.resources_mismatch(8, False, gpu_jobs) is None
    assert slurm.resources_mismatch(0, False, {}) is None  # the local executor asks for nothing
    assert slurm.resources_mismatch(0, True, gpu_jobs) is None  # a CPU smoke test on purpose
    msg = slurm.resources_mismatch(0, False, gpu_jobs)
    assert "requests 8 GPU(s) per node for verify_env" in msg and "hardware.gpus_per_node is 0" in msg
    assert "hardware.allow_cpu_on_gpu_jobs: true" in msg
    msg = slurm.resources_mismatch(4, False, gpu_jobs)
    assert "requests 8 GPU(s)" in msg and "hardware.gpus_per_node is 4" in msg
    msg = slurm.resources_mismatch(8, False, cpu_jobs)
    assert "requests no GPUs for verify_env" in msg and 'gres: "gpu:<type>:8"' in msg
    # allow_cpu_on_gpu_jobs never excuses a wrong count
    assert "is 4" in slurm.resources_mismatch(4, True, gpu_jobs)
    # the preference stage's jobs are GPU jobs too: a profile that forgot their gres is named
    for rule in ("preference", "evaluate_preference", "evaluate_preference_gate"):
        msg = slurm.resources_mismatch(8, False, gpu_jobs | {rule: {"slurm_partition": "mi300x"}})
        assert f"requests no GPUs for {rule}" in msg
