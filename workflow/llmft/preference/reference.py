"""The reference step: the frozen reference model's log-probability of every sequence the preference
stage trains and evaluates on (a pair's chosen and rejected answers; a KTO row's completion and its
KL row), computed once and kept in a store shared by runs, so the training step loads no reference
model (llmft.preference.refpatch).

Those numbers depend only on the reference model's weights and the tokens, so the store is keyed by
both:
- the model's fingerprint (`model_fingerprint`): xxh3-128 over the size and xxh3-128 of each weight
  file and config.json, from the folder's seal (published folders carry llmft_seal.json, checked
  first) or from the files themselves;
- each sequence's fingerprint (`sequence_key`): xxh3-128 of its real tokens and which of them carry a
  label, so a training batch finds its values without row ids.

Layout: <store>/<model fingerprint>/<dtype>/shards/<xxh3 of the shard's keys>.json, each shard
{format, model, dtype, keys, logps, check}, written atomically (temp + rename). A pass loads the
valid shards, computes only the sequences none holds (new or changed pairs), SHARD_SEQUENCES at a
time, one shard written as soon as it is done: a killed pass resumes from the shards it wrote. A shard
whose fingerprints or checksum do not match is named in the log, set aside (`.refused`) and never
used. The run's record (results/<run>/preference/reference/reference.json) names the model, the
shards that hold its sequences, and what was computed and reused; the training step reads it.

The forward is the padding-free one training uses (padfree.packed_logps; LLaMA-Factory's padded one
where torch's varlen kernel cannot run: fp32 on a GPU, a node without it), in inference mode, batches
of at most a token budget; one process per GPU (data parallel over shards), one on CPU.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from llmft.core.io import read_json, write_json, write_text

log = logging.getLogger("llmft.preference.reference")

FORMAT = 1
# The store beside the run folders (a path relative to the workflow's directory).
STORE = "results/cache/reference"
# Sequences per shard: what a killed pass loses at most, and a shard file of ~100 kB.
SHARD_SEQUENCES = 2048
# The record each run's step writes (the training step's input).
RECORD = "reference.json"
# Tokens per forward batch when the device's free memory is unknown (CPU).
CPU_BATCH_TOKENS = 4096
# The most tokens of one forward batch on a GPU (an inference forward holds one layer's activations
# at a time; the output layer runs a chunk at a time, padfree.CHUNK_TOKENS).
MAX_BATCH_TOKENS = 1 << 17
# The tokenized splits the trainer reads (prepare_preference's tokenized/) and each kind's sequences.
SPLITS = ("train", "validation")
SIDES = {
    "dpo": (("chosen_input_ids", "chosen_labels"), ("rejected_input_ids", "rejected_labels")),
    "kto": (("input_ids", "labels"), ("kl_input_ids", "kl_labels")),
}
# The files of a model folder its log-probabilities depend on.
WEIGHT_SUFFIXES = (".safetensors", ".bin")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
IGNORE_INDEX = -100


class ReferenceError(RuntimeError):
    """A reference cache that cannot be used (named), or a model that cannot be fingerprinted."""


def _weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name == "config.json"


def model_fingerprint(model_dir: str | Path) -> str:
    """xxh3-128 (hex) of the model folder's weight files and config.json (size and content hash of
    each): from its seal where it has one (refused when the folder no longer matches it), else hashed
    here."""
    import xxhash
    from llmft.core.modelfiles import SEAL, content_hash, seal_problems

    folder = Path(model_dir)
    problems = seal_problems(folder)
    if problems:
        raise ReferenceError(f"reference model {folder}: {problems[0]}")
    if (folder / SEAL).is_file():
        sealed = read_json(folder / SEAL)["files"]
        files = {k: [v["size"], v["xxh3_128"]] for k, v in sealed.items() if _weight_file(Path(k).name)}
    else:
        files = {
            str(p.relative_to(folder)): [p.stat().st_size, content_hash(p)]
            for p in sorted(folder.rglob("*"))
            if p.is_file() and _weight_file(p.name)
        }
    if not any(name.endswith(WEIGHT_SUFFIXES) for name in files):
        raise ReferenceError(f"reference model {folder}: no weight files (*.safetensors, *.bin)")
    return xxhash.xxh3_128(json.dumps(files, sort_keys=True).encode()).hexdigest()


def sequence_key(ids, labels) -> str:
    """xxh3-128 (hex) of one sequence's tokens and label mask (which tokens carry a label)."""
    import numpy as np
    import xxhash

    ids = np.asarray(ids, dtype="<i8")
    mask = np.asarray(labels) != IGNORE_INDEX
    h = xxhash.xxh3_128(len(ids).to_bytes(8, "little"))
    h.update(ids.tobytes())
    h.update(np.packbits(mask).tobytes())
    return h.hexdigest()


