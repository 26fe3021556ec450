"""One evaluation worker: a model on one device scoring its shard (answer loss, then greedy answers)."""

from __future__ import annotations

import inspect
import logging
import os
import resource
import sys
import time
from dataclasses import dataclass

from llmft.core.decode import greedy_graphs, left_pad

log = logging.getLogger("llmft.evaluate")

# The compiled paths: a failure there falls back to dynamic.
COMPILED = ("static", "graphs")


# Logit elements one loss batch may produce (rows x tokens x vocabulary): 2^31 is 8 GiB in fp32
# and 4 in bf16. With the tiny demo vocabulary this never binds; with a 128 k vocabulary it caps a
# loss batch at 16 k padded tokens.
LOGIT_BUDGET = 2**31


# Padded tokens per loss batch: enough to keep a GPU busy, few enough that rows of very different
# lengths do not share a batch (one batch of short and long rows is mostly padding) and that the
# batches spread evenly over the GPUs.
LOSS_BATCH_TOKENS = 16384


# The compiler of the static decoding step (a bench knob, not a config key): "inductor" is
# transformers' default (generated kernels + CUDA graphs, tens of seconds to compile); "cudagraphs"
# only traces the step and replays it as one CUDA graph of the eager kernels (seconds to set up).
COMPILE_BACKEND_ENV = "LLMFT_EVAL_COMPILE_BACKEND"


# A model whose weights fill more than this share of one GPU is not replicated per GPU; it is
# spread over all GPUs of the job in one process instead (KV cache and activations need the rest).
REPLICA_MEMORY_SHARE = 0.6


def plan_batches(lengths: list[int], batch_size: int, max_tokens: int = 0) -> list[list[int]]:
    """Row indices sorted by length (longest first, ties by index) and cut into batches of at most
    `batch_size` rows and, when `max_tokens` is set, at most that many padded tokens (rows x the
    batch's longest row; a longer row still gets a batch of its own).

    Longest first: a batch that does not fit in memory fails in the first seconds, not at the end.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) >= batch_size or (max_tokens and (len(cur) + 1) * lengths[cur[0]] > max_tokens)):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def shard(batches: list[list[int]], n: int, k: int, cost: list[int] | None = None) -> list[list[int]]:
    """Batches of process k of n. Without `cost`: every n-th. With a cost per row (its padded
    length): each batch, costliest first, to the process with the least work so far, so no
    process waits on one that drew the long rows. Each process keeps its batches longest first."""
    if cost is None:
        return batches[k::n]
    size = [len(b) * max((cost[i] for i in b), default=0) for b in batches]
    load = [0] * n
    mine: list[int] = []
    for j in sorted(range(len(batches)), key=lambda j: (-size[j], j)):
        target = min(range(n), key=lambda p: (load[p], p))
        load[target] += size[j]
        if target == k:
            mine.append(j)
    return [batches[j] for j in sorted(mine)]


def eos_ids(tokenizer) -> list[int]:
    """EOS plus additional special tokens: the stop set LLaMA-Factory's SFT workflow hands generate."""
    extra = getattr(tokenizer, "additional_special_tokens_ids", None)
    if not isinstance(extra, list):
        names = [str(t) for t in getattr(tokenizer, "_extra_special_tokens", [])]
        extra = tokenizer.convert_tokens_to_ids(names)
    return list(dict.fromkeys([tokenizer.eos_token_id] + [i for i in extra if i is not None and i != -1]))


@dataclass
class ShardJob:
    """What one evaluation process needs: no tokenizer, no template, only token ids."""

    model_dir: str
    device: str  # "cpu", "cuda:3", or "auto" (one model spread over all GPUs)
    encoded: list[tuple[list[int], list[int]]]
    loss_batches: list[list[int]]
    gen_batches: list[list[int]]
    max_new_tokens: int
    stop_ids: list[int]
    pad_id: int
    threads: int = 0
    decoding: str = "dynamic"  # "dynamic", "static" or "graphs" (see DECODING)
    submitted: float = 0.0  # time.time() when the job was handed out (to time a process's start)
    precision: str = "fp32"  # "bf16" or "fp32" (eval.precision, auto resolved by evaluate())


def progress(device, phase: str, k: int, n: int, rows: int, seconds: float, new_tokens: int = -1) -> None:
    """One line per batch on stderr (the stage's log), from whichever process ran it."""
    tokens = f", {new_tokens} new tokens" if new_tokens >= 0 else ""
    print(
        f"[llmft.evaluate] {device}: {phase} batch {k}/{n}, {rows} rows{tokens}, {seconds:.2f}s",
        file=sys.stderr,
        flush=True,
    )


