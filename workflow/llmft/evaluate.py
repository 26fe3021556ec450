"""Held-out evaluation: eval loss / perplexity and greedy-generation metrics (exact match, ROUGE-L,
BLEU), per example and per task.

Prompts are encoded as LLaMA-Factory's template encodes them, so the model sees exactly the format
it was trained on (and the same token ids LLaMA-Factory's `do_predict` would feed it): from the
template table of `prompts.py` where that is exact, else through LLaMA-Factory itself. Generation is greedy,
batched with left padding and the KV cache.

Speed comes from three things: rows are sorted by length before batching (little padding), the
batches are spread over one process per GPU of the job, and nothing else runs (no Trainer, no
dataset cache, no metric libraries). Outputs are returned in the original row order.

Determinism: the batch plan (which rows share a batch) depends only on the row lengths, the
batch size and a fixed token budget, never on the number of processes; the processes share out
whole batches (generation: every n-th; loss: by padded size). A batch's greedy output is
therefore the same whether the job has 1 GPU or 8.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import resource
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from . import conversation
from .io import read_jsonl, write_json, write_jsonl
from .metrics import SOURCE as METRIC_SOURCE
from .metrics import exact_match, mean_scores, similarity
from .modelfiles import safetensors_stats

log = logging.getLogger("llmft.evaluate")

# Logit elements one loss batch may produce (rows x tokens x vocabulary): 2^31 is 8 GiB in fp32
# and 4 in bf16. With the tiny demo vocabulary this never binds; with a 128 k vocabulary it caps a
# loss batch at 16 k padded tokens.
LOGIT_BUDGET = 2**31
# Padded tokens per loss batch: enough to keep a GPU busy, few enough that rows of very different
# lengths do not share a batch (83 held-out rows in one batch of 64 were 97 k padded tokens for
# 30 k real ones) and that the batches spread evenly over the GPUs.
LOSS_BATCH_TOKENS = 16384

# How greedy decoding keeps its KV cache (`eval.decoding`):
#   dynamic: transformers' default growing cache, what LLaMA-Factory's predict uses;
#   static:  a preallocated cache of fixed shape, which lets transformers compile the decoding step
#            (torch.compile, CUDA graphs) on GPUs, removing the per-step Python and launch overhead.
#            On CPU transformers does not compile; the path then only exercises the static cache.
#   graphs:  llmft's own greedy loop over a static cache: the prompt is one forward, then on a GPU
#            the one-token step is captured once per batch as a CUDA/HIP graph (no compiler, well
#            under a second) and replayed, so a step costs its kernels, not Python and launches.
#            On CPU the same loop runs eagerly (what the CPU tests compare with `dynamic`).
#   auto:    graphs on GPUs (one model per GPU), dynamic on CPU and for a model spread over GPUs.
#            Measured on one H200 (bench/README.md): graphs decoded 256 rows x 64 tokens in 1.75 s
#            against 3.4 s dynamic (4.4 s against 16.6 s, 13.4 s static + CUDA graphs and 22.1 s
#            static + inductor before cuDNN attention was turned off), and in fp32 gave dynamic's
#            and LLaMA-Factory's tokens on all 83 held-out rows.
# Static decoding pads a shard's short last batch to the full batch size (copies of its last prompt,
# dropped afterwards) so every batch reuses one compiled graph and one cache; if the model cannot
# use a static cache, or generation with it fails, the shard falls back to dynamic and says so.
DECODING = ("dynamic", "static", "graphs", "auto")
# The compiled paths: a failure there falls back to dynamic.
COMPILED = ("static", "graphs")
# The compiler of the static decoding step (a bench knob, not a config key): "inductor" is
# transformers' default (generated kernels + CUDA graphs, tens of seconds to compile); "cudagraphs"
# only traces the step and replays it as one CUDA graph of the eager kernels (seconds to set up).
COMPILE_BACKEND_ENV = "LLMFT_EVAL_COMPILE_BACKEND"

# A model whose weights fill more than this share of one GPU is not replicated per GPU; it is
# spread over all GPUs of the job in one process instead (KV cache and activations need the rest).
REPLICA_MEMORY_SHARE = 0.6


# The conversation of a held-out row, as LLaMA-Factory builds it (conversation.py).
prompt_text = conversation.prompt_text
messages = conversation.messages


def _call_list(template, text: str, prefix: str) -> list | None:
    """The calls in `text` as the template's own tool extractor reads them: [(name, arguments)],
    arguments decoded; None when it finds no call."""
    import json

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
        # with a growing cache, every decoding step. Measured on one H200 (bench/decode_probe.py),
        # the first generate of a 64-row batch took 3.9 s with it and 1.1 s without; a graphs batch
        # at a new width 1.0 s and 0.45 s. The other SDPA kernels need no plan.
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


def _left_pad(prompts: list[list[int]], pad_id: int, tail: int = 0):
    """(ids, attention mask) of left-padded prompts: every prompt ends at the same column. The mask
    has `tail` more columns, closed, for the tokens still to come."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width + tail), dtype=torch.long)
    for j, p in enumerate(prompts):
        ids[j, width - len(p) :] = torch.tensor(p)
        mask[j, width - len(p) : width] = 1
    return ids, mask