def tokenized_splits(data_dir: str | Path):
    """(dpo | kto, prepare_preference's tokenized DatasetDict)."""
    import datasets
    from llmft.core.lf.pretokenize import TOKENIZED_DIR

    path = Path(data_dir) / TOKENIZED_DIR
    try:
        splits = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise ReferenceError(f"{path}: no tokenized preference data ({exc}); run prepare_preference") from exc
    columns = set(splits[SPLITS[0]].column_names)
    return ("dpo" if "chosen_input_ids" in columns else "kto"), splits


def read_sequences(
    data_dir: str | Path, splits: tuple[str, ...] = SPLITS, max_rows: int | None = None, kl: bool = True
) -> tuple[str, dict[str, tuple[list, list]]]:
    """(dpo | kto, {key: (input ids, labels)}) of every sequence of prepare_preference's tokenized
    `splits` (each the first `max_rows` rows, None: all; `kl` False: not KTO's KL rows), one entry per
    distinct sequence."""
    kind, data = tokenized_splits(data_dir)
    out: dict[str, tuple[list, list]] = {}
    for split in splits:
        rows = data[split] if max_rows is None else data[split].select(range(min(max_rows, len(data[split]))))
        for ids_col, labels_col in SIDES[kind][: 1 if kind == "kto" and not kl else 2]:
            for ids, labels in zip(rows[ids_col], rows[labels_col], strict=True):
                out.setdefault(sequence_key(ids, labels), (ids, labels))
    return kind, out


def _check(keys: list, logps: list) -> str:
    import xxhash

    return xxhash.xxh3_128(json.dumps([keys, logps]).encode()).hexdigest()


class Store:
    """One model's (and dtype's) shards in the shared store."""

    def __init__(self, root: str | Path, model: str, dtype: str):
        self.model, self.dtype = model, dtype
        self.dir = Path(root) / model / dtype
        self.shards = self.dir / "shards"

    def shard_problem(self, path: Path) -> tuple[str | None, dict]:
        """(why the shard cannot be used or None, its content)."""
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            return f"unreadable ({exc})", {}
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return f"not a format-{FORMAT} reference shard", {}
        for key, want in (("model", self.model), ("dtype", self.dtype)):
            if data.get(key) != want:
                return f"its {key} fingerprint {data.get(key)!r} is not this store's {want!r}", {}
        keys, logps = data.get("keys"), data.get("logps")
        if not isinstance(keys, list) or not isinstance(logps, list) or len(keys) != len(logps):
            return "keys and logps do not match", {}
        if data.get("check") != _check(keys, logps):
            return "its checksum does not match its content", {}
        return None, data

    def load(self) -> dict[str, tuple[float, str]]:
        """{sequence key: (logp, shard name)} of every valid shard; invalid ones are named, set aside
        (renamed *.refused) and not used."""
        out: dict[str, tuple[float, str]] = {}
        for path in sorted(self.shards.glob("*.json")) if self.shards.is_dir() else ():
            problem, data = self.shard_problem(path)
            if problem:
                log.warning("refused reference shard %s: %s; its sequences are computed again", path, problem)
                path.replace(path.with_suffix(".refused"))
                continue
            out.update((k, (v, path.name)) for k, v in zip(data["keys"], data["logps"], strict=True))
        return out

    def write(self, keys: list[str], logps: list[float]) -> str:
        """Write one shard atomically (temp + rename); return its file name."""
        import xxhash

        self.shards.mkdir(parents=True, exist_ok=True)
        name = xxhash.xxh3_128("\n".join(keys).encode()).hexdigest() + ".json"
        data = {"format": FORMAT, "model": self.model, "dtype": self.dtype, "keys": keys, "logps": logps}
        data["check"] = _check(keys, logps)
        write_text(self.shards / name, json.dumps(data))  # temp + rename
        return name