def run_shard(job: ShardJob) -> dict:
    """Eval loss and greedy generation for this process's batches; results keyed by row index."""
    import torch

    t_start = time.perf_counter()
    start_delay = time.time() - job.submitted if job.submitted else 0.0
    if job.threads:
        torch.set_num_threads(job.threads)
    torch.manual_seed(0)
    on_gpu = job.device != "cpu"
    model, device = _load_model(job)
    load_s = time.perf_counter() - t_start
    row_nll, loss_s, loss_first_s = _loss_pass(model, job, device)
    generated, gen_s, first_batch_s, decoding = _generate_pass(model, job, device)
    if on_gpu:
        peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
    else:  # ru_maxrss is KiB on Linux: the process's host memory high-water mark
        peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {
        "device": str(device),
        "row_nll": row_nll,
        "generated": generated,
        "start_delay_seconds": start_delay,
        "load_seconds": load_s,
        "loss_seconds": loss_s,
        "loss_first_batch_seconds": loss_first_s or 0.0,
        "generate_seconds": gen_s,
        "first_batch_seconds": first_batch_s or 0.0,
        "decoding": decoding,
        "peak_memory_gib": peak_gib,
    }


def _load_model(job: ShardJob):
    """The model in eval mode on the job's device, and the device its inputs go to."""
    import torch
    from transformers import AutoModelForCausalLM

    on_gpu = job.device != "cpu"
    dtype = torch.bfloat16 if job.precision == "bf16" else torch.float32
    if job.device == "auto":
        model = AutoModelForCausalLM.from_pretrained(job.model_dir, dtype=dtype, device_map="auto")
        device = model.get_input_embeddings().weight.device
    else:
        device = torch.device(job.device)
        if on_gpu:
            torch.cuda.set_device(device)
        # On a GPU straight to it: no full copy of the weights in host memory first.
        placement = {"device_map": {"": device}} if on_gpu else {}
        model = AutoModelForCausalLM.from_pretrained(job.model_dir, dtype=dtype, **placement)
    model.eval()
    if on_gpu and torch.version.cuda and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        # cuDNN's attention builds an execution plan for every new shape: every batch width and,
        # with a growing cache, every decoding step, so each batch's first calls are slow. The other
        # SDPA kernels need no plan (bench/decode_probe.py measures it; bench/README.md has figures).
        torch.backends.cuda.enable_cudnn_sdp(False)
    return model, device


def _loss_pass(model, job: ShardJob, device):
    """(summed answer NLL, answer tokens) per row; the pass's seconds and its first batch's."""
    import torch

    t0 = time.perf_counter()
    row_nll: dict[int, tuple[float, int]] = {}
    keep_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
    loss_first_s = None
    with torch.inference_mode():
        for k, batch in enumerate(job.loss_batches, 1):
            tb = time.perf_counter()
            nll = answer_nll(model, [job.encoded[i] for i in batch], job.pad_id, device, keep_logits)
            row_nll.update(zip(batch, nll, strict=True))
            if loss_first_s is None:  # the first forward carries the accelerator's one-time set-up
                loss_first_s = time.perf_counter() - t0
            progress(device, "loss", k, len(job.loss_batches), len(batch), time.perf_counter() - tb)
    return row_nll, time.perf_counter() - t0, loss_first_s


def _generate_pass(model, job: ShardJob, device):
    """Generated ids per row (cut at the first stop id); the pass's seconds, its first batch's, and
    the decoding it ended with (a compiled path that fails falls back to dynamic)."""
    import torch

    t0 = time.perf_counter()
    generated: dict[int, list[int]] = {}
    decoding = job.decoding
    full = max((len(b) for b in job.gen_batches), default=0)
    first_batch_s = None
    with torch.inference_mode():
        for k, batch in enumerate(job.gen_batches, 1):
            tb = time.perf_counter()
            prompts = [job.encoded[i][0] for i in batch]
            if decoding == "static":  # one compiled graph for every batch: the same shape
                prompts += [prompts[-1]] * (full - len(prompts))
            try:
                out = _generate(model, prompts, job, device, decoding)
            except Exception as exc:  # noqa: BLE001 - any failure of a compiled path: fall back
                if decoding not in COMPILED:
                    raise
                log.warning(
                    "%s decoding failed (%s: %s); dynamic cache from here", decoding, type(exc).__name__, exc
                )
                decoding = "dynamic"
                prompts = prompts[: len(batch)]
                out = _generate(model, prompts, job, device, decoding)
            for j, seq in enumerate(out[: len(batch)]):
                cut = next((c for c, t in enumerate(seq) if t in job.stop_ids), len(seq))
                generated[batch[j]] = seq[:cut]
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - tb
            new_tokens = sum(len(generated[i]) for i in batch)
            progress(
                device, "generate", k, len(job.gen_batches), len(batch), time.perf_counter() - tb, new_tokens
            )
    return generated, time.perf_counter() - t0, first_batch_s, decoding


def _generate(model, prompts: list[list[int]], job: ShardJob, device, decoding: str) -> list[list[int]]:
    """Greedy continuations of left-padded prompts (new tokens only, up to max_new_tokens each)."""

    if decoding == "graphs":
        return _generate_graphs(model, prompts, job, device)
    ids, attn = left_pad(prompts, job.pad_id)
    width = ids.shape[1]
    extra = {}
    if decoding == "static":
        from transformers import CompileConfig

        backend = os.environ.get(COMPILE_BACKEND_ENV, "inductor")
        # A mode is an inductor option; other backends take none.
        mode = "reduce-overhead" if backend == "inductor" else None
        extra = {
            "cache_implementation": "static",
            "compile_config": CompileConfig(backend=backend, mode=mode),
        }
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        do_sample=False,
        num_beams=1,
        max_new_tokens=job.max_new_tokens,
        eos_token_id=job.stop_ids,
        pad_token_id=job.pad_id,
        use_cache=True,
        **extra,
    )
    return out[:, width:].tolist()


