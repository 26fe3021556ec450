"""verify_env's per-node rules, fired with node facts instead of the hardware. The MI300X facts and
rocminfo output (tests/fixtures/) were written by hand in the tools' formats, not captured on a node
(we have none: tests/fixtures/README.md); the rocminfo parser also gets a case built independently of
that fixture, from rocminfo's output as public ROCm issue reports show it.

Each failure rule has a test that makes it fire and checks the message names what is wrong and the
fix says what to do.
"""

import copy
import json

import pytest
from llmft.core.config import validate
from llmft.core.settings import Config, replace
from llmft.env.nodefacts import gather_facts, parse_nvidia_smi, parse_rocminfo
from llmft.env.rules import judge
from llmft.env.verify import gate

from tests.conftest import REPO

FIX = REPO / "tests/fixtures"
MI300X = json.loads((FIX / "facts_mi300x.json").read_text())
ROCMINFO = (FIX / "rocminfo_mi300x.txt").read_text()


def typed(raw: dict) -> Config:
    return Config.from_dict(validate(raw))


ROCM_CFG = typed({"hardware": {"vendor": "rocm", "gpus_per_node": 8}, "sft": {"flash_attn": "fa2"}})
# sft.packing comes with the planner; set after validation
ROCM_AUTO = replace(typed({"hardware": {"vendor": "rocm", "gpus_per_node": 8}}), "sft.packing", "plain")


def failed(findings):
    return {f.check: f for f in findings if not f.ok}


def mi300x(**changes):
    facts = copy.deepcopy(MI300X)
    facts["smi"] = {"tool": "rocminfo", "gpus": parse_rocminfo(ROCMINFO), "error": ""}
    facts.update(changes)
    return facts


def test_healthy_mi300x_node_passes():
    assert failed(judge(mi300x(), ROCM_CFG, "rocm")) == {}


def test_rocminfo_lists_eight_gfx942_gpus():
    gpus = parse_rocminfo(ROCMINFO)
    assert [g["name"] for g in gpus] == ["gfx942"] * 8  # CPU agents skipped, ISA names not taken
    assert {g["marketing_name"] for g in gpus} == {"AMD Instinct MI300X"}
    assert gpus[0]["compute_units"] == 304


def test_nvidia_smi_csv():
    gpus = parse_nvidia_smi("0, NVIDIA H200, 9.0, 143771 MiB\n1, NVIDIA H200, 9.0, 143771 MiB\n")
    assert [(g["name"], g["arch"]) for g in gpus] == [("NVIDIA H200", "sm_90")] * 2


def test_torch_built_without_gfx942():
    facts = mi300x(arch_list=["gfx90a", "gfx1100"])
    bad = failed(judge(facts, ROCM_CFG, "rocm"))
    f = bad["arch:gfx942"]
    assert "NOT" in f.message and "hipErrorNoBinaryForGpu" in f.message
    assert "gfx942" in f.fix and "gfx90a" in f.fix


def test_pytorch_rocm_arch_mismatch_says_what_to_do():
    facts = mi300x()
    facts["env"]["PYTORCH_ROCM_ARCH"] = "gfx90a"
    f = failed(judge(facts, ROCM_CFG, "rocm"))["PYTORCH_ROCM_ARCH"]
    assert "gfx90a" in f.message and "gfx942" in f.message
    assert "PYTORCH_ROCM_ARCH=gfx942" in f.fix and "GPU_ARCHS=gfx942 pip install flash-attn" in f.fix


def test_cuda_torch_on_rocm_node_names_what_rocminfo_sees():
    facts = mi300x(build="cuda", cuda_version="13.0", hip_version=None, devices=[], arch_list=[])
    f = failed(judge(facts, ROCM_CFG, "rocm"))["build"]
    assert "cuda build" in f.message and "rocminfo lists 8 GPU(s) (gfx942)" in f.message
    assert "ROCm wheel" in f.fix


def test_fewer_gpus_than_asked():
    facts = mi300x()
    facts["devices"] = facts["devices"][:4]
    facts["env"]["ROCR_VISIBLE_DEVICES"] = "0,1,2,3"
    f = failed(judge(facts, ROCM_CFG, "rocm"))["gpu_count"]
    assert "4 GPU(s)" in f.message and "asks for 8" in f.message
    assert "rocminfo lists 8" in f.message and "ROCR_VISIBLE_DEVICES" in f.message
    assert "--gres" in f.fix


def test_gpu_memory_held_by_another_process():
    facts = mi300x()
    facts["devices"][3]["free_gib"] = 12.0
    f = failed(judge(facts, ROCM_CFG, "rocm"))["gpu_memory"]
    assert "GPU 3: 12.0 of 192.0 GiB free" in f.message and "rocm-smi" in f.fix