def batches(sequences: list[tuple[str, list, list]], budget: int):
    """Sequences in batches of at most `budget` tokens (each batch one sequence at least), longest first."""
    order = sorted(sequences, key=lambda s: -len(s[1]))
    batch, tokens = [], 0
    for seq in order:
        if batch and tokens + len(seq[1]) > budget:
            yield batch
            batch, tokens = [], 0
        batch.append(seq)
        tokens += len(seq[1])
    if batch:
        yield batch


def padded(batch: list[tuple[str, list, list]], device) -> dict:
    """A right-padded (rows, longest) batch of input ids, attention mask and labels."""
    import torch

    longest = max(len(ids) for _, ids, _ in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for r, (_, row_ids, row_labels) in enumerate(batch):
        n = len(row_ids)
        ids[r, :n], mask[r, :n], labels[r, :n] = torch.tensor(row_ids), 1, torch.tensor(row_labels)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def load_model(model_dir: str, dtype: str, device: str):
    import torch
    from llmft.core import varlen
    from transformers import AutoModelForCausalLM

    varlen.register()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, DTYPES[dtype]))
    return model.to(device).eval()


def batch_tokens(model, device: str, padfree: bool = True) -> int:
    """The token budget of one forward batch: what the device's free memory holds beside the weights
    (a share of it; the padded forward's fp32 logits and log-softmax too), or CPU_BATCH_TOKENS on a
    CPU."""
    import torch

    if not device.startswith("cuda"):
        return CPU_BATCH_TOKENS
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    cfg = model.config
    # fp32 upper bound of one layer's live tensors per token: residual, norms, q/k/v/o, the MLP's three
    per_token = 4 * (8 * cfg.hidden_size + 3 * getattr(cfg, "intermediate_size", 4 * cfg.hidden_size))
    per_token += 0 if padfree else 10 * cfg.vocab_size  # 16-bit logits, their fp32 log-softmax
    return max(1024, min(MAX_BATCH_TOKENS, int(0.5 * free / per_token) // 1024 * 1024))


def padfree_runs(device: str, dtype: str) -> bool:
    """Whether the padding-free forward runs here: on a CPU (per-sequence SDPA), or on a GPU with
    torch's varlen kernel, which computes in fp16/bf16 only."""
    from llmft.core import varlen

    return not device.startswith("cuda") or (varlen.available() and dtype != "fp32")


def padded_logps(model, batch: dict):
    """Per-sequence sums of label log-probabilities the way LLaMA-Factory's padded forward computes
    them (every position's fp32 logits): where the padding-free forward cannot run."""
    import torch

    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).logits
    labels = batch["labels"][:, 1:]
    logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, labels.clamp(min=0).unsqueeze(-1))
    return (logps.squeeze(-1) * (labels != IGNORE_INDEX)).sum(-1)


def compute_shard(model, shard: list, device: str, budget: int, pad_id: int, padfree: bool = True) -> list:
    """The summed label log-probability of each sequence of `shard` ((key, ids, labels) each), in its
    order: padding-free (padfree.packed_logps, as training), or padded where that cannot run."""
    import torch
    from llmft.preference.padfree import packed_logps

    values: dict[str, float] = {}
    with torch.inference_mode():
        for batch in batches(shard, budget):
            rows = padded(batch, device)
            out = packed_logps(model, rows, pad_id)["logps"] if padfree else padded_logps(model, rows)
            values.update((key, v) for (key, _, _), v in zip(batch, out.float().cpu().tolist(), strict=True))
    return [values[key] for key, _, _ in shard]


