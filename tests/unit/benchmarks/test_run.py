"""A benchmark job whose task fails inside lm-eval: named, no traceback, nothing written."""

import json
import os
import subprocess
import sys

import pytest
from llmft.core.assets import build_tiny_model

from tests.conftest import REPO


def _bench(tmp_path, bench: list, tasks: list, name: str = "", backend: str = "hf", processes: int = 1):
    """`python -m llmft benchmarks` (the benchmarks job's command) on tmp_path/model, into
    tmp_path/<name>scores.json with the score cache tmp_path/<name>cache (and datasets' cache in
    tmp_path/datasets)."""
    overrides = {"eval": {"benchmarks": bench, "benchmark_include_path": tasks, "benchmark_backend": backend}}
    overrides["eval"]["benchmark_data_cache"] = str(tmp_path / "datasets")
    cmd = [sys.executable, "-m", "llmft", "benchmarks", "--config", str(REPO / "config" / "config.yaml")]
    cmd += ["--overrides", json.dumps(overrides), "--model", str(tmp_path / "model")]
    cmd += ["--out", str(tmp_path / f"{name}scores.json"), "--cache-dir", str(tmp_path / f"{name}cache")]
    cmd += ["--processes", str(processes)]
    env = dict(os.environ, PYTHONPATH=str(REPO / "workflow"))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


@pytest.mark.reliability(
    fault="a benchmark task that fails inside lm-eval in the job (its prompt names a field its rows lack)",
    seen="the job exits 2 naming the config key, the task, the model and lm-eval's error; no traceback",
    steps_lost="none",
    data_lost="none: no scores are written, to the run or to the cache",
)
@pytest.mark.parametrize("processes", [1, 2])
def test_a_task_failing_in_the_job_is_named_and_nothing_is_written(tmp_path, processes):
    """With 2 processes (torchrun, gloo) too: the rank's error is the job's, without torchrun's
    own traceback of a failed child."""
    build_tiny_model(tmp_path / "model", seed=5)
    tasks = [str(REPO / "tests" / "bench_tasks"), str(REPO / "tests" / "bench_tasks_bad")]
    bench = [{"task": "llmft_category", "limit": 5}, {"task": "llmft_broken"}]
    proc = _bench(tmp_path, bench, tasks, processes=processes)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "llmft: benchmark error: config key eval.benchmarks[1]: task 'llmft_broken' failed on"
    )
    assert "no_such_field" in last and "Traceback" not in proc.stderr
    assert not (tmp_path / "scores.json").exists() and not list((tmp_path / "cache").glob("*/scores.json"))


@pytest.mark.reliability(
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


def test_two_processes_score_exactly_as_one_with_both_backends(tmp_path):
    """A job over 2 CPU processes (torchrun, gloo; on a GPU node one per GPU) shards each task's
    documents and gathers them: the scores are exactly one process's, with lm-eval's `hf` backend and
    llmft's. The limits are odd, so the ranks get unequal shares (lm-eval pads the shorter one)."""
    build_tiny_model(tmp_path / "model", seed=5)
    bench = [{"task": "llmft_category", "limit": 39}, {"task": "llmft_first_word", "limit": 9}]
    tasks = [str(REPO / "tests" / "bench_tasks")]
    runs = {}
    for backend, processes in (("hf", 1), ("hf", 2), ("llmft", 2)):
        name = f"{backend}{processes}-"
        proc = _bench(tmp_path, bench, tasks, name, backend, processes)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads((tmp_path / f"{name}scores.json").read_text())
    one, hf2, ours2 = runs.values()
    # the world size lm-eval's model ran with: 2 means each rank scored only its share
    assert (one["processes"], hf2["processes"], ours2["processes"]) == (1, 2, 2)
    assert (
        one["tasks"]["llmft_category"]["samples"] == 39 and one["tasks"]["llmft_first_word"]["samples"] == 9
    )
    assert one["tasks"]["llmft_category"]["metrics"]["acc"] > 0  # a decided score, not an empty one
    assert hf2["tasks"] == one["tasks"] and ours2["tasks"] == one["tasks"]
    assert hf2["key"] == one["key"]  # the process count is not part of the content key


FILE_TASK = """\
task: llmft_category_file
dataset_path: json
dataset_kwargs:
  data_files:
    test: words/category.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Human: Classify this word: {{word}}</s>\\nAssistant:"
doc_to_choice: ["animal", "fruit", "color", "tool", "vehicle"]
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""


@pytest.mark.reliability(
    fault="a benchmark task whose YAML reads `data_files` outside its include folder, edited after its "
    "scores were cached",
    seen="the next job scores the task again (the cache key covers every file a task config names); "
    "the job's log names each task folder whose Python code runs in it",
    steps_lost="none",
    data_lost="none",
)
def test_a_data_file_outside_the_task_folder_is_part_of_the_score_key(tmp_path):
    """The task (tmp_path/tasks) reads words/category.jsonl from the working directory, as datasets
    reads a relative data_files path; the project's llmft_first_word runs its docs.py."""
    build_tiny_model(tmp_path / "model", seed=5)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "llmft_category_file.yaml").write_text(FILE_TASK)
    words = tmp_path / "words" / "category.jsonl"
    words.parent.mkdir()
    rows = (REPO / "tests" / "bench_tasks" / "category.jsonl").read_text().splitlines()
    words.write_text("\n".join(rows[:12]) + "\n")
    bench = [{"task": "llmft_category_file"}, {"task": "llmft_first_word", "limit": 2}]
    folders = [str(tmp_path / "tasks"), str(REPO / "tests" / "bench_tasks")]

    def scores(name: str) -> dict:
        proc = _bench(tmp_path, bench, folders, name)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads((tmp_path / f"{name}scores.json").read_text()) | {"log": proc.stderr}

    first = scores("a-")
    assert first["reused_from"] is None and first["tasks"]["llmft_category_file"]["samples"] == 12
    line = f"task folder {REPO / 'tests' / 'bench_tasks'}: its Python code runs in this job (docs.py"
    assert line in first["log"] and f"task folder {tmp_path / 'tasks'}:" not in first["log"]
    assert _bench(tmp_path, bench, folders, "a-").returncode == 0  # the same files: reused
    assert json.loads((tmp_path / "a-scores.json").read_text())["reused_from"]
    words.write_text("\n".join(rows[12:20]) + "\n")  # the task folder itself is unchanged
    second = scores("a-")
    assert second["reused_from"] is None and second["key"] != first["key"]
    assert second["tasks"]["llmft_category_file"]["samples"] == 8
