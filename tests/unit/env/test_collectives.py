"""The collective check's pure parts and rules: bus bandwidth, NCCL/RCCL log parsing, floors, verdicts.

The RCCL logs and MI300X facts under tests/fixtures/ were written by hand in RCCL's INFO format, not
captured on a node (tests/fixtures/README.md); the log parser also gets a case built independently of
them, from NCCL/RCCL INFO lines as public issue reports show them. The H200 logs were captured on the
device machine. Each failure rule (PCIe fallback, slow GEMM, hang, wrong sum) has a test that makes it
fire.
"""

import copy
import json

import pytest
from llmft.core import hardware
from llmft.core.config import validate
from llmft.core.settings import Config, Verify
from llmft.core.slurm import Allocation
from llmft.env.collectives import bus_bandwidth, parse_nccl_log, summarize_transport
from llmft.env.rules import judge_collectives, judge_run
from llmft.env.verify import _meet_failure, _timeout_failure

from tests.conftest import REPO

FIX = REPO / "tests/fixtures"
MI300X = json.loads((FIX / "facts_mi300x.json").read_text())
XGMI_LOG = (FIX / "rccl_mi300x_xgmi.log").read_text()
PCIE_LOG = (FIX / "rccl_mi300x_pcie.log").read_text()
GiB = 2**30


def typed(raw: dict) -> Config:
    return Config.from_dict(validate(raw))


ROCM8 = typed({"hardware": {"vendor": "rocm", "gpus_per_node": 8}})


def coll(busbw=(310.0, 280.0), gemm=650.0, log=XGMI_LOG, world=8, library="rccl", nnodes=1):
    """A collective result as llmft.env.collectives writes it, for `world` MI300X ranks."""
    ranks = [
        {
            "rank": r,
            "host": f"mi300x-00{1 + r // 8}",
            "device": f"cuda:{r % 8}",
            "gemm_tflops": gemm,
            "gemm_n": 8192,
            "gemm_dtype": "bfloat16",
        }
        for r in range(world)
    ]
    return {
        "world_size": world,
        "nnodes": nnodes,
        "sum_ok": True,
        "bandwidth": {
            "all_reduce": [{"bytes": 16 * 2**20, "busbw_gbs": 40.0}, {"bytes": GiB, "busbw_gbs": busbw[0]}],
            "all_gather": [{"bytes": 16 * 2**20, "busbw_gbs": 30.0}, {"bytes": GiB, "busbw_gbs": busbw[1]}],
        },
        "ranks": ranks,
        "transport": summarize_transport([parse_nccl_log(log)], library),
    }


def rules(c, cfg=ROCM8, gpus=8, nnodes=1):
    spec = hardware.GPUS["mi300x"]
    return judge_collectives(
        c, cfg.hardware, "rocm", hardware.collective_thresholds(spec, gpus, nnodes), spec
    )


def failed(findings):
    return {f.check: f for f in findings if not f.ok}


def test_bus_bandwidth_is_nccl_tests_definition():
    # 2 ranks: all-reduce bus = algorithm bandwidth; all-gather bus = half of it.
    assert bus_bandwidth("all_reduce", GiB, GiB / 100e9, 2) == pytest.approx((100.0, 100.0))
    assert bus_bandwidth("all_gather", GiB, GiB / 100e9, 2) == pytest.approx((100.0, 50.0))
    # 8 ranks: x 2*7/8 and x 7/8.
    assert bus_bandwidth("all_reduce", GiB, GiB / 100e9, 8)[1] == pytest.approx(175.0)
    assert bus_bandwidth("all_gather", GiB, GiB / 100e9, 8)[1] == pytest.approx(87.5)


def test_rccl_log_over_xgmi():
    parsed = parse_nccl_log(XGMI_LOG)
    assert parsed["version"] == "RCCL 2.22.3+hip6.4"
    assert parsed["via"] == {"P2P/IPC": 16} and parsed["paths"] == {"XGMI/PIX": 2}
    tr = summarize_transport([parsed], "rccl")
    assert tr["intra"] == "xGMI" and tr["reported"] and tr["inter"] == ""
    assert any("type XGMI/PIX" in line for line in tr["evidence"])


def test_pcie_fallback_and_socket_and_shm_are_named():
    assert summarize_transport([parse_nccl_log(PCIE_LOG)], "rccl")["intra"] == (
        "PCIe (through the CPU root complex)"
    )
    log = (
        "h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct\n"
        "h:1:1 [0] NCCL INFO Channel 01/0 : 8[0] -> 0[0] [receive] via NET/Socket/0\n"
        "h:1:1 [0] NCCL INFO Channel 01/0 : 0[0] -> 8[0] [send] via NET/Socket/1\n"
    )
    tr = summarize_transport([parse_nccl_log(log)], "nccl")
    assert "SHM" in tr["intra"] and tr["inter"] == "Socket" and tr["via"]["NET/Socket"] == 2