def work(rank: int, jobs: list, model_dir: str, dtype: str, store: Store, budget: int) -> int:
    """One process's shards (`jobs`: lists of (key, ids, labels)), each written as soon as it is
    computed; returns the sequences computed."""
    import torch

    device = f"cuda:{rank}" if torch.cuda.is_available() else "cpu"
    model = load_model(model_dir, dtype, device)
    padfree = padfree_runs(device, dtype)
    budget = budget or batch_tokens(model, device, padfree)
    pad_id = model.config.pad_token_id or 0
    done = 0
    for shard in jobs:
        logps = compute_shard(model, shard, device, budget, pad_id, padfree)
        name = write_shard(store, [key for key, _, _ in shard], logps)
        done += len(shard)
        log.info("rank %d: shard %s, %d sequences", rank, name, len(shard))
    return done


def write_shard(store: Store, keys: list[str], logps: list[float]) -> str:
    return store.write(keys, logps)


def _spawned(rank: int, jobs: list, model_dir: str, dtype: str, store: Store, budget: int) -> None:
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    work(rank, jobs, model_dir, dtype, store, budget)


def run_processes(n: int, jobs: list, model_dir: str, dtype: str, store: Store, budget: int) -> None:
    """Shards dealt round-robin over `n` processes: this one (rank 0) and n - 1 spawned ones."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    args = (model_dir, dtype, store, budget)
    procs = [ctx.Process(target=_spawned, args=(r, jobs[r::n], *args)) for r in range(1, n)]
    for p in procs:
        p.start()
    work(0, jobs[0::n], model_dir, dtype, store, budget)
    for p in procs:
        p.join()
    failed = [r for r, p in enumerate(procs, 1) if p.exitcode != 0]
    if failed:
        raise ReferenceError(f"reference pass: process(es) {failed} failed (their log lines above)")


def process_count(requested: int) -> int:
    """0 = one per GPU (one on a CPU); else `requested`."""
    import torch

    if requested:
        return requested
    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def reference_pass(
    model_dir: str,
    data_dir: str,
    out: str,
    dtype: str = "fp32",
    store_root: str = STORE,
    processes: int = 0,
    shard_sequences: int = SHARD_SEQUENCES,
    batch_budget: int = 0,
    splits: tuple[str, ...] = SPLITS,
    max_rows: int | None = None,
    kl: bool = True,
) -> dict:
    """The reference model's log-probabilities of every sequence of `data_dir`'s tokenized pairs (or
    KTO rows; `splits`, each its first `max_rows` rows; `kl` False: not KTO's KL rows) into the store,
    computing only those it lacks; the run's record written to `out`."""
    start = time.monotonic()
    model = model_fingerprint(model_dir)
    store = Store(store_root, model, dtype)
    kind, sequences = read_sequences(data_dir, splits, max_rows, kl)
    have = store.load()
    missing = [(key, ids, labels) for key, (ids, labels) in sequences.items() if key not in have]
    jobs = [missing[i : i + shard_sequences] for i in range(0, len(missing), shard_sequences)]
    n = min(process_count(processes), len(jobs)) if jobs else 0  # a warm pass imports no torch
    log.info(
        "reference %s (%s, %s): "
        "%d sequences, %d in the store, %d to compute in %d shard(s) on %d process(es)",
        model_dir, model, dtype, len(sequences), len(sequences) - len(missing), len(missing), len(jobs), n,
    )  # fmt: skip
    if jobs:
        run_processes(n, jobs, model_dir, dtype, store, batch_budget)
        have = store.load()
    lost = [key for key in sequences if key not in have]
    if lost:
        raise ReferenceError(f"reference pass: {len(lost)} sequences have no value in {store.dir} after it")
    record = {
        "format": FORMAT,
        "kind": kind,
        "model_dir": str(model_dir),
        "model": model,
        "dtype": dtype,
        "store": str(store.dir),
        "data": data_fingerprint(sequences),
        "sequences": len(sequences),
        "computed": len(missing),
        "reused": len(sequences) - len(missing),
        "shards": sorted({have[key][1] for key in sequences}),
        "seconds": round(time.monotonic() - start, 2),
    }
    write_json(out, record)
    log.info("reference: %d computed, %d reused -> %s", record["computed"], record["reused"], out)
    return record


def data_fingerprint(sequences) -> str:
    """xxh3-128 of the sorted sequence keys: which sequences the record covers."""
    import xxhash

    return xxhash.xxh3_128("\n".join(sorted(sequences)).encode()).hexdigest()


def load_record(record_path: str | Path, model_dir: str | None = None) -> dict[str, float]:
    """{sequence key: reference logp} of a run's record, every shard checked: a record or shard whose
    fingerprints do not match (the model folder changed since, a shard of another model, a corrupt
    file) is refused by name. `model_dir`: the reference model the caller trains against (default:
    the record's)."""
    path = Path(record_path)
    try:
        record = read_json(path)
    except (OSError, ValueError) as exc:
        raise ReferenceError(
            f"reference log-probabilities {path}: unreadable ({exc}); rerun the reference step"
        ) from exc
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ReferenceError(f"reference log-probabilities {path}: not a format-{FORMAT} record")
    model = model_fingerprint(model_dir or record["model_dir"])
    if model != record["model"]:
        raise ReferenceError(
            f"reference log-probabilities {path} are of model {record['model']}, but "
            f"{model_dir or record['model_dir']} is now {model}: stale, rerun the reference step"
        )
    store = Store(Path(record["store"]).parent.parent, model, record["dtype"])
    values: dict[str, float] = {}
    for name in record["shards"]:
        problem, data = store.shard_problem(store.shards / name)
        if problem:
            raise ReferenceError(f"reference shard {store.shards / name} (record {path}): {problem}")
        values.update(zip(data["keys"], data["logps"], strict=True))
    return values


def heldout_logps(
    model_dir: str, data_dir: str, out: str, max_rows: int | str | None, dtype: str, **kw
) -> list[dict]:
    """The nightly gate's log-probabilities of a reference model on the first `max_rows` held-out
    pairs (or KTO rows; "all" or None: every one), from the store (computing only the sequences it
    lacks), written as evaluate-preference --logps-only writes them: logps.jsonl (a record per row:
    chosen/rejected or logp, their answer tokens) and rows.json (their count and fingerprint), beside
    the pass's own record (reference.json)."""
    from llmft.core.heldout import heldout_fingerprint
    from llmft.core.io import read_jsonl, write_jsonl
    from llmft.preference.evaluate import answer_rows

    limit = None if max_rows in (None, "all") else int(max_rows)
    folder = Path(out).parent
    record = str(folder / RECORD)
    reference_pass(model_dir, data_dir, record, dtype, splits=("validation",), max_rows=limit, kl=False, **kw)
    values = load_record(folder / RECORD, model_dir)
    kind, data = tokenized_splits(data_dir)
    heldout = read_jsonl(Path(data_dir) / "heldout.jsonl")[:limit]
    rows = data["validation"].select(range(len(heldout)))
    prompts = [r["messages"][-2]["content"] for r in answer_rows(heldout)[1]][:: 2 if kind == "dpo" else 1]

    def logp(ids, labels) -> tuple[float, int]:
        return values[sequence_key(ids, labels)], sum(label != IGNORE_INDEX for label in labels)

    records = []
    for i, row in enumerate(rows):
        if kind == "dpo":
            (c, ct), (r, rt) = (logp(row[a], row[b]) for a, b in SIDES["dpo"])
            rec = {"chosen": c, "rejected": r, "chosen_tokens": ct, "rejected_tokens": rt}
        else:
            v, t = logp(row["input_ids"], row["labels"])
            rec = {"logp": v, "tokens": t, "kto_tag": bool(heldout[i]["kto_tag"])}
        records.append({**rec, "index": i, "kind": kind, "prompt": prompts[i]})
    write_jsonl(out, records)
    write_json(folder / "rows.json", {"model": str(model_dir), "kind": kind, "rows": len(records),
                                      "heldout_fingerprint": heldout_fingerprint(heldout)})  # fmt: skip
    return records
