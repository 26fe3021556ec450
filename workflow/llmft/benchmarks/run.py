"""One benchmark job: the configured lm-eval tasks on one model, offline, reused by content.

The scores of a model are kept under a key made of the model's files (their bytes), the task set and
its settings, the task files of eval.benchmark_include_path and everything those tasks read wherever
it is (their configs with the YAML files they include, their data files and folders, the Python files
of their `!function`s), the precision and lm-eval's version: a second run with the same base model
reuses its base scores instead of running the tasks again.

On a node with several GPUs the job runs one lm-eval process per GPU (torchrun; llmft.benchmarks.
worker): lm-eval gives each rank every world_size-th document of a task and gathers the per-document
metrics on rank 0, which writes the scores. The scores do not depend on the number of processes
(tests/unit/benchmarks/test_run.py), so it is not part of the key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from llmft.benchmarks.score import evaluate_tasks
from llmft.benchmarks.tasks import TaskReads, data_cache, include_paths, task_manager, task_reads
from llmft.benchmarks.worker import launch, process_count
from llmft.core.io import read_optional, write_json
from llmft.core.settings import Eval

log = logging.getLogger("llmft.benchmarks")

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def _files_digest(h, folder: Path) -> None:
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0")
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
        h.update(b"\0")


def _path_digest(h, path: Path) -> None:
    h.update(str(path).encode() + b"\0")
    if path.is_dir():
        _files_digest(h, path)
        return
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    h.update(b"\0")


def content_key(model_dir: Path, ecfg: Eval, include: list[str], precision: str, reads: TaskReads) -> str:
    from importlib.metadata import version

    h = hashlib.sha256()
    settings = {"tasks": ecfg.benchmarks, "precision": precision, "lm_eval": version("lm_eval")}
    settings["backend"] = ecfg.benchmark_backend
    settings["task_configs"] = reads.configs
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    _files_digest(h, model_dir)
    for folder in include:
        _files_digest(h, Path(folder))
    inside = [Path(folder) for folder in include]
    for path in reads.data:  # those in an include folder are hashed with it
        if not any(path.resolve().is_relative_to(folder) for folder in inside):
            _path_digest(h, path)
    return h.hexdigest()[:16]


def _device_and_dtype(precision: str) -> tuple[str, str]:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if precision == "auto":
        precision = "bf16" if device == "cuda" else "fp32"
    return device, {"bf16": "bfloat16", "fp32": "float32"}[precision]


def run_benchmarks(
    ecfg: Eval, model_dir: str, out: str, cache_dir: str, threads: int = 0, processes: int = 0
) -> dict:
    """Score the model on eval.benchmarks into `out` (JSON), reusing earlier scores of the same key.

    processes: 0 = one per GPU of the job (one on CPU); more than one on CPU shards over CPU
    processes (the tests' way to run the multi-process path without GPUs)."""
    os.environ.update(OFFLINE)  # before datasets is imported: nothing downloads on a compute node
    os.environ["HF_DATASETS_CACHE"] = str(data_cache(ecfg))
    base = Path.cwd()
    include = include_paths(ecfg, base)
    device, dtype = _device_and_dtype(ecfg.precision)
    reads = task_reads(ecfg, include)
    key = content_key(Path(model_dir), ecfg, include, dtype, reads)
    cached = Path(cache_dir) / key / "scores.json"
    scores = read_optional(cached)
    if scores is not None:
        log.info("reusing %s (same model files, tasks, settings and lm-eval)", cached)
        write_json(out, {**scores, "model": model_dir, "reused_from": str(cached)})
        return scores
    from importlib.metadata import version

    for folder in sorted({path.parent for path in reads.code}):
        files = ", ".join(p.name for p in reads.code if p.parent == folder)
        log.info("task folder %s: its Python code runs in this job (%s, named by !function)", folder, files)
    t0 = time.perf_counter()
    n = process_count(processes, device)
    if n > 1:
        done = launch(ecfg, model_dir, device, dtype, threads, n)
    else:
        done = evaluate_tasks(Path(model_dir), ecfg, task_manager(ecfg, base), device, dtype, threads)
    scores = {
        "lm_eval": version("lm_eval"),
        "key": key,
        "device": device,
        "dtype": dtype,
        "backend": ecfg.benchmark_backend,
        "processes": done["processes"],
        "seconds": round(time.perf_counter() - t0, 2),
        "tasks": done["tasks"],
    }
    write_json(cached, scores)
    write_json(out, {**scores, "model": model_dir, "reused_from": None})
    return scores
