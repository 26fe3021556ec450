"""The stack fingerprint (llmft.core.stack) from node facts, and the reads that fill it (llmft.env.stack).

The ROCm outputs below are HAND-WRITTEN, not captured: nothing here ran on an MI300X. They follow the
formats AMD documents for `amd-smi static` (per-GPU `GPU: N` blocks with indented `VBIOS:` /
`DRIVER:` sections of `KEY: value` lines), `rocm-smi --showdriverversion --showvbios` and the ROCm
install's `.info/version` file, with values an MI300X node of the ROCm 7.0 wheel in
tests/fixtures/facts_mi300x.json (itself hand-written) would print. The nvidia-smi lines are
hand-written too, in the CSV format nvidia-smi documents for `--query-gpu=... --format=csv,noheader`
(the driver and VBIOS values are examples, not read from a GPU); the facts they join
(facts_h200x2.json) were captured on an H200 machine. The CPU case reads this machine's own torch
and packages.
"""

from __future__ import annotations

import copy
import json
import struct

import pytest
from llmft.core import stack as core
from llmft.core.config import validate
from llmft.env import stack
from llmft.env.nodefacts import _host_facts, _run_tool, _smi_facts, parse_nvidia_smi, parse_rocminfo

from tests.conftest import REPO

FIX = REPO / "tests/fixtures"

# Hand-written in `amd-smi static`'s documented text layout (abridged to two of eight GPUs).
AMD_SMI_STATIC = """\
GPU: 0
    ASIC:
        MARKET_NAME: AMD Instinct MI300X
        VENDOR_ID: 0x1002
        DEVICE_ID: 0x74a1
    BUS:
        BDF: 0000:0c:00.0
    VBIOS:
        NAME: AMD MI300X_HW_SRIOV_CVS_1VF
        BUILD_DATE: 2024/02/07 18:12
        PART_NUMBER: 113-M3000100-102
        VERSION: 022.040.003.043.000001
    DRIVER:
        NAME: amdgpu
        VERSION: 6.10.5

GPU: 1
    ASIC:
        MARKET_NAME: AMD Instinct MI300X
    VBIOS:
        NAME: AMD MI300X_HW_SRIOV_CVS_1VF
        BUILD_DATE: 2024/02/07 18:12
        PART_NUMBER: 113-M3000100-102
        VERSION: 022.040.003.043.000001
    DRIVER:
        NAME: amdgpu
        VERSION: 6.10.5
"""

# Hand-written: newer amd-smi names the firmware image IFWI where older ones said VBIOS.
AMD_SMI_IFWI = """\
GPU: 0
    IFWI:
        NAME: AMD MI300X_HW_SRIOV_CVS_1VF
        PART_NUMBER: 113-M3000100-102
        VERSION: 022.040.003.043.000002
    DRIVER:
        NAME: amdgpu
        VERSION: 6.12.12
"""

# Hand-written in rocm-smi's documented layout.
ROCM_SMI = """\
============================ ROCm System Management Interface ============================
=========================== Version of System Component ==========================
Driver version: 6.10.5
==================================================================================
=================================== VBIOS ====================================
GPU[0]\t\t: VBIOS version: 113-M3000100-102
GPU[1]\t\t: VBIOS version: 113-M3000100-102
==================================================================================
============================== End of ROCm SMI Log ===============================
"""

# Hand-written in nvidia-smi's documented CSV (noheader) for NVIDIA_QUERY, two H200s.
NVIDIA_SMI = (
    "0, NVIDIA H200, 9.0, 143771 MiB, 580.159.03, 96.00.A5.00.01\n"
    "1, NVIDIA H200, 9.0, 143771 MiB, 580.159.03, 96.00.A5.00.01\n"
)


def tools(outputs: dict):
    """A run_tool that answers from `outputs` ({tool name: stdout}); any other tool is missing."""

    def run(cmd, timeout=20):
        if cmd[0] in outputs:
            return outputs[cmd[0]], ""
        return "", f"{cmd[0]} not on PATH"

    return run


