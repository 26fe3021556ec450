"""Packing pre-tokenized rows exactly as LLaMA-Factory's packed SFT preprocessing packs them.

LLaMA-Factory packs inside its tokenizing map: per map batch (`preprocessing_batch_size` rows of a
contiguous shard, one shard per `preprocessing_num_workers`) it fills sequences of `cutoff_len`
tokens greedily. Here its own PackedSupervisedDatasetProcessor runs over the same batches with its
tokenization swapped for the ids prepare_data already made, so a run with `packing` or
`neat_packing` can load packed rows through `tokenized_path` as well. The few rows LLaMA-Factory
would truncate (exactly `cutoff_len` tokens: packing keeps one token spare) go through its own
encoding, from their text.

The packed folder is written under a temporary name and renamed when complete, with a stamp
(STAMP_FILE) naming the arguments it was packed for and the tokenized rows it was packed from:
render-sft refuses packed rows made for other arguments or from an earlier prepare_data run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from llmft.core import conversation
from llmft.core.io import atomic_path
from llmft.core.lf.pretokenize import load_tokenizer_and_template, write_dataset_dict

SPLITS = (("train", "train.jsonl"), ("validation", "heldout.jsonl"))
ARROW_FILE = "data-00000-of-00001.arrow"
STAMP_FILE = "llmft_packing.json"
# The LLaMA-Factory arguments that decide what its packed preprocessing makes of tokenized rows,
# with LLaMA-Factory's defaults.
PACKING_KEYS = {
    "template": None,
    "cutoff_len": 2048,
    "packing": None,
    "neat_packing": False,
    "preprocessing_num_workers": None,
    "preprocessing_batch_size": 1000,
}


def packed_dir_name(pargs: dict) -> str:
    """The packed folder's name under the data folder, keyed by the packing arguments: rows packed
    for other arguments (neat vs plain, another cutoff_len) never sit where these are expected."""
    return "packed-" + hashlib.sha256(json.dumps(pargs, sort_keys=True).encode()).hexdigest()[:12]


def source_fingerprint(tokenized_dir: str | Path) -> dict | None:
    """The `datasets` fingerprints of prepare_data's tokenized splits: new with every prepare_data
    run (other rows, tokenizer or cutoff), so packed rows can name what they were packed from."""
    try:
        return {
            split: json.loads((Path(tokenized_dir) / split / "state.json").read_text())["_fingerprint"]
            for split, _ in SPLITS
        }
    except (OSError, ValueError, KeyError):
        return None


def packing_args(args: dict) -> dict | None:
    """The arguments among `args` (LLaMA-Factory's) that decide its packed rows, normalised as
    LLaMA-Factory reads them (neat_packing implies packing); None when `args` do not pack."""
    out = {key: args.get(key, default) for key, default in PACKING_KEYS.items()}
    out["neat_packing"] = bool(out["neat_packing"])
    out["packing"] = bool(out["packing"]) or out["neat_packing"]
    return out if out["packing"] else None


def map_batches(n_rows: int, num_proc: int | None, batch_size: int) -> Iterator[range]:
    """The row ranges `datasets.Dataset.map(batched=True, num_proc=...)` hands to the function."""
    if num_proc and num_proc > n_rows:
        num_proc = n_rows
    shards = num_proc or 1
    div, mod = divmod(n_rows, shards)
    for index in range(shards):
        start = div * index + min(index, mod)
        end = start + div + (1 if index < mod else 0)
        for first in range(start, end, batch_size):
            yield range(first, min(first + batch_size, end))


class _Known:
    """A row whose token ids are already known, standing where the processor expects messages."""

    __slots__ = ("ids", "labels")

    def __init__(self, ids: list[int], labels: list[int]):
        self.ids, self.labels = ids, labels


def _processor(tokenizer_dir: str | Path, args: dict):
    from llamafactory.data.loader import _get_dataset_processor
    from llamafactory.data.processor import PackedSupervisedDatasetProcessor
    from llamafactory.hparams import DataArguments

    class Prepacked(PackedSupervisedDatasetProcessor):
        def _encode_data_example(self, prompt, response, system, tools, images, videos, audios):
            if isinstance(prompt[0], _Known):
                return list(prompt[0].ids), list(prompt[0].labels)
            return super()._encode_data_example(prompt, response, system, tools, images, videos, audios)

    data_args = DataArguments(
        template=args["template"],
        cutoff_len=args["cutoff_len"],
        packing=args.get("packing"),
        neat_packing=bool(args.get("neat_packing")),
        preprocessing_batch_size=args.get("preprocessing_batch_size", 1000),
    )
    if not data_args.packing:
        raise ValueError("packing needs packing or neat_packing in the LLaMA-Factory arguments")
    tokenizer, template = load_tokenizer_and_template(tokenizer_dir, args["template"])
    # Called for its side effect too: with neat_packing it makes `datasets` keep int64 masks.
    _get_dataset_processor(data_args, "sft", template, tokenizer, None)
    return Prepacked(template=template, tokenizer=tokenizer, processor=None, data_args=data_args), data_args


def pack(
    tokenized_dir: str | Path, rows_dir: str | Path, out_dir: str | Path, tokenizer_dir, args: dict
) -> dict:
    """Write packed train/validation splits for LLaMA-Factory arguments `args` (template,
    cutoff_len, packing / neat_packing, preprocessing_num_workers, preprocessing_batch_size) to
    `out_dir`, atomically, with a stamp naming those arguments and the row counts."""
    stamp = packing_args(args)
    if stamp is None:
        raise ValueError("packing needs packing or neat_packing in the LLaMA-Factory arguments")
    source = source_fingerprint(tokenized_dir)
    with atomic_path(out_dir, directory=True) as tmp:
        counts = _pack(Path(tokenized_dir), Path(rows_dir), tmp, tokenizer_dir, args)
        record = {"args": stamp, "rows": counts, "source": source}
        (tmp / STAMP_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return counts


def ensure_packed(lf_args: dict, data_dir: str | Path, tokenizer_dir, stamp_out: str | Path) -> dict:
    """What pack_data does for a rendered YAML: pack its rows unless rows packed for the same
    arguments from the same tokenized rows are already there, then record which in `stamp_out`.

    The YAML is re-rendered for any sft change (a learning rate), so the packed folder, named by
    the packing arguments alone, is reused rather than repacked; `stamp_out` is the rule's output.
    A YAML that does not load pack_data's rows gets a stamp saying so and nothing is packed.
    """
    from llmft.core.io import write_json

    data_dir = Path(data_dir)
    want = packing_args(lf_args)
    path = data_dir / packed_dir_name(want) if want else None
    if want is None or lf_args.get("tokenized_path") != str(path):
        record = {"packed": False, "why": "the rendered YAML does not load packed rows"}
        write_json(stamp_out, record)
        return record
    tokenized = data_dir / "tokenized"
    stamp = path / STAMP_FILE
    current = json.loads(stamp.read_text()) if stamp.is_file() else None
    reused = bool(
        current and current.get("args") == want and current.get("source") == source_fingerprint(tokenized)
    )
    if not reused:
        pack(tokenized, data_dir, path, tokenizer_dir, lf_args)
        current = json.loads(stamp.read_text())
    record = {"packed": True, "path": str(path), "reused": reused, **current}
    write_json(stamp_out, record)
    return record


def prune(out_dir: str | Path) -> list[str]:
    """Remove packed folders for other arguments beside `out_dir` (a config change left them)."""
    import shutil

    out_dir = Path(out_dir)
    gone = []
    for other in sorted(out_dir.parent.glob("packed-*")):
        if other.name != out_dir.name and other.is_dir() and (other / STAMP_FILE).is_file():
            shutil.rmtree(other)
            gone.append(other.name)
    return gone


def _pack(tokenized_dir: Path, rows_dir: Path, out_dir: Path, tokenizer_dir, args: dict) -> dict:
    from datasets import Dataset, load_from_disk
    from datasets.arrow_writer import ArrowWriter

    processor, data_args = _processor(tokenizer_dir, args)
    source = load_from_disk(str(tokenized_dir))
    counts = {}
    for split, jsonl in SPLITS:
        ds = source[split].select_columns(["input_ids", "labels"])
        folder = out_dir / split
        folder.mkdir(parents=True, exist_ok=True)
        # No features given: types are inferred per column as datasets.map infers them.
        writer = ArrowWriter(path=str(folder / ARROW_FILE))
        with open(rows_dir / jsonl, encoding="utf-8") as lines:
            for rows in map_batches(
                len(ds), args.get("preprocessing_num_workers"), data_args.preprocessing_batch_size
            ):
                part = ds[rows.start : rows.stop]
                batch = {
                    k: []
                    for k in ("_prompt", "_response", "_system", "_tools", "_images", "_videos", "_audios")
                }
                for ids, labels in zip(part["input_ids"], part["labels"], strict=True):
                    line = next(lines)
                    if len(ids) > data_args.cutoff_len:  # LLaMA-Factory truncates this one: its own way
                        row = json.loads(line)
                        prompt, response = conversation.split(row)
                        system, tools = conversation.system(row), conversation.tools(row)
                    else:
                        prompt, response, system, tools = [_Known(ids, labels)], [None], "", ""
                    for key, value in (
                        ("_prompt", prompt),
                        ("_response", response),
                        ("_system", system),
                        ("_tools", tools),
                    ):
                        batch[key].append(value)
                    for key in ("_images", "_videos", "_audios"):
                        batch[key].append(None)
                out = processor.preprocess_dataset(batch)
                if out:
                    writer.write_batch(dict(out))
        counts[split], _ = writer.finalize()
        writer.close()
        _write_metadata(Dataset.from_file(str(folder / ARROW_FILE)), folder)
    write_dataset_dict(out_dir, [s for s, _ in SPLITS])
    return counts


def _write_metadata(ds, folder: Path) -> None:
    """state.json and dataset_info.json as Dataset.save_to_disk writes them."""
    state = {
        "_data_files": [{"filename": ARROW_FILE}],
        "_fingerprint": ds._fingerprint,
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (folder / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    info = asdict(ds.info)
    (folder / "dataset_info.json").write_text(json.dumps({k: info[k] for k in sorted(info)}, indent=2))
