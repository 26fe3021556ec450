"""lm-eval in one process: the configured tasks on a model (hf or llmft's backend), prompts longer
than the model's context refused, each task's documents shared over the processes of a torchrun
group, and each task's metrics with their standard errors."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from llmft.core.settings import Eval

log = logging.getLogger("llmft.benchmarks")


class BenchmarkError(RuntimeError):
    """A task that failed in the job: named with its config key and the model, no traceback."""


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


def evaluate_tasks(model_dir: Path, ecfg: Eval, tm, device: str, dtype: str, threads: int) -> dict:
    import torch
    from lm_eval import simple_evaluate

    if ecfg.benchmark_backend == "llmft":
        from llmft.benchmarks.backend import LlmftLM as Backend
    else:
        from lm_eval.models.huggingface import HFLM as Backend

    Model = type(f"Checked{Backend.__name__}", (ContextCheck, Sharded, Backend), {})

    if threads:
        torch.set_num_threads(threads)
    lm = Model(pretrained=str(model_dir), device=device, dtype=dtype, batch_size=ecfg.batch_size)
    scores = {}
    for i, bench in enumerate(ecfg.benchmarks):
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