def _generate(model, prompts: list[list[int]], job: ShardJob, device, decoding: str) -> list[list[int]]:
    """Greedy continuations of left-padded prompts (new tokens only, up to max_new_tokens each)."""

    if decoding == "graphs":
        return _generate_graphs(model, prompts, job, device)
    ids, attn = _left_pad(prompts, job.pad_id)
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


# generation_config.json settings (with their neutral values) that change greedy tokens in
# `generate`: the graphs loop applies none of them, so a model that sets one decodes with `generate`.
GREEDY_CHANGERS = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "sequence_bias": None,
    "bad_words_ids": None,
    "min_length": 0,
    "min_new_tokens": 0,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "exponential_decay_length_penalty": None,
}


def greedy_changers(generation_config) -> list[str]:
    """The GREEDY_CHANGERS a model's generation config sets to other than neutral."""
    return [
        k
        for k, neutral in GREEDY_CHANGERS.items()
        if getattr(generation_config, k, None) not in (None, neutral)
    ]


def _generate_graphs(model, prompts: list[list[int]], job: ShardJob, device) -> list[list[int]]:
    """`_generate`'s greedy tokens from llmft's own loop over a static KV cache (see DECODING).

    Column c of the cache holds the token at column c of the left-padded batch; the attention mask
    opens each column as its token is fed, so unfilled cache slots are never attended to. On a GPU
    the one-token step runs once eagerly (the warm-up CUDA graphs need), then is captured and
    replayed with its inputs updated in place. Rows stop at a stop id like `generate` does; the loop
    ends once every row has stopped (checked every few steps, one host sync each).
    """
    import torch
    from transformers import StaticCache

    changers = greedy_changers(getattr(model, "generation_config", None))
    if changers:
        raise ValueError(
            f"the model's generation_config sets {', '.join(changers)}, which only generate applies"
        )
    new = job.max_new_tokens
    ids, mask = _left_pad(prompts, job.pad_id, tail=new)
    n, width = ids.shape
    # Position ids as if every column were filled: each row counts from its first real token.
    positions = (
        torch.cat([mask[:, :width], torch.ones((n, new), dtype=torch.long)], 1).cumsum(-1) - 1
    ).clamp(min=0)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    stops = torch.tensor(job.stop_ids, device=device)
    cache = StaticCache(config=model.config, max_cache_len=width + new)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    def step(tokens, pos, cache_pos):
        logits = model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            cache_position=cache_pos,
            use_cache=True,
            **keep,
        ).logits
        return logits[:, -1].argmax(-1)

    out = torch.empty((n, new), dtype=torch.long, device=device)
    out[:, 0] = step(ids, positions[:, :width], torch.arange(width, device=device))
    # The one-token step's inputs live in fixed tensors, filled before each run (a graph reads them).
    # transformers 5 ignores cache_position (its StaticCache counts filled columns on the device,
    # which a replayed graph advances too); 4.x needs it.
    tok = torch.empty((n, 1), dtype=torch.long, device=device)
    pos = torch.empty((n, 1), dtype=torch.long, device=device)
    cache_pos = torch.empty((1,), dtype=torch.long, device=device)
    use_graph = device.type == "cuda" and job.device != "auto"  # a graph is captured on one GPU
    graph = nxt = None
    done = 1
    for t in range(1, new):
        col = width + t - 1  # the column of the token fed in this step
        tok.copy_(out[:, t - 1 : t])
        pos.copy_(positions[:, col : col + 1])
        cache_pos.fill_(col)
        mask[:, col] = 1
        if graph is not None:
            graph.replay()
        elif use_graph and t > 1:  # step 1 ran eagerly on this batch's shapes: capture step 2 on
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                nxt = step(tok, pos, cache_pos)
            graph.replay()
        else:
            nxt = step(tok, pos, cache_pos)
        out[:, t] = nxt
        done = t + 1
        if t % 8 == 0 and bool(torch.isin(out[:, : t + 1], stops).any(-1).all()):
            break
    return out[:, :done].tolist()


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
    import torch
    from transformers import AutoModelForCausalLM  # noqa: F401

    if torch.cuda.is_available():
        torch.cuda.init()


