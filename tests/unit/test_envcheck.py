"""verify_env's rules, fired with recorded facts of an MI300X node (no pretending to have one)."""

import copy
import json

import pytest
from llmft.config import validate
from llmft.envcheck import gate, gather_facts, judge

from tests.conftest import REPO

MI300X = json.loads((REPO / "tests/fixtures/facts_mi300x.json").read_text())
ROCM_CFG = validate({"hardware": {"vendor": "rocm", "gpus_per_node": 8}, "sft": {"flash_attn": "fa2"}})


def failed(findings):
    return {f.check: f for f in findings if not f.ok}


def test_healthy_mi300x_node_passes():
    assert failed(judge(MI300X, ROCM_CFG, "rocm")) == {}


def test_torch_built_without_gfx942():
    facts = copy.deepcopy(MI300X)
    facts["arch_list"] = ["gfx90a", "gfx1100"]
    bad = failed(judge(facts, ROCM_CFG, "rocm"))
    assert "arch:gfx942" in bad and "gfx942" in bad["arch:gfx942"].fix


def test_pytorch_rocm_arch_mismatch_says_what_to_do():
    facts = copy.deepcopy(MI300X)
    facts["env"]["PYTORCH_ROCM_ARCH"] = "gfx90a"
    bad = failed(judge(facts, ROCM_CFG, "rocm"))
    f = bad["PYTORCH_ROCM_ARCH"]
    assert "gfx90a" in f.message and "gfx942" in f.message
    assert "PYTORCH_ROCM_ARCH=gfx942" in f.fix and "FLASH_ATTENTION_SKIP_CUDA_BUILD" in f.fix


def test_cuda_torch_on_rocm_node():
    facts = copy.deepcopy(MI300X)
    facts.update(build="cuda", cuda_version="13.0", hip_version=None)
    assert "build" in failed(judge(facts, ROCM_CFG, "rocm"))


def test_fewer_gpus_than_asked():
    facts = copy.deepcopy(MI300X)
    facts["devices"] = facts["devices"][:4]
    assert "gpu_count" in failed(judge(facts, ROCM_CFG, "rocm"))


def test_flash_attn_without_hip_path():
    facts = copy.deepcopy(MI300X)
    facts["imports"]["flash_attn"] = {"ok": False, "error": "ImportError: flash_attn_2_cuda.so"}
    bad = failed(judge(facts, ROCM_CFG, "rocm"))
    assert "flash_attn" in bad and "sdpa" in bad["flash_attn"].fix.lower()


def test_missing_and_broken_packages():
    facts = copy.deepcopy(MI300X)
    facts["packages"]["deepspeed"] = None
    facts["imports"]["llamafactory"] = {"ok": False, "error": "ModuleNotFoundError: torchaudio"}
    bad = failed(judge(facts, ROCM_CFG, "rocm"))
    assert "package:deepspeed" in bad and "torchaudio" in bad["package:llamafactory"].message


def test_deepspeed_ops_not_loading():
    facts = copy.deepcopy(MI300X)
    facts["deepspeed_ops"] = {"ok": False, "error": "OSError: libamdhip64.so"}
    assert "deepspeed_ops" in failed(judge(facts, ROCM_CFG, "rocm"))


def test_cuda_sm90_node_passes_with_ptx_forward_compat():
    facts = copy.deepcopy(MI300X)
    facts.update(build="cuda", cuda_version="13.0", hip_version=None, arch_list=["sm_80", "sm_90"])
    for d in facts["devices"]:
        d.update(name="NVIDIA H200", arch="sm_90")
    cfg = validate({"hardware": {"vendor": "cuda", "gpus_per_node": 8}})
    assert failed(judge(facts, cfg, "cuda")) == {}


def test_this_machine_cpu(tmp_path):
    cfg = validate({})
    facts = gather_facts()
    assert facts["build"] in ("cpu", "cuda", "rocm")
    assert failed(judge(facts, cfg, "cpu")) == {}


def test_gate_refuses_failed_report(tmp_path):
    report = {"ok": False, "findings": [{"check": "arch:gfx942", "ok": False, "message": "x"}]}
    path = tmp_path / "verify.json"
    path.write_text(json.dumps(report))
    with pytest.raises(SystemExit, match="arch:gfx942"):
        gate(validate({}), str(path))
    gate(validate({"verify": {"on_failure": "warn"}}), str(path))