def _generate_graphs(model, prompts: list[list[int]], job: ShardJob, device) -> list[list[int]]:
    """`_generate`'s greedy tokens from llmft's own loop (core.decode.greedy_graphs, see DECODING)."""
    return greedy_graphs(
        model, prompts, job.max_new_tokens, job.stop_ids, job.pad_id, device, capture=job.device != "auto"
    )


def answer_nll(model, seqs: list[tuple[list[int], list[int]]], pad_id: int, device, keep_logits: bool):
    """(summed NLL, token count) of each row's answer given its prompt.

    Rows are left-padded so every answer ends in the last column; then only the last
    (longest answer + 1) positions need logits. With a 128 k vocabulary, full logits of 64 rows of
    4 k tokens would take ~130 GB in fp32; these take rows x answer x vocab, upcast one row at a time.
    """
    import torch

    width = max(len(p) + len(a) for p, a in seqs)
    keep = max(len(a) for _, a in seqs) + 1
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for j, (p, a) in enumerate(seqs):
        ids[j, width - len(p) - len(a) :] = torch.tensor(p + a)
        labels[j, width - len(a) :] = torch.tensor(a)
        attn[j, width - len(p) - len(a) :] = 1
    positions = (attn.cumsum(-1) - 1).clamp(min=0)  # left padding: each row's positions start at 0
    extra = {"logits_to_keep": keep} if keep_logits else {}
    logits = model(
        input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=positions.to(device), **extra
    ).logits
    kept = logits.shape[1]
    # The logits in column t predict the token in column t + 1.
    targets = labels[:, width - kept + 1 :].to(logits.device)
    nll = torch.stack(
        [
            torch.nn.functional.cross_entropy(
                logits[j, :-1].float(), targets[j], ignore_index=-100, reduction="sum"
            )
            for j in range(len(seqs))
        ]
    )
    # One transfer to the host for the batch, not one wait per row.
    return list(zip(nll.tolist(), (targets != -100).sum(1).tolist(), strict=True))


def _spawned_worker(job: ShardJob) -> dict:
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    return run_shard(job)


def plan_processes(requested: int, weight_bytes: int) -> tuple[str, int]:
    """(device kind, processes): one process per GPU, or one spread over all GPUs for a model too big
    to replicate, or `requested` CPU processes (1 unless asked: the CPU path is a single process)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", max(1, requested)
    n_gpu = torch.cuda.device_count()
    per_gpu = min(torch.cuda.get_device_properties(i).total_memory for i in range(n_gpu))
    if n_gpu > 1 and weight_bytes > REPLICA_MEMORY_SHARE * per_gpu:
        return "auto", 1
    return "cuda", min(requested or n_gpu, n_gpu)


def _warm_up() -> None:
    """Run in each worker process as soon as it exists: the imports (already done in a forked one)
    and the accelerator's driver set-up, while the parent still reads and encodes the rows."""
    import_libraries()
    import torch

    if torch.cuda.is_available():
        torch.cuda.init()


def import_libraries() -> None:
    """torch and the transformers classes evaluation uses, imported before any device is touched,
    without the packages they would import for nothing (llmft.core.imports)."""
    from llmft.core.imports import UNUSED_BY_INFERENCE, hidden

    with hidden(*UNUSED_BY_INFERENCE):
        import torch  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def fork_safe_gpu_count() -> int:
    """GPUs visible to this process, counted through NVML (AMD SMI on ROCm) without initialising
    the driver, which would leave forked children unable to use the GPU; -1 when unknown."""
    import torch

    try:
        if torch.version.hip:
            return int(torch.cuda._device_count_amdsmi())
        if torch.version.cuda:
            return int(torch.cuda._device_count_nvml())
    except Exception:  # noqa: BLE001 - a private helper of torch: unknown, take the spawn path
        return -1
    return 0


def worker_pool(n: int, fork: bool = False):
    """n - 1 processes for shards 1..n-1, started and warming up at once (None for n = 1).

    fork: the children inherit the imports (which a spawned process repeats before it can start);
    only allowed before this process has initialised the GPU driver. Otherwise
    spawn: CUDA cannot be used in a forked child of a process that touched it."""
    if n <= 1:
        return None
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(max_workers=n - 1, mp_context=mp.get_context("fork" if fork else "spawn"))
    for _ in range(n - 1):
        pool.submit(_warm_up)
    return pool


def run_all(jobs: list[ShardJob], pool) -> list[dict]:
    """Run the shards: job 0 in this process, the others in worker_pool's processes at the same time."""
    if len(jobs) == 1:
        return [run_shard(jobs[0])]
    futures = [pool.submit(_spawned_worker, job) for job in jobs[1:]]
    first = run_shard(jobs[0])
    return [first] + [f.result() for f in futures]