def import_libraries() -> None:
    """torch and the transformers classes evaluation uses, imported before any device is touched.

    transformers' generation module imports scikit-learn when it is installed, for assisted
    decoding's confidence threshold, which greedy evaluation never uses: 2.2 of the 5.8 s that
    importing transformers took on the GPU image (`python -X importtime`). It is hidden from this
    import, and only from it."""
    hide = "sklearn" not in sys.modules
    if hide:
        sys.modules["sklearn"] = None  # an import of it fails fast; find_spec reports it missing
    try:
        import torch  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    finally:
        if hide and "sklearn" in sys.modules and sys.modules["sklearn"] is None:
            del sys.modules["sklearn"]


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

    fork: the children inherit the imports (on the GPU image ~9 s a spawned process spends before
    it can start); only allowed before this process has initialised the GPU driver. Otherwise
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


def encode(rows: list[dict], model_dir: str, template_name: str):
    """Tokenizer and (prompt ids, answer ids) per row, as LLaMA-Factory's template encodes them:
    from the template table where it is exact (no LLaMA-Factory import), else LLaMA-Factory itself."""
    from transformers import AutoTokenizer

    from .chat_templates import resolved
    from .prompts import PromptEncoder

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

    from .pretokenize import load_processor

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
    cfg: dict,
    model_dir: str,
    heldout: str,
    out_dir: str,
    label: str,
    processes: int = 0,
    threads: int = 0,
) -> dict:
    """Evaluate `model_dir` on the held-out rows; write predictions.jsonl and metrics.json.

    `processes`: 0 = one per GPU (one on CPU); on CPU a larger number splits the rows over that
    many processes (used by the tests to exercise the multi-process path without GPUs).
    `threads`: CPU compute threads per process (0 = torch's default). On a shared CPU, more threads
    than the cores the scheduler granted make torch's thread pool wait on descheduled threads: the
    demo's generation measured 20-40x slower with 2 threads than with 1 while other jobs ran.
    """
    from .chat_templates import for_config as template_for_config

    ecfg = cfg["eval"]
    clock = _SetupClock()
    weights = safetensors_stats(model_dir)
    kind, n, pool = plan_eval(processes, weights["weight_bytes"], clock)
    rows = read_jsonl(heldout)[: ecfg["max_rows"]]
    template_name = template_for_config(cfg, model_dir)[0]
    tokenizer, encoded = encode(rows, model_dir, template_name)
    clock("encode")  # transformers import, tokenizer, prompts
    jobs = shard_jobs(ecfg, model_dir, tokenizer, encoded, kind, n, threads)
    log.info(
        "%s: %d rows, %d batches of <=%d, %d process(es), %s, %s decoding",
        label,
        len(rows),
        sum(len(job.gen_batches) for job in jobs),
        ecfg["batch_size"],
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
        **_quality(per_example, by_task, loss),
        "n_params": weights["n_params"],
        "device": "cpu" if kind == "cpu" else "gpu",
        "processes": n,
        "devices": [r["device"] for r in results],
        "batch_size": ecfg["batch_size"],
        "max_new_tokens": ecfg["max_new_tokens"],
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


def shard_jobs(ecfg: dict, model_dir, tokenizer, encoded, kind: str, n: int, threads: int) -> list[ShardJob]:
    """One ShardJob per process: loss and generation batches planned over all rows, then shared out."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = eos_ids(tokenizer)
    bs = ecfg["batch_size"]
    max_tokens = max(1, min(LOSS_BATCH_TOKENS, LOGIT_BUDGET // max(1, len(tokenizer))))
    lengths = [len(p) + len(a) for p, a in encoded]
    loss_plan = plan_batches(lengths, bs, max_tokens)
    gen_plan = plan_batches([len(p) for p, _ in encoded], bs)
    decoding = ecfg.get("decoding", "auto")
    if decoding == "auto":
        decoding = "dynamic" if kind in ("cpu", "auto") else "graphs"
    precision = ecfg.get("precision", "auto")
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
            max_new_tokens=ecfg["max_new_tokens"],
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
