"""The typed platform: built once from the nodes' facts (or the config's word), handed to the planner,
the renderer and the launcher. The H200 facts were captured on the device machine; the MI300X facts
were written by hand in the facts format, not captured on a node (tests/fixtures/README.md)."""

import copy
import dataclasses
import json

import pytest
import yaml
from llmft.core.config import ConfigError, validate
from llmft.core.launch import launch_env
from llmft.core.platform import Platform, choose_attention, read_platform
from llmft.core.settings import Config
from llmft.core.shape import shape_from_config
from llmft.core.slurm import Allocation
from llmft.sft.plan import resolve
from llmft.sft.render import render

from tests.conftest import REPO

FIX = REPO / "tests/fixtures"
MI300X = json.loads((FIX / "facts_mi300x.json").read_text())
H200 = json.loads((REPO / "bench/results/pipeline_h200x1_20261201.verify.json").read_text())["nodes"][0]
LLAMA_70B = json.loads((REPO / "bench/shapes/llama3-70b/config.json").read_text())
NODES8 = {"hardware": {"gpus_per_node": 8, "nodes": 2}, "sft": {"precision": "bf16"}}


def nodes(facts, n=2):
    return [{**copy.deepcopy(facts), "host": f"n{i + 1}"} for i in range(n)]


def typed(raw: dict) -> Config:
    return Config.from_dict(validate(raw))


def test_mi300x_facts_make_the_rocm_platform_whatever_the_submit_host_runs():
    p = Platform.from_facts(typed(NODES8), nodes(MI300X))
    assert (p.vendor, p.gpu, p.arch, p.device_memory_gib) == ("rocm", "mi300x", "gfx942", 192.0)
    assert p.hosts == ("n1", "n2") and p.world_size == 16 and p.torch == "2.9.1+rocm7.0"
    # torch 2.9 has no varlen kernel; flash-attn's ROCm kernel ran; liger-kernel is not installed
    assert p.attention == ("fa2", "sdpa") and not p.liger
    assert p.host_memory_gib == 2015.6 and p.host_cpus == 96
    assert p.collective_env["PYTORCH_ROCM_ARCH"] == "gfx942" and p.collective_env["RCCL_MSCCL_ENABLE"] == "0"
    # the launcher's environment comes from it, not from the config dict
    env = launch_env(p, Allocation("7", ["n1", "n2"], 1, "10.0.0.1", 29507), base_env={})
    assert (env["NNODES"], env["NODE_RANK"], env["NPROC_PER_NODE"]) == ("2", "1", "8")
    assert env["PYTORCH_ROCM_ARCH"] == "gfx942"
    assert Platform.from_json(json.loads(json.dumps(p.to_json()))) == p  # travels in the YAML


def test_h200_facts_recorded_by_verify_env_on_the_device():
    p = Platform.from_facts(typed({"hardware": {"gpus_per_node": 1}}), [H200])
    assert (p.vendor, p.gpu, p.arch) == ("cuda", "h200", "sm_90")
    assert "varlen" in p.attention and p.liger and "TORCH_SYMM_MEM_DISABLE_MULTICAST" in p.collective_env


def test_facts_that_contradict_the_config_are_refused_naming_both():
    h100 = copy.deepcopy(MI300X)
    for d in h100["devices"]:
        d.update(name="NVIDIA H100 80GB HBM3", arch="sm_90")
    h100["build"] = "cuda"
    cfg = typed({"hardware": {"gpus_per_node": 8, "gpu_model": "mi300x"}})
    with pytest.raises(ConfigError, match=r"mi300x \(AMD Instinct MI300X\) but n1 has NVIDIA H100 80GB HBM3"):
        Platform.from_facts(cfg, nodes(h100, 1))
    with pytest.raises(ConfigError, match="hardware.vendor: 'cuda' but torch on n1 is a rocm build"):
        Platform.from_facts(typed({"hardware": {"gpus_per_node": 8, "vendor": "cuda"}}), nodes(MI300X, 1))
    mixed = nodes(MI300X)
    mixed[1]["build"] = "cuda"
    with pytest.raises(ConfigError, match="different torch builds"):
        Platform.from_facts(typed(NODES8), mixed)
    with pytest.raises(ConfigError, match="no node facts"):
        Platform.from_facts(typed(NODES8), [])


def test_declared_platform_assumes_generously_and_says_so():
    open_gpu = Platform.declared(typed({"hardware": {"gpus_per_node": 8}}))
    assert open_gpu.gpu == "mi300x" and "assumed the largest known GPU" in open_gpu.source
    h100 = Platform.declared(typed({"hardware": {"gpus_per_node": 8, "gpu_model": "h100"}}))
    assert (h100.vendor, h100.device_memory_gib) == ("cuda", 80) and "declared" in h100.source
    cpu = Platform.declared(typed({}))
    assert cpu.vendor == "cpu" and not cpu.on_gpu
    # vendor cpu with GPUs per node declared (a smoke test of the GPU partition): CPU processes
    assert Platform.declared(typed({"hardware": {"vendor": "cpu", "gpus_per_node": 2}})).vendor == "cpu"