def rocm_tree(tmp_path):
    """A ROCm install folder as /opt/rocm lays it out (hand-written: version file, hipBLASLt's links)."""
    root = tmp_path / "rocm"
    (root / ".info").mkdir(parents=True)
    (root / ".info/version").write_text("7.0.2-56\n")
    lib = root / "lib"
    lib.mkdir()
    (lib / "libhipblaslt.so.1.0.70002").write_bytes(b"\x7fELF")
    (lib / "libhipblaslt.so.1").symlink_to("libhipblaslt.so.1.0.70002")
    (lib / "libhipblaslt.so").symlink_to("libhipblaslt.so.1")
    return root


def mi300x_facts(tmp_path, outputs=None) -> dict:
    """The hand-written MI300X node's facts with its hand-written `stack`, read by llmft.env.stack."""
    facts = json.loads((FIX / "facts_mi300x.json").read_text())
    facts["smi"] = {"tool": "rocminfo", "gpus": parse_rocminfo((FIX / "rocminfo_mi300x.txt").read_text())}
    root = rocm_tree(tmp_path)
    run = tools({"amd-smi": AMD_SMI_STATIC} if outputs is None else outputs)
    facts["stack"] = {
        "torch_git": "a3e329ad8" + "0" * 31,
        "collectives_lib": "2.22.3",
        "rocm": stack.rocm_version(root),
        "hipblaslt": stack.hipblaslt_version(None, root),
        "flash_attn_triton_amd": None,
        "container": {"image": None, "digest": None},
        **stack.amd_driver_firmware(run, sysfs=str(tmp_path / "no-sysfs")),
    }
    return facts


def test_mi300x_fingerprint_from_hand_written_rocm_tool_output(tmp_path):
    fp = core.fingerprint(mi300x_facts(tmp_path))
    assert list(fp) == list(core.FIELDS)
    assert fp["build"] == "rocm" and fp["torch"] == "2.9.1+rocm7.0" and fp["hip"] == "7.0.51831-a3e329ad8"
    assert (fp["rocm"], fp["hipblaslt"], fp["driver"]) == ("7.0.2-56", "1.0.70002", "6.10.5")
    assert fp["gpu_model"] == "AMD Instinct MI300X"
    assert fp["gpu_firmware"] == "022.040.003.043.000001"
    assert (fp["rccl"], fp["nccl"], fp["cublas"], fp["cuda"]) == ("2.22.3", None, None, None)
    assert (fp["flash_attn"], fp["flash_attn_backend"], fp["attention"]) == ("2.8.3", "ck", "fa2")


def test_rocm_firmware_from_rocm_smi_when_amd_smi_is_missing(tmp_path):
    fp = core.fingerprint(mi300x_facts(tmp_path, {"rocm-smi": ROCM_SMI}))
    assert (fp["driver"], fp["gpu_firmware"]) == ("6.10.5", "113-M3000100-102")


def test_newer_amd_smi_ifwi_section_and_sysfs_driver(tmp_path):
    assert stack.parse_amd_smi_static(AMD_SMI_IFWI) == {
        "driver": ["6.12.12"],
        "firmware": ["022.040.003.043.000002"],
    }
    sysfs = tmp_path / "version"
    sysfs.write_text("6.12.12\n")  # the amdgpu DKMS module's own version file wins over the tools
    got = stack.amd_driver_firmware(tools({"amd-smi": AMD_SMI_STATIC}), sysfs=str(sysfs))
    assert got == {"driver": "6.12.12", "gpu_firmware": "022.040.003.043.000001"}


def test_missing_tools_and_files_are_none_never_a_failure(tmp_path):
    got = stack.amd_driver_firmware(tools({}), sysfs=str(tmp_path / "absent"))
    assert got == {"driver": None, "gpu_firmware": None}
    assert stack.rocm_version(tmp_path) is None
    assert stack.hipblaslt_version(str(tmp_path), tmp_path) is None
    out, err = _run_tool(["llmft-no-such-tool", "--version"])
    assert out == "" and "not on PATH" in err


