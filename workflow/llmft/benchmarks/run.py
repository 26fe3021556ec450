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

from llmft.benchmarks.tasks import TaskReads, data_cache, include_paths, task_manager, task_reads
from llmft.core.io import read_optional, write_json

log = logging.getLogger("llmft.benchmarks")

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


class BenchmarkError(RuntimeError):
    """A task that failed in the job: named with its config key and the model, no traceback."""


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


def content_key(model_dir: Path, ecfg: dict, include: list[str], precision: str, reads: TaskReads) -> str:
    from importlib.metadata import version

    h = hashlib.sha256()
    settings = {"tasks": ecfg["benchmarks"], "precision": precision, "lm_eval": version("lm_eval")}
    settings["backend"] = ecfg["benchmark_backend"]
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


class ContextCheck:
    """Before lm-eval's model (hf or llmft) scores a task: refuse prompts longer than the model's
    context, which lm-eval would otherwise cut from the left without a word (few-shot examples
    lost, scores of another task)."""

    def _too_long(self, need: int, what: str) -> None:
        if need > self.max_length:
            raise ValueError(
                f"its {what} need up to {need} tokens but the model's context is {self.max_length} "
                "(max_position_embeddings): use fewer few-shot examples (num_fewshot) or a model with "
                "a longer context"
            )

    def _loglikelihood_tokens(self, requests, *args, **kwargs):
        # a rolling window may hold max_length + 1 tokens: the last one is only predicted
        self._too_long(max((len(c) + len(x) for _, c, x in requests), default=0) - 1, "prompts")
        return super()._loglikelihood_tokens(requests, *args, **kwargs)

    def generate_until(self, requests, *args, **kwargs):
        for req in requests:
            context, gen = req.args
            room = (gen or {}).get("max_gen_toks", self.max_gen_toks)
            self._too_long(len(self.tok_encode(context)) + room, "prompts and answers")
        return super().generate_until(requests, *args, **kwargs)


class Sharded:
    """lm-eval's data parallelism (the evaluator shards each task's documents by `rank` and gathers
    with `all_gather`, `gather_object` and `barrier`) over the torch.distributed group torchrun
    started. HFLM sets rank and world size itself only when it sees several GPUs (through
    Accelerate); here they come from the group, so CPU processes (gloo) shard the same way."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    def all_gather(self, tensor):
        if self.world_size <= 1:
            return tensor
        import torch
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts) if tensor.ndim == 0 else torch.cat(parts)

    def barrier(self):
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()


def _device_and_dtype(precision: str) -> tuple[str, str]:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if precision == "auto":
        precision = "bf16" if device == "cuda" else "fp32"
    return device, {"bf16": "bfloat16", "fp32": "float32"}[precision]


def _task_scores(res: dict, bench: dict) -> dict:
    """lm-eval's results of one call: per task, its metrics and their standard errors."""
    out = {}
    for task, row in res["results"].items():
        metrics, stderr = {}, {}
        for key, value in row.items():
            if "," not in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            name = metric if filt == "none" else f"{metric},{filt}"
            if metric.endswith("_stderr"):
                stderr[name.replace("_stderr", "", 1)] = value
            else:
                metrics[name] = value
        better = res.get("higher_is_better", {}).get(task, {})
        out[task] = {
            "metrics": metrics,
            "stderr": stderr,
            "higher_is_better": {m: better.get(m.split(",")[0], True) for m in metrics},
            "samples": (res.get("n-samples", {}).get(task) or {}).get("effective"),
            "settings": bench,
        }
    return out


def evaluate_tasks(model_dir: Path, ecfg: dict, tm, device: str, dtype: str, threads: int) -> dict:
    import torch
    from lm_eval import simple_evaluate

    if ecfg["benchmark_backend"] == "llmft":
        from llmft.benchmarks.backend import LlmftLM as Backend
    else:
        from lm_eval.models.huggingface import HFLM as Backend

    Model = type(f"Checked{Backend.__name__}", (ContextCheck, Sharded, Backend), {})

    if threads:
        torch.set_num_threads(threads)
    lm = Model(pretrained=str(model_dir), device=device, dtype=dtype, batch_size=ecfg["batch_size"])
    scores = {}
    for i, bench in enumerate(ecfg["benchmarks"]):
        t0 = time.perf_counter()
        try:
            res = simple_evaluate(
                model=lm,
                tasks=[bench["task"]],
                num_fewshot=bench["num_fewshot"],
                limit=bench["limit"],
                apply_chat_template=bench["chat_template"],
                task_manager=tm,
                log_samples=False,
            )
        except Exception as exc:  # lm-eval and a task's own code raise anything: name the task
            raise BenchmarkError(
                f"config key eval.benchmarks[{i}]: task {bench['task']!r} failed on {model_dir}: "
                f"{type(exc).__name__}: {str(exc)[:500]}"
            ) from None
        if res is not None:  # rank 0 of several processes holds the gathered results; the others None
            scores.update(_task_scores(res, bench))
        log.info("%s: %.1f s", bench["task"], time.perf_counter() - t0)
    return {"tasks": scores, "processes": lm.world_size}


def run_benchmarks(
    cfg: dict, model_dir: str, out: str, cache_dir: str, threads: int = 0, processes: int = 0
) -> dict:
    """Score the model on eval.benchmarks into `out` (JSON), reusing earlier scores of the same key.

    processes: 0 = one per GPU of the job (one on CPU); more than one on CPU shards over CPU
    processes (the tests' way to run the multi-process path without GPUs)."""
    ecfg = cfg["eval"]
    os.environ.update(OFFLINE)  # before datasets is imported: nothing downloads on a compute node
    os.environ["HF_DATASETS_CACHE"] = str(data_cache(ecfg))
    base = Path.cwd()
    include = include_paths(ecfg, base)
    device, dtype = _device_and_dtype(ecfg["precision"])
    reads = task_reads(ecfg, include)
    key = content_key(Path(model_dir), ecfg, include, dtype, reads)
    cached = Path(cache_dir) / key / "scores.json"
    scores = read_optional(cached)
    if scores is not None:
        log.info("reusing %s (same model files, tasks, settings and lm-eval)", cached)
        write_json(out, {**scores, "model": model_dir, "reused_from": str(cached)})
        return scores
    from importlib.metadata import version

    from llmft.benchmarks.worker import launch, process_count

    for folder in sorted({path.parent for path in reads.code}):
        files = ", ".join(p.name for p in reads.code if p.parent == folder)
        log.info("task folder %s: its Python code runs in this job (%s, named by !function)", folder, files)
    t0 = time.perf_counter()
    n = process_count(processes, device)
    if n > 1:
        done = launch(cfg, model_dir, device, dtype, threads, n)
    else:
        done = evaluate_tasks(Path(model_dir), ecfg, task_manager(ecfg, base), device, dtype, threads)
    scores = {
        "lm_eval": version("lm_eval"),
        "key": key,
        "device": device,
        "dtype": dtype,
        "backend": ecfg["benchmark_backend"],
        "processes": done["processes"],
        "seconds": round(time.perf_counter() - t0, 2),
        "tasks": done["tasks"],
    }
    write_json(cached, scores)
    write_json(out, {**scores, "model": model_dir, "reused_from": None})
    return scores
