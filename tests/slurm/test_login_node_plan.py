"""Planning from a login node without GPUs, for MI300X nodes: the plan comes from the nodes' facts.

The submit host here has no GPU and a CPU torch build. verify_env runs as a two-node Slurm job whose
nodes report hand-written facts of an 8 x MI300X node (tests/fixtures/facts_mi300x.json: written from
ROCm's documented formats, never recorded on an MI300X; see tests/fixtures/README.md), injected in
place of the probe's output by llmft's test-only switch LLMFT_TEST_NODE_FACTS (env/verify.py). The
rendered YAML must be the MI300X plan, identical to the plan made from those facts directly, and a
node that reports another GPU than the one the config declares must fail verify_env, naming both.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from llmft.core.config import validate
from llmft.core.platform import Platform
from llmft.core.settings import Config
from llmft.env.verify import TEST_FACTS_ENV
from llmft.sft.render import render

from tests.conftest import REPO, make_workdir
from tests.slurm.cluster import RUN, cluster_run, rebuilt_upstream

pytestmark = pytest.mark.slurm

MI300X_FACTS = REPO / "tests/fixtures/facts_mi300x.json"
# 8 x MI300X per node, two nodes, bf16; the checks of the injected facts are reported, not enforced.
# On the shared upstream build (SMALL_RUN's base model and data): only verify_env runs again.
MI300X_RUN = {
    "hardware__nodes": 2,
    "hardware__gpus_per_node": 8,
    "hardware__processes_per_node": 0,
    "sft__precision": "bf16",
    "verify__on_failure": "warn",
}


@pytest.fixture(autouse=True)
def no_gpu_here():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this test is about a submit host without a GPU")


def test_mi300x_plan_made_on_a_host_without_gpus_is_the_nodes_plan(tmp_path, slurm_upstream):
    work = slurm_upstream.copy_to(tmp_path / "w", **MI300X_RUN)
    env = {TEST_FACTS_ENV: str(MI300X_FACTS)}
    res = cluster_run(work, "--until", "render_sft_config", env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert rebuilt_upstream(res.stdout + res.stderr) == {"verify_env"}  # the nodes' facts, new

    text = (work / f"results/{RUN}/sft/llamafactory.yaml").read_text()
    rendered = yaml.safe_load(text)
    platform = rendered["llmft"]["platform"]
    plan = rendered["llmft"]["plan"]
    # the nodes' facts, not the submit host's CPU torch: ROCm, MI300X's 192 GB, both nodes
    assert (platform["vendor"], platform["gpu"], platform["arch"]) == ("rocm", "mi300x", "gfx942")
    assert platform["hosts"] == ["n1", "n2"] and platform["torch"] == "2.9.1+rocm7.0"
    assert plan["capacity_gib"] == 192.0 and plan["world_size"] == 16
    assert "AMD Instinct MI300X (192 GiB, gfx942), rocm" in text.split("\nmodel_name_or_path")[0]
    # the RCCL preset for these nodes travels with the YAML to the launcher
    assert platform["collective_env"]["PYTORCH_ROCM_ARCH"] == "gfx942"
    assert platform["collective_env"]["RCCL_MSCCL_ENABLE"] == "0"
    # the pinned ROCm torch has no varlen kernel: neat packing runs flash-attn's ROCm kernel
    assert plan["attention"] == "fa2" and rendered["flash_attn"] == "fa2" and rendered["neat_packing"]

    # the same plan, made from the same facts directly (no Slurm, no verify_env)
    cfg = validate(yaml.safe_load((work / "config/config.yaml").read_text()), base_dir=work)
    nodes = [{**json.loads(MI300X_FACTS.read_text()), "host": h} for h in ("n1", "n2")]
    direct = Platform.from_facts(
        Config.from_dict(cfg), nodes, where=f"verify_env (results/{RUN}/env/verify.json)"
    )
    out = tmp_path / "direct"
    out.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        render(
            Config.from_dict(cfg),
            f"results/{RUN}/base_model",
            f"results/{RUN}/data",
            str(out / "llamafactory.yaml"),
            f"results/{RUN}/sft/deepspeed.json",
            f"results/{RUN}/work",
            direct,
        )
    assert (out / "llamafactory.yaml").read_text() == text

    report = json.loads((work / f"results/{RUN}/env/verify.json").read_text())
    assert report["vendor"] == "rocm" and [n["host"] for n in report["nodes"]] == ["n1", "n2"]
    assert all(n["injected_from"] == str(MI300X_FACTS) for n in report["nodes"])


def test_a_node_with_another_gpu_than_declared_fails_verify_env(tmp_path):
    h100 = json.loads(MI300X_FACTS.read_text())
    h100.update(build="cuda", torch_version="2.9.1+cu128", hip_version=None, cuda_version="12.8")
    h100["arch_list"] = ["sm_80", "sm_90"]
    for d in h100["devices"]:
        d.update(name="NVIDIA H100 80GB HBM3", arch="sm_90", total_gib=79.1, free_gib=78.5)
    facts = tmp_path / "h100.json"
    facts.write_text(json.dumps(h100))
    work = make_workdir(
        tmp_path / "w",
        run="h100",
        hardware__nodes=1,
        hardware__gpus_per_node=8,
        hardware__gpu_model="mi300x",
        data__synthetic_rows=300,
    )
    # --retries 0: the profile retries a failed job once, which would only repeat the same verdict
    res = cluster_run(work, "--until", "verify_env", "--retries", "0", env={TEST_FACTS_ENV: str(facts)})
    assert res.returncode != 0
    report = json.loads(Path(work / "results/h100/env/verify.failed.json").read_text())
    bad = {f["check"]: f for f in report["findings"] if not f["ok"]}
    assert "mi300x (AMD Instinct MI300X)" in bad["gpu_model"]["message"]
    assert "NVIDIA H100 80GB HBM3" in bad["gpu_model"]["message"]
    assert not (work / "results/h100/env/verify.json").exists()  # a failed job's output is not trusted
