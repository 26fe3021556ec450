"""Evaluation on the held-out split: plan -> encode -> shard jobs -> run -> score (base and tuned alike)."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from llmft.core import conversation
from llmft.core.heldout import heldout_fingerprint, heldout_rows
from llmft.core.io import write_json, write_jsonl
from llmft.core.modelfiles import safetensors_stats
from llmft.core.settings import Config, Eval
from llmft.evaluate.metrics import SOURCE as METRIC_SOURCE
from llmft.evaluate.metrics import exact_match, mean_scores, similarity
from llmft.evaluate.worker import (
    LOGIT_BUDGET,
    LOSS_BATCH_TOKENS,
    ShardJob,
    eos_ids,
    fork_safe_gpu_count,
    import_libraries,
    plan_batches,
    plan_processes,
    run_all,
    shard,
    worker_pool,
)

log = logging.getLogger("llmft.evaluate")


# How greedy decoding keeps its KV cache (`eval.decoding`):
#   dynamic: transformers' default growing cache, what LLaMA-Factory's predict uses;
#   static:  a preallocated cache of fixed shape, which lets transformers compile the decoding step
#            (torch.compile, CUDA graphs) on GPUs, removing the per-step Python and launch overhead.
#            On CPU transformers does not compile; the path then only exercises the static cache.
#   graphs:  llmft's own greedy loop over a static cache: the prompt is one forward, then on a GPU
#            the one-token step is captured once per batch as a CUDA/HIP graph (no compiler, well
#            under a second) and replayed, so a step costs its kernels, not Python and launches.
#            On CPU the same loop runs eagerly (what the CPU tests compare with `dynamic`).
#   auto:    graphs on GPUs (one model per GPU): the fastest there, with dynamic's greedy tokens in
#            fp32 (bench/README.md, Held-out evaluation); dynamic on CPU and for a model spread over
#            GPUs.
# Static decoding pads a shard's short last batch to the full batch size (copies of its last prompt,
# dropped afterwards) so every batch reuses one compiled graph and one cache; if the model cannot
# use a static cache, or generation with it fails, the shard falls back to dynamic and says so.
DECODING = ("dynamic", "static", "graphs", "auto")


# The conversation of a held-out row, as LLaMA-Factory builds it (conversation.py).
prompt_text = conversation.prompt_text


messages = conversation.messages


def _call_list(template, text: str, prefix: str) -> list | None:
    """The calls in `text` as the template's own tool extractor reads them: [(name, arguments)],
    arguments decoded; None when it finds no call."""

    if prefix.strip() and text.startswith(prefix.strip()):
        text = text[len(prefix.strip()) :]
    found = template.extract_tool(text.strip())
    if isinstance(found, str) or not found:
        return None
    try:
        return [(call.name, json.loads(call.arguments)) for call in found]
    except (TypeError, ValueError):
        return None


@dataclass
class Reference:
    """What a generation is scored against. A text answer is its own reference. A function-call
    answer's `text` is the call exactly as the template formats it for training (the function
    formatter's text up to its first special token or stop word, where generation stops), and
    `calls` what the template's own tool extractor reads from that text: a generation matches
    exactly when the extractor reads the same calls from it (same names, equal decoded arguments,
    in order), or when it equals the text."""

    text: str
    calls: list | None = None
    template: object = None
    prefix: str = ""  # the function formatter's text before the call (Mistral's "[TOOL_CALLS] ")

    def exact_match(self, pred: str) -> float:
        if self.calls is not None and _call_list(self.template, pred, self.prefix) == self.calls:
            return 1.0
        return exact_match(pred, self.text)


def references(rows: list[dict], template_name: str, stop_texts: list[str]) -> list[Reference]:
    """The Reference of each row (LLaMA-Factory's template is imported only for function calls)."""
    out: list[Reference] = []
    template = None
    for row in rows:
        last = conversation.answer(row)
        if last["role"] != conversation.FUNCTION:
            out.append(Reference(last["content"]))
            continue
        if template is None:
            from llamafactory.data.template import TEMPLATES, Llama2Template

            template = TEMPLATES[template_name]
        # As the template's _encode calls it (Llama2-style templates pass no thought/call words).
        words = (
            {}
            if isinstance(template, Llama2Template)
            else {"thought_words": template.thought_words, "tool_call_words": template.tool_call_words}
        )
        text = ""
        for slot in template.format_function.apply(content=last["content"], **words):
            if not isinstance(slot, str):  # a special token (EOS): generation stops there
                break
            text += slot
        for stop in (*stop_texts, *template.stop_words):
            if stop and stop in text:
                text = text[: text.index(stop)]
        first = template.format_function.slots[0]
        prefix = first.split("{{content}}")[0] if isinstance(first, str) else ""
        text = text.strip()
        out.append(Reference(text, _call_list(template, text, prefix), template, prefix))
    return out


def encode(rows: list[dict], model_dir: str, template_name: str):
    """Tokenizer and (prompt ids, answer ids) per row, as LLaMA-Factory's template encodes them:
    from the template table where it is exact (no LLaMA-Factory import), else LLaMA-Factory itself."""
    from llmft.core.lf.chat_templates import resolved
    from llmft.core.lf.prompts import PromptEncoder
    from transformers import AutoTokenizer

    # Snakemake passes the name it resolved; `auto` here only in a hand-made config.
    template_name, _ = resolved(template_name, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    table, why = PromptEncoder.load(tokenizer, template_name)
    encoded = table.encode(rows) if table else None
    if encoded is not None:
        log.info("prompts: template %r from the template table", template_name)
        return tokenizer, encoded
    log.info("prompts: template %r from LLaMA-Factory (%s)", template_name, why or "a row needs it")
    return encode_with_llamafactory(rows, tokenizer, template_name, model_dir)


def encode_with_llamafactory(rows: list[dict], tokenizer, template_name: str, model_dir: str | None = None):
    """The same through LLaMA-Factory's template, which also fixes the tokenizer (EOS, pad, stop words).

    A multimodal template's plugin sees each row first, with the model's processor, as in
    LLaMA-Factory's own inference (a folder without a processor stops in load_processor)."""
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments
    from llmft.core.lf.pretokenize import load_processor

    template = get_template_and_fix_tokenizer(tokenizer, DataArguments(template=template_name))
    processor = load_processor(model_dir, tokenizer, template_name) if model_dir is not None else None
    plugin = template.mm_plugin
    encoded = []
    for row in rows:
        msgs = messages(row)
        if processor is not None:
            msgs = plugin.process_messages(msgs, [], [], [], processor)
        prompt_ids, answer_ids = template.encode_oneturn(
            tokenizer, msgs, conversation.system(row) or None, conversation.tools(row) or None
        )
        if processor is not None:
            prompt_ids, _ = plugin.process_token_ids(prompt_ids, None, [], [], [], tokenizer, processor)
        if template.efficient_eos:  # LLaMA-Factory appends EOS to such answers when training
            answer_ids = answer_ids + [tokenizer.eos_token_id]
        encoded.append((prompt_ids, answer_ids))
    return tokenizer, encoded


class _SetupClock:
    """Seconds per set-up step, for metrics.json; a step clocked twice adds up."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last = self.start
        self.setup: dict[str, float] = {}

    def __call__(self, step: str) -> None:
        now = time.perf_counter()
        self.setup[step] = round(self.setup.get(step, 0.0) + now - self.last, 3)
        self.last = now


def evaluate(
    cfg: Config,
    model_dir: str,
    heldout: str,
    out_dir: str,
    label: str,
    processes: int = 0,
    threads: int = 0,
    max_rows: int | str | None = None,
) -> dict:
    """Evaluate `model_dir` on the held-out rows; write predictions.jsonl and metrics.json.

    `processes`: 0 = one per GPU (one on CPU); on CPU a larger number splits the rows over that
    many processes (used by the tests to exercise the multi-process path without GPUs).
    `threads`: CPU compute threads per process (0 = torch's default). On a shared CPU, more threads
    than the cores the scheduler granted make torch's thread pool wait on descheduled threads, which
    slows generation many times over (bench/README.md, Held-out evaluation).
    `max_rows`: the first N rows of the split, "all" (the nightly gate's pass), None: eval.max_rows.
    """
    from llmft.core.lf.chat_templates import for_model as template_for_model

    ecfg = cfg.eval
    rows = heldout_rows(heldout, ecfg.max_rows, max_rows)
    clock = _SetupClock()
    weights = safetensors_stats(model_dir)
    kind, n, pool = plan_eval(processes, weights["weight_bytes"], clock)
    template_name = template_for_model(cfg.model, model_dir)[0]
    tokenizer, encoded = encode(rows, model_dir, template_name)
    clock("encode")  # transformers import, tokenizer, prompts
    jobs = shard_jobs(ecfg, model_dir, tokenizer, encoded, kind, n, threads)
    log.info(
        "%s: %d rows, %d batches of <=%d, %d process(es), %s, %s decoding",
        label,
        len(rows),
        sum(len(job.gen_batches) for job in jobs),
        ecfg.batch_size,
        n,
        kind,
        jobs[0].decoding,
    )
    t_jobs = time.perf_counter()
    results, row_nll, generated = run(jobs, pool, len(rows))
    per_example, by_task = score(rows, tokenizer, template_name, jobs[0].stop_ids, row_nll, generated)
    loss = sum(v[0] for v in row_nll.values()) / max(1, sum(v[1] for v in row_nll.values()))
    gen_wall = max(r["generate_seconds"] for r in results)
    metrics = {
        "label": label,
        "model": str(model_dir),
        # the rows scored, in order: the nightly gate compares two models' scores only on the same rows
        "heldout_fingerprint": heldout_fingerprint(rows),
        **_quality(per_example, by_task, loss),
        "n_params": weights["n_params"],
        "device": "cpu" if kind == "cpu" else "gpu",
        "processes": n,
        "devices": [r["device"] for r in results],
        "batch_size": ecfg.batch_size,
        "max_new_tokens": ecfg.max_new_tokens,
        **_timings(results, kind, jobs[0].precision, per_example, clock, t_jobs),
    }
    out = Path(out_dir)
    write_jsonl(out / "predictions.jsonl", per_example)
    write_json(out / "metrics.json", metrics)
    log.info(
        "%s: eval_loss %.4f exact_match %.3f rouge_l %.2f; generate %.2fs (%s new tok/s), wall %.2fs",
        label,
        loss,
        metrics["exact_match"],
        metrics["rouge_l"],
        gen_wall,
        metrics["new_tokens_per_second"],
        metrics["wall_seconds"],
    )
    sys.stdout.flush()
    return metrics


def answer_nll(cfg: Config, model_dir: str, rows: list[dict], threads: int = 0) -> dict[int, tuple]:
    """Each row's summed negative log-likelihood of its last message (the answer) under `model_dir`,
    with its answer tokens, by row index: evaluate's batched loss pass, no generation (the preference
    stage scores its held-out answers with it)."""
    from llmft.core.lf.chat_templates import for_model as template_for_model

    clock = _SetupClock()
    devices, n, pool = plan_eval(0, safetensors_stats(model_dir)["weight_bytes"], clock)
    template_name = template_for_model(cfg.model, model_dir)[0]
    tokenizer, encoded = encode(rows, model_dir, template_name)
    jobs = shard_jobs(cfg.eval, model_dir, tokenizer, encoded, devices, n, threads)
    for job in jobs:
        job.gen_batches = []
    try:
        results = run_all(jobs, pool)
    finally:
        if pool is not None:
            pool.shutdown()
    return {i: v for r in results for i, v in r["row_nll"].items()}


def plan_eval(processes: int, weight_bytes: int, clock: _SetupClock):
    """The device kind and process count, with the pool of worker processes started (None for one)."""
    import_libraries()
    clock("imports")
    # One process per GPU (the default): the others are forked now, before this process sets up
    # the driver, so they start with every import done and set up their GPUs at the same time.
    early = fork_safe_gpu_count() if processes == 0 and sys.platform.startswith("linux") else -1
    pool = worker_pool(early, fork=True) if early > 1 else None
    clock("spawn")
    kind, n = plan_processes(processes, weight_bytes)
    clock("devices")  # the accelerator's driver set-up
    if pool is not None and n != early:  # e.g. a model too big to replicate: one process
        pool.shutdown(wait=False, cancel_futures=True)
        pool = None
    if pool is None:
        # Spawned: these start now and import while this process reads and encodes the rows.
        pool = worker_pool(n)
        clock("spawn")
    return kind, n, pool


def shard_jobs(ecfg: Eval, model_dir, tokenizer, encoded, kind: str, n: int, threads: int) -> list[ShardJob]:
    """One ShardJob per process: loss and generation batches planned over all rows, then shared out."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = eos_ids(tokenizer)
    bs = ecfg.batch_size
    max_tokens = max(1, min(LOSS_BATCH_TOKENS, LOGIT_BUDGET // max(1, len(tokenizer))))
    lengths = [len(p) + len(a) for p, a in encoded]
    loss_plan = plan_batches(lengths, bs, max_tokens)
    gen_plan = plan_batches([len(p) for p, _ in encoded], bs)
    decoding = ecfg.decoding
    if decoding == "auto":
        decoding = "dynamic" if kind in ("cpu", "auto") else "graphs"
    precision = ecfg.precision
    if precision == "auto":
        precision = "fp32" if kind == "cpu" else "bf16"
    cpu_threads = threads or (max(1, (os.cpu_count() or 1) // n) if kind == "cpu" and n > 1 else 0)
    return [
        ShardJob(
            model_dir=str(model_dir),
            device={"cpu": "cpu", "auto": "auto"}.get(kind, f"cuda:{k}"),
            encoded=encoded,
            loss_batches=shard(loss_plan, n, k, cost=lengths),
            gen_batches=shard(gen_plan, n, k),
            max_new_tokens=ecfg.max_new_tokens,
            stop_ids=stops,
            pad_id=pad,
            threads=cpu_threads,
            decoding=decoding,
            precision=precision,
        )
        for k in range(n)
    ]


def run(jobs: list[ShardJob], pool, n_rows: int):
    """Run every shard; each process's results, and the NLL and generated ids merged by row index."""
    for job in jobs:
        job.submitted = time.time()
    try:
        results = run_all(jobs, pool)
    finally:
        if pool is not None:
            pool.shutdown()
    row_nll: dict[int, tuple[float, int]] = {}
    generated: dict[int, list[int]] = {}
    for res in results:
        row_nll.update(res["row_nll"])
        generated.update(res["generated"])
    missing = set(range(n_rows)) - set(generated) | set(range(n_rows)) - set(row_nll)
    if missing:
        raise RuntimeError(f"evaluation lost rows {sorted(missing)[:10]}: the shards do not cover the set")
    return results, row_nll, generated


def score(rows: list[dict], tokenizer, template_name: str, stops: list[int], row_nll: dict, generated: dict):
    """One predictions.jsonl record per row, and exact match per row grouped by task."""
    per_example = []
    by_task: dict[str, list[float]] = defaultdict(list)
    stop_texts = [tokenizer.convert_ids_to_tokens(t) for t in stops]
    refs = references(rows, template_name, [t for t in stop_texts if isinstance(t, str)])
    for i, row in enumerate(rows):
        pred = tokenizer.decode(generated[i], skip_special_tokens=True).strip()
        nll, count = row_nll[i]
        ref = refs[i]
        em = ref.exact_match(pred)
        rec = {
            "index": i,
            "prompt": prompt_text(row),
            "reference": ref.text,
            "prediction": pred,
            "task": row.get("task", ""),
            "exact_match": em,
            **similarity(pred, ref.text),
            "loss": round(nll / max(1, count), 4),
            "new_tokens": len(generated[i]),
        }
        per_example.append(rec)
        by_task[rec["task"]].append(em)
    return per_example, by_task


def _quality(per_example: list[dict], by_task: dict, loss: float) -> dict:
    """metrics.json's scores, from rows through exact_match_by_task."""
    n_rows = max(1, len(per_example))
    return {
        "rows": len(per_example),
        "eval_loss": round(loss, 4),
        "perplexity": round(math.exp(min(loss, 50)), 3),
        "exact_match": round(sum(r["exact_match"] for r in per_example) / n_rows, 4),
        **mean_scores(per_example),
        "metrics_source": METRIC_SOURCE,
        "exact_match_by_task": {t: round(sum(v) / len(v), 4) for t, v in sorted(by_task.items())},
    }


def _timings(results, kind: str, precision: str, per_example, clock: _SetupClock, t_jobs: float) -> dict:
    """metrics.json's decoding, precision and timings, from decoding through wall_seconds."""
    new_tokens = sum(r["new_tokens"] for r in per_example)
    gen_wall = max(r["generate_seconds"] for r in results)
    return {
        # What decoding ran: a process whose static path failed fell back to dynamic.
        "decoding": "+".join(sorted({r["decoding"] for r in results})),
        "precision": precision,
        "first_batch_seconds": round(max(r["first_batch_seconds"] for r in results), 3),
        "new_tokens": new_tokens,
        # The slowest process sets the wall time of each phase.
        # Until the evaluation processes start (reading and encoding the rows, spawning one process
        # per further device), then their model load (CUDA set-up included).
        "setup_seconds": round(t_jobs - clock.start, 3),
        "setup_breakdown_seconds": clock.setup,
        "start_delay_seconds": round(max(r["start_delay_seconds"] for r in results), 3),
        "load_seconds": round(max(r["load_seconds"] for r in results), 3),
        "loss_seconds": round(max(r["loss_seconds"] for r in results), 3),
        "loss_first_batch_seconds": round(max(r["loss_first_batch_seconds"] for r in results), 3),
        "generate_seconds": round(gen_wall, 3),
        "new_tokens_per_second": round(new_tokens / gen_wall, 1) if gen_wall else None,
        "peak_memory_gib": round(max(r["peak_memory_gib"] for r in results), 3),
        "peak_memory_kind": "host RSS" if kind == "cpu" else "accelerator allocated",
        "wall_seconds": round(time.perf_counter() - clock.start, 3),
    }
