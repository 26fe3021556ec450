"""A benchmark job whose task fails inside lm-eval: named, no traceback, nothing written."""

import json
import os
import subprocess
import sys

from llmft.data.assets import build_tiny_model

from tests.conftest import REPO
from tests.reliability import reliability


def _bench(tmp_path, bench: list, tasks: list):
    """`python -m llmft bench` (the benchmarks job's command) on tmp_path/model."""
    overrides = {"eval": {"benchmarks": bench, "benchmark_include_path": tasks}}
    cmd = [sys.executable, "-m", "llmft", "bench", "--config", str(REPO / "config" / "config.yaml")]
    cmd += ["--overrides", json.dumps(overrides), "--model", str(tmp_path / "model")]
    cmd += ["--out", str(tmp_path / "scores.json"), "--cache-dir", str(tmp_path / "cache")]
    env = dict(os.environ, PYTHONPATH=str(REPO / "workflow"))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


@reliability(
    fault="a benchmark task that fails inside lm-eval in the job (its prompt names a field its rows lack)",
    seen="the job exits 2 naming the config key, the task, the model and lm-eval's error; no traceback",
    steps_lost="none",
    data_lost="none: no scores are written, to the run or to the cache",
)
def test_a_task_failing_in_the_job_is_named_and_nothing_is_written(tmp_path):
    build_tiny_model(tmp_path / "model", seed=5)
    tasks = [str(REPO / "tests" / "bench_tasks"), str(REPO / "tests" / "bench_tasks_bad")]
    bench = [{"task": "llmft_category", "limit": 5}, {"task": "llmft_broken"}]
    proc = _bench(tmp_path, bench, tasks)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "llmft: benchmark error: config key eval.benchmarks[1]: task 'llmft_broken' failed on"
    )
    assert "no_such_field" in last and "Traceback" not in proc.stderr
    assert not (tmp_path / "scores.json").exists() and not list((tmp_path / "cache").glob("*/scores.json"))


@reliability(
    fault="a model whose context is too short for a benchmark's few-shot prompts",
    seen="the job exits 2 naming the config key, the task, the tokens needed and the model's context",
    steps_lost="none",
    data_lost="none: no scores are written, to the run or to the cache",
)
def test_a_context_too_short_for_the_few_shot_prompts_is_named(tmp_path):
    model = tmp_path / "model"
    build_tiny_model(model, seed=5)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 40}))
    bench = [{"task": "llmft_category", "limit": 5}, {"task": "llmft_first_word", "num_fewshot": 3}]
    proc = _bench(tmp_path, bench, [str(REPO / "tests" / "bench_tasks")])
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "eval.benchmarks[1]: task 'llmft_first_word' failed on" in last, proc.stderr[-2000:]
    assert (
        "but the model's context is 40 (max_position_embeddings)" in last and "Traceback" not in proc.stderr
    )
    assert not (tmp_path / "scores.json").exists()