def test_triton_backend_of_flash_attn_on_rocm(tmp_path):
    facts = mi300x_facts(tmp_path)
    facts["stack"]["flash_attn_triton_amd"] = "TRUE"
    assert core.fingerprint(facts)["flash_attn_backend"] == "triton"


def test_h200_fingerprint_from_nvidia_smi_csv():
    facts = json.loads((FIX / "facts_h200x2.json").read_text())
    facts["smi"] = {"tool": "nvidia-smi", "gpus": parse_nvidia_smi(NVIDIA_SMI)}
    facts["stack"] = {"collectives_lib": "2.27.7", "cublas": "13.0.0.19", "cublaslt": "13.0.0"}
    fp = core.fingerprint(facts)
    assert (fp["build"], fp["torch"], fp["cuda"]) == ("cuda", "2.11.0+cu130", "13.0")
    assert (fp["driver"], fp["gpu_firmware"], fp["gpu_model"]) == (
        "580.159.03",
        "96.00.A5.00.01",
        "NVIDIA H200",
    )
    assert (fp["nccl"], fp["rccl"], fp["cublas"], fp["cublaslt"]) == ("2.27.7", None, "13.0.0.19", "13.0.0")
    assert (fp["rocm"], fp["hipblaslt"], fp["flash_attn"], fp["flash_attn_backend"]) == (None,) * 4
    # the four columns nvidia-smi was asked for before: no driver or firmware, no failure
    old = parse_nvidia_smi("0, NVIDIA H200, 9.0, 143771 MiB\n")
    assert (old[0]["driver"], old[0]["firmware"]) == (None, None)


class _FakeNccl:
    def __init__(self, v):
        self.v = v

    def version(self):
        if isinstance(self.v, Exception):
            raise self.v
        return self.v


class _FakeTorch:
    def __init__(self, v):
        self.cuda = type("cuda", (), {"nccl": _FakeNccl(v)})()


@pytest.mark.parametrize(
    "value, want",
    [
        ((2, 27, 7), "2.27.7"),
        ((2, 22, 3, ""), "2.22.3"),
        (22703, "2.27.3"),
        (2804, "2.8.4"),
        (RuntimeError(), None),
    ],
)
def test_nccl_or_rccl_version_as_torch_reports_it(value, want):
    assert stack.collectives_version(_FakeTorch(value)) == want


def test_this_machines_cpu_facts():
    import torch

    facts = _host_facts()
    facts.update(torch_version=torch.__version__, hip_version=None, cuda_version=torch.version.cuda)
    facts["build"] = "cpu"
    facts["smi"] = _smi_facts()
    facts["stack"] = stack.gather(torch, "cpu", facts["smi"], _run_tool)
    fp = core.fingerprint(facts)
    assert fp["build"] == "cpu" and fp["torch"] == torch.__version__
    assert fp["torch_git"] == torch.version.git_version
    assert fp["python"] == facts["python"] and fp["transformers"] == facts["packages"]["transformers"]
    for key in ("hip", "rocm", "driver", "rccl", "nccl", "hipblaslt", "cublas", "cublaslt", "gpu_firmware"):
        assert fp[key] is None, key
    assert len(core.stack_hash(fp)) == 12 and core.stack_hash(fp) == core.stack_hash(dict(fp))


def test_diff_names_the_changed_components(tmp_path):
    old = core.fingerprint(mi300x_facts(tmp_path))
    new = dict(old, torch="2.10.0+rocm7.1", rocm="7.1.0-38", gpu_firmware=None)
    assert core.diff(old, new) == [
        ("torch", "2.9.1+rocm7.0", "2.10.0+rocm7.1"),
        ("rocm", "7.0.2-56", "7.1.0-38"),
        ("gpu_firmware", "022.040.003.043.000001", None),
    ]
    assert core.diff(old, old) == [] and core.stack_hash(old) != core.stack_hash(new)
    assert ("torch", None, "2.9.1+rocm7.0") in core.diff(None, old)
    assert core.diff_text(core.diff(old, new)[:1]) == "torch 2.9.1+rocm7.0 -> 2.10.0+rocm7.1"