def test_gloo_transport():
    assert summarize_transport([], "gloo")["intra"] == "TCP (gloo)"


def test_floors_scale_with_the_xgmi_mesh_not_the_nvlink_switch():
    mi300x, h200 = hardware.GPUS["mi300x"], hardware.GPUS["h200"]
    assert hardware.collective_thresholds(mi300x, 8, 1).allreduce_busbw_gbs == 168  # 7 peer links
    assert hardware.collective_thresholds(mi300x, 2, 1).allreduce_busbw_gbs == 24  # one link
    assert hardware.collective_thresholds(h200, 2, 1).allreduce_busbw_gbs == 120
    assert hardware.collective_thresholds(h200, 8, 1).allgather_busbw_gbs == 120
    assert (
        hardware.collective_thresholds(mi300x, 8, 4).allreduce_busbw_gbs == hardware.MIN_INTERNODE_BUSBW_GBS
    )
    assert hardware.collective_thresholds(h200, 1, 1).allreduce_busbw_gbs == 0  # nothing to judge
    over = hardware.collective_thresholds(
        mi300x, 8, 1, Verify(min_allreduce_busbw_gbs=250, min_gemm_tflops=0)
    )
    assert over.allreduce_busbw_gbs == 250 and over.gemm_tflops == 400 and "config overrides" in over.basis
    cpu = hardware.collective_thresholds(None, 0, 1)
    assert cpu.gemm_tflops == cpu.allreduce_busbw_gbs == 0


def test_healthy_mi300x_collectives_pass():
    assert failed(rules(coll())) == {}


def test_bandwidth_below_floor_is_the_pcie_fallback():
    bad = failed(rules(coll(busbw=(38.0, 33.0), log=PCIE_LOG)))
    f = bad["bandwidth:all_reduce"]
    assert "38 GB/s at 1024 MiB" in f.message and "below the 168 GB/s" in f.message
    assert "PCIe (through the CPU root complex)" in f.message
    assert "rocm-smi --showtopotype" in f.fix and "XGMI" in f.fix
    assert "bandwidth:all_gather" in bad
    t = bad["transport"]
    assert "PHB" in t.message and "not xGMI" in t.message


def test_pcie_path_fails_even_when_two_gpus_cannot_tell_by_bandwidth():
    # Two MI300X share one xGMI link (~48 GB/s), as fast as PCIe Gen5: the path type tells.
    cfg = typed({"hardware": {"vendor": "rocm", "gpus_per_node": 2}})
    bad = failed(rules(coll(busbw=(45.0, 40.0), log=PCIE_LOG, world=2), cfg, gpus=2))
    assert set(bad) == {"transport"}


def test_gemm_too_slow_names_the_gpu():
    c = coll()
    c["ranks"][5]["gemm_tflops"] = 212.0
    f = failed(rules(c))["gemm"]
    assert "212 TFLOP/s" in f.message and "rank 5" in f.message and "cuda:5" in f.message
    assert "below 400" in f.message and "rocm-smi" in f.fix


def test_wrong_sum_and_world_size():
    c = coll(world=4)
    c["sum_ok"] = False
    bad = failed(rules(c))
    assert "all_reduce:result" in bad and "expects 8" in bad["world_size"].message


def test_multi_node_over_tcp_sockets():
    log = XGMI_LOG + "n:1:1 [0] NCCL INFO Channel 01/0 : 8[0] -> 0[0] [receive] via NET/Socket/0\n"
    cfg = typed({"hardware": {"vendor": "rocm", "gpus_per_node": 8, "nodes": 2}})
    bad = failed(rules(coll(busbw=(9.0, 8.0), log=log, world=16, nnodes=2), cfg, nnodes=2))
    assert "RDMA" in bad["transport"].message and "NCCL_IB_HCA" in bad["transport"].fix
    assert "between nodes Socket" in bad["bandwidth:all_reduce"].message


def test_timeout_names_where_it_hung():
    alloc = Allocation("7", ["n1", "n2"], 0, "10.0.0.1", 29507)
    never_met = _meet_failure(600, 30, {"rank 0": "rendezvous"}, alloc, 27507)
    assert never_met["check"] == "collectives:rendezvous"
    assert "within 630 s of the start" in never_met["message"]
    assert "verify.probe_timeout_seconds, 600 s" in never_met["message"]
    assert "srun --nodes=N --ntasks-per-node=1" in never_met["fix"] and "10.0.0.1:27507" in never_met["fix"]
    one = Allocation("", ["n1"], 0, "10.0.0.1", 29507)
    facts_late = _meet_failure(600, 30, {"rank 0": "waiting for node facts"}, one, 1)
    assert "within verify.timeout_seconds (30 s) of the node probe's end" in facts_late["message"]
    assert "never delivered its probe's facts" in facts_late["fix"]
    hung = _timeout_failure(30, {"rank 0": "all_reduce 1024 MiB", "rank 1": "all_reduce 1024 MiB"})
    assert "verify.timeout_seconds (30 s)" in hung["message"]
    assert "rank 0: all_reduce 1024 MiB" in hung["message"] and "NCCL_DEBUG=INFO" in hung["fix"]
    f = failed(rules({"failure": hung}))["collectives:timeout"]
    assert "killed" in f.message


