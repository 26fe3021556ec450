"""Static-cache decoding (the GPU speed lever) gives the same greedy outputs as transformers' dynamic
cache in fp32 on CPU, pads short batches without changing any row, and falls back to dynamic when
the static path fails."""

import pytest
from llmft.core import decode
from llmft.core.assets import build_tiny_model, synthetic_rows
from llmft.core.config import validate
from llmft.core.io import read_json, read_jsonl, write_jsonl
from llmft.core.settings import Config
from llmft.evaluate import run as ev
from llmft.evaluate import worker


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("decoding")
    build_tiny_model(tmp / "model", hidden_size=64, seed=3)
    # 23 rows at batch 8: two full batches and a short one (padded under static decoding).
    write_jsonl(tmp / "heldout.jsonl", synthetic_rows(23, seed=5))
    return tmp


def run(setup, decoding: str, out: str, precision: str = "auto") -> tuple[dict, list[dict]]:
    ecfg = {"batch_size": 8, "max_new_tokens": 12, "decoding": decoding, "precision": precision}
    cfg = Config.from_dict(validate({"eval": ecfg}))
    ev.evaluate(cfg, str(setup / "model"), str(setup / "heldout.jsonl"), str(setup / out), out, threads=1)
    return read_json(setup / out / "metrics.json"), read_jsonl(setup / out / "predictions.jsonl")


def test_static_equals_dynamic_in_fp32(setup):
    dyn_metrics, dyn = run(setup, "dynamic", "dynamic")
    st_metrics, st = run(setup, "static", "static")
    assert dyn_metrics["decoding"] == "dynamic" and st_metrics["decoding"] == "static"
    assert [r["prediction"] for r in st] == [r["prediction"] for r in dyn]
    assert [r["new_tokens"] for r in st] == [r["new_tokens"] for r in dyn]
    assert st_metrics["eval_loss"] == dyn_metrics["eval_loss"]
    # "auto" is dynamic on CPU.
    auto_metrics, auto = run(setup, "auto", "auto")
    assert auto_metrics["decoding"] == "dynamic" and auto == dyn


def test_graphs_equals_dynamic_in_fp32(setup):
    """llmft's own loop (eager here: no graphs on CPU) gives generate's greedy tokens, stops and all."""
    dyn_metrics, dyn = run(setup, "dynamic", "dynamic-g")
    g_metrics, g = run(setup, "graphs", "graphs")
    assert g_metrics["decoding"] == "graphs"
    assert [r["prediction"] for r in g] == [r["prediction"] for r in dyn]
    assert [r["new_tokens"] for r in g] == [r["new_tokens"] for r in dyn]
    assert g_metrics["eval_loss"] == dyn_metrics["eval_loss"]


def test_graphs_leaves_generation_config_processors_to_generate(setup, monkeypatch):
    """A model whose generation_config changes greedy tokens (here a repetition penalty) is decoded
    by generate, which applies it, with a warning, not by the loop, which would not."""
    from transformers import GenerationConfig

    assert decode.greedy_changers(GenerationConfig()) == []
    assert decode.greedy_changers(GenerationConfig(repetition_penalty=1.3, min_new_tokens=2)) == [
        "repetition_penalty",
        "min_new_tokens",
    ]
    real = worker._generate_graphs

    def penalised(model, prompts, job, device):
        model.generation_config.repetition_penalty = 1.3
        return real(model, prompts, job, device)

    monkeypatch.setattr(worker, "_generate_graphs", penalised)
    metrics, _ = run(setup, "graphs", "graphs-penalty")
    assert metrics["decoding"] == "dynamic"


def test_static_failure_falls_back_to_dynamic(setup, monkeypatch):
    _, dyn = run(setup, "dynamic", "dynamic2")
    real = worker._generate
    calls = []

    def flaky(model, prompts, job, device, decoding):
        calls.append((decoding, len(prompts)))
        if decoding == "static":
            raise RuntimeError("no static cache for this model")
        return real(model, prompts, job, device, decoding)

    monkeypatch.setattr(worker, "_generate", flaky)
    metrics, preds = run(setup, "static", "fallback")
    assert metrics["decoding"] == "dynamic"
    assert [r["prediction"] for r in preds] == [r["prediction"] for r in dyn]
    # One static attempt, then dynamic for every batch, at the batches' own sizes.
    assert calls[0] == ("static", 8) and [c[0] for c in calls[1:]] == ["dynamic"] * 3
    assert [c[1] for c in calls[1:]] == [8, 8, 7]


def test_precision_auto_is_fp32_on_cpu_and_bf16_can_be_asked(setup):
    auto, _ = run(setup, "dynamic", "prec-auto")
    half, rows = run(setup, "dynamic", "prec-bf16", precision="bf16")
    assert auto["precision"] == "fp32" and half["precision"] == "bf16"
    assert set(auto["setup_breakdown_seconds"]) == {"imports", "spawn", "devices", "encode"}
    assert len(rows) == 23 and half["eval_loss"] != auto["eval_loss"]  # really computed in bf16


def test_forked_workers_give_the_same_outputs(setup, monkeypatch):
    """The GPU start-up path: the other processes are forked with the imports done, before any
    driver set-up. Driven here on CPU (two processes standing for two GPUs)."""
    one_metrics, one = run(setup, "dynamic", "one-process")
    made = []
    real_pool = ev.worker_pool
    monkeypatch.setattr(ev, "fork_safe_gpu_count", lambda: 2)
    monkeypatch.setattr(ev, "plan_processes", lambda requested, weight_bytes: ("cpu", 2))
    monkeypatch.setattr(ev, "worker_pool", lambda n, fork=False: made.append((n, fork)) or real_pool(n, fork))
    metrics, two = run(setup, "dynamic", "forked")
    assert made == [(2, True)] and metrics["processes"] == 2
    assert [r["prediction"] for r in two] == [r["prediction"] for r in one]
    assert metrics["eval_loss"] == pytest.approx(one_metrics["eval_loss"], rel=1e-6)
    # Planned otherwise (e.g. a model too big to replicate): the forked pool is dropped.
    monkeypatch.setattr(ev, "plan_processes", lambda requested, weight_bytes: ("cpu", 1))
    made.clear()
    metrics, single = run(setup, "dynamic", "dropped")
    assert made == [(2, True), (1, False)] and metrics["processes"] == 1 and single == one