def test_flash_attn_without_hip_path():
    facts = mi300x()
    err = "ImportError: libcudart.so.12: cannot open shared object file: No such file or directory"
    facts["attention"] = {"flash_attn_version": "2.8.3", "import_ok": False, "error": err, "sdpa_ok": True}
    f = failed(judge(facts, ROCM_CFG, "rocm"))["flash_attn"]
    assert "libcudart" in f.message
    assert "built for CUDA, not ROCm/HIP" in f.fix and "GPU_ARCHS=gfx942" in f.fix
    assert "FLASH_ATTENTION_SKIP_CUDA_BUILD" not in f.fix  # it skips the ROCm kernels too
    assert "sdpa" in f.fix.lower()


def test_flash_attn_installed_without_kernels():
    facts = mi300x()
    err = "ModuleNotFoundError: No module named 'flash_attn_2_cuda'"
    facts["attention"] = {"flash_attn_version": "2.8.3", "import_ok": False, "error": err, "sdpa_ok": True}
    f = failed(judge(facts, ROCM_AUTO, "rocm"))["flash_attn"]
    # auto would still pick an installed flash-attn, so a broken one fails under auto too.
    assert "auto would still pick it" in f.message and "without its compiled kernels" in f.fix


def test_flash_attn_kernel_built_for_another_gpu():
    facts = mi300x()
    err = (
        "RuntimeError: HIP error: hipErrorNoBinaryForGpu: Unable to find code object for all current devices"
    )
    facts["attention"] = {
        "flash_attn_version": "2.8.3",
        "import_ok": True,
        "kernel_ok": False,
        "error": err,
        "sdpa_ok": True,
    }
    f = failed(judge(facts, ROCM_CFG, "rocm"))["flash_attn"]
    assert "GPU_ARCHS=gfx942" in f.fix


def test_no_flash_attn_records_the_sdpa_fallback():
    facts = mi300x()
    facts["packages"]["flash_attn"] = None
    facts["imports"].pop("flash_attn")
    facts["attention"] = {"flash_attn_version": None, "sdpa_ok": True, "attention": "sdpa"}
    found = {f.check: f for f in judge(facts, ROCM_AUTO, "rocm")}
    assert found["flash_attn"].ok and "SDPA (flash-attn not installed)" in found["flash_attn"].message
    assert "flash_attn" in failed(judge(facts, ROCM_CFG, "rocm"))  # fa2 asked for: not installed fails


def test_neat_packing_auto_takes_the_fastest_kernel_that_runs_varlen_only_when_asked():
    facts = mi300x()
    facts["attention"] = {
        "flash_attn_version": None,
        "sdpa_ok": True,
        "attention": "sdpa",
        "varlen_ok": False,
        "varlen_error": "RuntimeError: varlen_attn is not supported on this device",
    }
    neat = replace(ROCM_AUTO, "sft.packing", "neat")
    # auto: no varlen here, no flash-attn: SDPA with neat packing's mask, as the planner chooses
    found = {f.check: f for f in judge(facts, neat, "rocm")}
    assert found["flash_attn"].ok and "sdpa" in found["flash_attn"].message
    assert "attention:varlen" not in failed(judge(facts, neat, "rocm"))
    # flash-attn's ROCm kernel runs (torch 2.9 has no varlen): auto takes it
    facts["attention"].update(flash_attn_version="2.8.3", import_ok=True, kernel_ok=True, attention="fa2")
    found = {f.check: f for f in judge(facts, neat, "rocm")}
    assert found["flash_attn"].ok and "fa2" in found["flash_attn"].message
    # varlen asked for by name must run
    explicit = replace(neat, "sft.flash_attn", "varlen")
    f = failed(judge(facts, explicit, "rocm"))["attention:varlen"]
    assert "not supported" in f.message and "sft.flash_attn: auto" in f.fix


def test_a_declared_gpu_model_must_be_what_the_node_has():
    facts = mi300x()
    for d in facts["devices"]:
        d.update(name="NVIDIA H100 80GB HBM3", arch="sm_90", total_gib=79.1)
    declared = typed({"hardware": {"gpus_per_node": 8, "gpu_model": "mi300x"}})
    f = failed(judge(facts, declared, "rocm"))["gpu_model"]
    assert "mi300x (AMD Instinct MI300X)" in f.message and "NVIDIA H100 80GB HBM3" in f.message
    assert "gpu_model" not in failed(judge(mi300x(), declared, "rocm"))


def test_missing_and_broken_packages():
    facts = mi300x()
    facts["packages"]["deepspeed"] = None
    facts["imports"]["llamafactory"] = {"ok": False, "error": "ModuleNotFoundError: torchaudio"}
    bad = failed(judge(facts, ROCM_CFG, "rocm"))
    assert "package:deepspeed" in bad and "torchaudio" in bad["package:llamafactory"].message


def test_deepspeed_ops_not_loading():
    facts = mi300x(deepspeed_ops={"ok": False, "error": "OSError: libamdhip64.so: cannot open shared object"})
    f = failed(judge(facts, ROCM_CFG, "rocm"))["deepspeed_ops"]
    assert "libamdhip64" in f.message and "reinstall deepspeed" in f.fix