def test_read_platform_takes_a_verify_report_or_one_nodes_facts(tmp_path):
    cfg = typed(NODES8)
    (tmp_path / "verify.json").write_text(json.dumps({"nodes": nodes(MI300X)}))
    (tmp_path / "node.json").write_text(json.dumps(MI300X))
    assert read_platform(cfg, tmp_path / "verify.json").hosts == ("n1", "n2")
    assert read_platform(cfg, tmp_path / "node.json").nodes == 2


@pytest.mark.parametrize(
    "varlen,fa2,want,mask",
    [(True, True, "varlen", False), (False, True, "fa2", False), (False, False, "sdpa", True)],
)
def test_neat_packing_takes_the_fastest_attention_kernel_that_ran_on_the_nodes(varlen, fa2, want, mask):
    facts = copy.deepcopy(MI300X)
    facts["attention"].update(varlen_ok=varlen, kernel_ok=fa2)
    cfg = validate(NODES8)
    plan = resolve(
        Config.from_dict(cfg),
        "",
        Platform.from_facts(Config.from_dict(cfg), nodes(facts)),
        shape_from_config(LLAMA_70B),
    )
    assert plan.packing == "neat" and plan.attention == want
    assert (plan.memory.mask > 0) == mask  # SDPA needs LLaMA-Factory's 4-D mask: counted


def test_fp32_on_a_gpu_never_takes_a_flashattention_kernel():
    """Seen on one H200: the CPU demo's sft.precision fp32 on a GPU node had auto pick torch's varlen
    FlashAttention, and the first step failed ("FlashAttention only support fp16 and bf16"). Under
    fp32, auto takes SDPA with the 4-D mask (counted) and says why; an explicit FlashAttention kernel
    is refused naming both keys; bf16 on the same facts still takes varlen."""
    cfg = validate({"hardware": {"gpus_per_node": 1}, "sft": {"precision": "fp32"}})
    one_b = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "model_type": "llama",
             "intermediate_size": 8192, "vocab_size": 128256}  # fmt: skip
    one_b_shape = shape_from_config(one_b)
    h200 = Platform.from_facts(Config.from_dict(cfg), [H200])
    assert "varlen" in h200.attention
    plan = resolve(Config.from_dict(cfg), "", h200, one_b_shape)
    assert plan.packing == "neat" and plan.attention == "sdpa" and plan.memory.mask > 0
    assert any("sft.precision is fp32" in r and "fp16/bf16 only" in r for r in plan.reasons)
    bf16 = validate({"hardware": {"gpus_per_node": 1}, "sft": {"precision": "bf16"}})
    assert resolve(Config.from_dict(bf16), "", h200, one_b_shape).attention == "varlen"
    for kernel in ("varlen", "fa2"):
        explicit = validate(
            {"hardware": {"gpus_per_node": 1}, "sft": {"precision": "fp32", "flash_attn": kernel}}
        )
        refusal = f"config key sft.flash_attn: {kernel} .* sft.precision is fp32"
        with pytest.raises(ConfigError, match=refusal):
            resolve(Config.from_dict(explicit), "", h200, one_b_shape)
    # the CPU demo (fp32, no GPU) keeps its path: no FlashAttention there, nothing to refuse
    assert choose_attention("auto", "off", (), False, precision="fp32") == ("auto", "")
    assert choose_attention("varlen", "neat", (), False, precision="fp32") == ("varlen", "")


def test_the_rendered_yaml_names_the_nodes_it_was_planned_for(tmp_path):
    cfg = validate({**NODES8, "model": {"name_or_path": "builtin:tiny"}})
    p = Platform.from_facts(Config.from_dict(cfg), nodes(MI300X))
    from llmft.sft.render import tiny_shape

    args = render(Config.from_dict(cfg), "m", "d", str(tmp_path / "a.yaml"), str(tmp_path / "a.json"), "w", p,
                  tiny_shape(Config.from_dict(cfg).model.tiny))  # fmt: skip
    header = (tmp_path / "a.yaml").read_text().split("\nmodel_name_or_path")[0]
    assert "measured by verify_env on n1, n2" in header and "AMD Instinct MI300X (192 GiB, gfx942)" in header
    assert yaml.safe_load((tmp_path / "a.yaml").read_text())["llmft"]["platform"] == p.to_json()
    assert args["flash_attn"] == "fa2" and args["neat_packing"] is True


def test_offload_is_checked_against_the_nodes_host_memory():
    # Llama-2-7B's shape on one H200 with 126 GiB of host memory: offload's host-side states do not fit
    llama2 = shape_from_config(
        {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 11008,
         "vocab_size": 32000, "model_type": "llama"}
    )  # fmt: skip
    cfg = validate(
        {"hardware": {"gpus_per_node": 1}, "data": {"cutoff_len": 2048}, "sft": {"precision": "bf16"}}
    )
    h200 = Platform.from_facts(Config.from_dict(cfg), [H200])
    plan = resolve(Config.from_dict(cfg), "", h200, llama2)
    assert not plan.offload and plan.gradient_checkpointing
    assert any("host-side states" in r for r in plan.reasons)
    forced = validate({**cfg, "sft": {**cfg["sft"], "offload": True, "gradient_checkpointing": False}})
    with pytest.raises(ConfigError, match="host memory"):
        resolve(Config.from_dict(forced), "", h200, llama2)
    roomy = dataclasses.replace(h200, host_memory_gib=1024.0)
    assert resolve(Config.from_dict(forced), "", roomy, llama2).offload