def test_run_fingerprint_names_what_two_nodes_disagree_on(tmp_path):
    a = core.fingerprint(mi300x_facts(tmp_path / "a"))
    b = dict(a, driver="6.8.5", hipblaslt="0.12.60300")
    run = core.run_fingerprint({"n2": b, "n1": a})
    assert run["differs"] == ["driver", "hipblaslt"] and run["nodes"] == ["n1", "n2"]
    assert run["fingerprint"]["driver"] == {"n1": "6.10.5", "n2": "6.8.5"}
    assert run["fingerprint"]["torch"] == a["torch"]
    same = core.run_fingerprint({"n1": a, "n2": copy.deepcopy(a)})
    assert same["differs"] == [] and same["fingerprint"] == a and same["hash"] == core.stack_hash(a)
    assert run["hash"] != same["hash"]
    assert core.show(run["fingerprint"]["driver"]) == "n1: 6.10.5; n2: 6.8.5"


def _sif(path, table: bytes, data: bytes, uuid: bytes = bytes(range(16))) -> None:
    """A file in the SIF layout: 128-byte global header, descriptor table, then the data."""
    head = b"#!/usr/bin/env run-singularity\n".ljust(32, b"\0") + b"SIF_MAGIC\0" + b"01\0" + b"02\0" + uuid
    head += struct.pack("<8q", 1, 2, 47, 48, 128, len(table), 128 + len(table), len(data))
    path.write_bytes(head + table + data)


def test_container_digest_reads_the_sif_header_not_the_image(tmp_path):
    sif = tmp_path / "llmft-rocm.sif"
    _sif(sif, b"descriptors-v1", b"squashfs" * 1000)
    env = {"APPTAINER_CONTAINER": str(sif)}
    first = stack.container(env)
    assert first["image"] == str(sif) and first["source"] == "sif header"
    assert first["digest"].startswith("sha256:") and first["id"] == "00010203-0405-0607-0809-0a0b0c0d0e0f"
    _sif(sif, b"descriptors-v1", b"SQUASHFS" * 1000)  # the data alone is never read
    assert stack.container(env)["digest"] == first["digest"]
    _sif(sif, b"descriptors-v2", b"squashfs" * 1000)  # a rebuilt image: new objects, new digest
    assert stack.container(env)["digest"] != first["digest"]


def test_container_without_a_readable_sif_uses_the_images_own_labels(tmp_path):
    labels = tmp_path / "labels.json"
    labels.write_text('{"org.label-schema.build-date": "Monday_7_December_2026"}')
    got = stack.container({"SINGULARITY_CONTAINER": "/not/mounted/here.sif"}, labels=str(labels))
    assert got["image"] == "/not/mounted/here.sif" and got["source"] == "labels.json"
    assert got["digest"].startswith("sha256:")
    none = stack.container({"APPTAINER_CONTAINER": str(tmp_path)}, labels=str(tmp_path / "absent"))
    assert none["digest"] is None and none["source"] == "none readable"
    assert stack.container({}) == {"image": None, "digest": None}


def test_verify_json_records_each_nodes_and_the_runs_stack(tmp_path, monkeypatch):
    """verify_env with injected node facts (the test-only switch): each node carries its
    fingerprint, the report the run's."""
    from llmft.core.settings import Config
    from llmft.env.verify import TEST_FACTS_ENV, run_verify

    facts = mi300x_facts(tmp_path)
    path = tmp_path / "facts.json"
    path.write_text(json.dumps(facts))
    monkeypatch.setenv(TEST_FACTS_ENV, str(path))
    raw = {"hardware": {"vendor": "rocm", "gpus_per_node": 8}, "verify": {"on_failure": "warn"}}
    out = tmp_path / "verify.json"
    run_verify(Config.from_dict(validate(raw)), str(out))
    report = json.loads(out.read_text())
    node_fp = report["nodes"][0]["stack_fingerprint"]
    assert node_fp == core.fingerprint(facts) and node_fp["rocm"] == "7.0.2-56"
    assert report["stack"]["hash"] == core.stack_hash(node_fp) and report["stack"]["differs"] == []