def test_deepspeed_on_the_cpu_accelerator_of_a_gpu_node():
    facts = mi300x()
    facts["deepspeed_ops"] = dict(facts["deepspeed_ops"], accelerator="cpu")
    assert "DS_ACCELERATOR" in failed(judge(facts, ROCM_CFG, "rocm"))["deepspeed_ops"].fix


def test_offload_needs_cpu_adam():
    facts = mi300x()
    facts["deepspeed_ops"] = dict(
        facts["deepspeed_ops"], cpu_adam_load={"ok": False, "error": "RuntimeError: Error building extension"}
    )
    offload = typed(
        {"hardware": {"vendor": "rocm", "gpus_per_node": 8}, "sft": {"zero_stage": 3, "offload": True}}
    )
    f = failed(judge(facts, offload, "rocm"))["deepspeed_ops:cpu_adam"]
    assert "CPU Adam" in f.message and "sft.offload: false" in f.fix
    assert "deepspeed_ops:cpu_adam" not in failed(judge(facts, ROCM_CFG, "rocm"))  # no offload: no need


def test_probe_killed_by_illegal_instruction():
    facts = mi300x(probe_error={"returncode": -4, "signal": "SIGILL", "last_step": "import flash_attn"})
    f = failed(judge(facts, ROCM_CFG, "rocm"))["probe"]
    assert "SIGILL" in f.message and "import flash_attn" in f.message
    assert "illegal instruction" in f.fix and "PYTORCH_ROCM_ARCH=gfx942" in f.fix


def test_probe_that_died_before_torch_loaded_still_judges():
    facts = {
        "host": "mi300x-001",
        "probe_error": {"timed_out": True, "timeout_s": 300, "last_step": "import torch"},
    }
    bad = failed(judge(facts, ROCM_CFG, "rocm"))
    f = bad["probe:timeout"]
    assert "node facts part was still in 'import torch'" in f.message and "budget of 300 s" in f.message
    assert "raise verify.probe_timeout_seconds" in f.fix and "package:torch" in bad


def test_cuda_sm90_node_passes_with_ptx_forward_compat():
    facts = mi300x(build="cuda", cuda_version="13.0", hip_version=None, arch_list=["sm_80", "sm_90"], smi={})
    for d in facts["devices"]:
        d.update(name="NVIDIA H200", arch="sm_90", total_gib=139.8, free_gib=139.2)
    cfg = typed({"hardware": {"vendor": "cuda", "gpus_per_node": 8}})
    assert failed(judge(facts, cfg, "cuda")) == {}


def test_this_machine_cpu():
    cfg = typed({})
    facts = gather_facts()
    assert facts["build"] in ("cpu", "cuda", "rocm")
    assert facts["attention"]["sdpa_ok"] is True
    assert failed(judge(facts, cfg, "cpu")) == {}


def test_gate_refuses_failed_report(tmp_path):
    report = {"ok": False, "findings": [{"check": "arch:gfx942", "ok": False, "message": "x"}]}
    path = tmp_path / "verify.json"
    path.write_text(json.dumps(report))
    with pytest.raises(SystemExit, match="arch:gfx942"):
        gate(typed({}).verify, str(path))
    gate(typed({"verify": {"on_failure": "warn"}}).verify, str(path))


def test_rocminfo_parser_on_output_built_independently_of_the_fixture():
    """rocminfo's layout as public ROCm issue reports print it (ROCm 6.x on MI300X): each value padded
    with trailing blanks, a "Cache Info:" sub-block, an ISA agent block per GPU, and the GPU's
    compute units after its node IDs. Not derived from tests/fixtures/rocminfo_mi300x.txt."""

    def agent(n, name, marketing, kind, cus):
        rows = [("Name", name), ("Uuid", "GPU-8af7" if kind == "GPU" else "CPU-XX")]
        rows += [("Marketing Name", marketing), ("Vendor Name", "AMD" if kind == "GPU" else "CPU")]
        rows += [("Node", str(n)), ("Device Type", kind), ("Cache Info", "")]
        body = "".join(f"  {k + ':':<25}{v:<35}\n" for k, v in rows)
        body += "    L1:                      32(0x20) KB                        \n"
        body += f"  {'Internal Node ID:':<25}{n:<35}\n  {'Compute Unit:':<25}{cus:<35}\n"
        isa = "  ISA Info:                \n    ISA 1                    \n"
        isa += f"      Name:                    amdgcn-amd-amdhsa--{name}:sramecc+:xnack-   \n"
        stars = "*******                  \n"
        return f"{stars}Agent {n + 1}                  \n{stars}{body}{isa}"

    text = "==========               \nHSA Agents               \n==========               \n"
    text += agent(0, "AMD EPYC 9654 96-Core Processor", "AMD EPYC 9654 96-Core Processor", "CPU", 192)
    text += "".join(agent(n, "gfx942", "AMD Instinct MI300X", "GPU", 304) for n in (1, 2))
    gpus = parse_rocminfo(text)  # the agent's name, not its ISA's (amdgcn-amd-amdhsa--gfx942...)
    assert gpus == [{"name": "gfx942", "marketing_name": "AMD Instinct MI300X", "compute_units": 304}] * 2