def test_judge_run_prefixes_nodes_and_checks_the_allocation():
    other = copy.deepcopy(MI300X)
    other["host"] = "mi300x-002"
    other["devices"] = other["devices"][:7]
    cfg = typed({"hardware": {"vendor": "rocm", "gpus_per_node": 8, "nodes": 2}})
    findings, thr = judge_run([MI300X, other], coll(world=16, nnodes=2), cfg, "rocm", 2)
    bad = failed(findings)
    assert "gpu_count@mi300x-002" in bad and "gpu_count@mi300x-001" not in bad
    assert thr.allreduce_busbw_gbs == hardware.MIN_INTERNODE_BUSBW_GBS
    findings, _ = judge_run([MI300X], coll(), ROCM8, "rocm", 2)
    assert "allocation" in failed(findings)


# Recorded on the device machine (2 x H200, NVLink): bench/results/verify_env_h200x2.md.
H200_FACTS = json.loads((FIX / "facts_h200x2.json").read_text())
H200_RUN = json.loads((REPO / "bench/results/verify_env_h200x2.json").read_text())
P2P_OFF = json.loads((REPO / "bench/results/verify_env_h200x2_p2p_off.json").read_text())
CUDA2 = typed({"hardware": {"vendor": "cuda", "gpus_per_node": 2}})


def test_recorded_h200_nccl_logs():
    tr = summarize_transport([parse_nccl_log((FIX / "nccl_h200x2.log").read_text())], "nccl")
    assert tr["intra"] == "NVLink" and set(tr["via"]) == {"P2P/CUMEM"}
    assert tr["version"].startswith("NCCL 2.28.9")
    off = summarize_transport([parse_nccl_log((FIX / "nccl_h200x2_p2p_off.log").read_text())], "nccl")
    assert off["intra_path_types"] == ["PHB"] and set(off["via"]) == {"SHM/direct/direct"}


def test_recorded_h200_run_passes_and_its_p2p_off_run_fails():
    assert [d["arch"] for d in H200_FACTS["devices"]] == ["sm_90", "sm_90"]
    findings, thr = judge_run([H200_FACTS], H200_RUN["collectives"], CUDA2, "cuda", 1)
    assert failed(findings) == {} and thr.allreduce_busbw_gbs == 120 and thr.gemm_tflops == 500
    bad = failed(judge_run(P2P_OFF["nodes"], P2P_OFF["collectives"], CUDA2, "cuda", 1)[0])
    assert set(bad) == {"bandwidth:all_reduce", "bandwidth:all_gather", "transport"}
    assert all("NCCL_P2P_DISABLE=1 is set on the node" in f.fix for f in bad.values())
    # The same bandwidth without the variable set points at the fabric instead.
    nodes = copy.deepcopy(P2P_OFF["nodes"])
    nodes[0]["env"]["NCCL_P2P_DISABLE"] = None
    fix = failed(judge_run(nodes, P2P_OFF["collectives"], CUDA2, "cuda", 1)[0])["transport"].fix
    assert "nvidia-smi topo -m" in fix


def test_log_parser_on_lines_built_independently_of_the_fixtures():
    """INFO lines in the layouts public NCCL/RCCL issue reports show, not derived from the fixtures:
    RCCL's older channel lines (bus IDs in brackets, no "/0" after the channel), the older graph line
    that says "speed" where newer ones say "bw", and lines of other subsystems around them."""
    prefix = "node07:929:1025 [2] NCCL INFO "
    lines = [
        "NCCL_P2P_LEVEL set by environment to XGMI",
        "Setting affinity for GPU 2 to ffff0000,00000000,ffff0000",
        "Pattern 4, crossNic 0, nChannels 4, speed 48.000000/48.000000, type XGMI/PIX, sameChannels 0",
        "Channel 01 : 2[43000] -> 1[26000] via P2P/IPC",
        "Channel 02 : 2[43000] -> 1[26000] via P2P/IPC",
        "Channel 00 : 2[43000] -> 10[43000] [send] via NET/IB/1/GDRDMA",
        "Connected all trees",
        "4 coll channels, 2 p2p channels, 2 p2p channels per peer",
    ]
    parsed = parse_nccl_log("".join(prefix + line + "\n" for line in lines))
    assert parsed["via"]["P2P/IPC"] == 2 and sum(n for k, n in parsed["via"].items() if "NET/IB" in k) == 1
    assert parsed["paths"] == {"XGMI/PIX": 1} and parsed["net"] == ["IB"]
    assert parsed["evidence"][0] == lines[2]  # the library's words, without the host/pid prefix
    tr = summarize_transport([parsed], "rccl")
    assert tr["intra"] == "xGMI" and tr["inter"] == "IB"
