"""LLaMA-Factory's own preprocessing, as reference for the tests that compare our tokenization with
it row by row: its dataset converters (alpaca, sharegpt) and its SFT processor, called directly
(without `datasets`' map, so a test can run it on many tokenizers in one process)."""

from __future__ import annotations

ALIGNED = ("_prompt", "_response", "_system", "_tools", "_images", "_videos", "_audios")


def aligned_from_canonical(rows: list[dict]) -> list[dict]:
    """What LLaMA-Factory's converter makes of our canonical rows (conversation.py's reading)."""
    from llmft.core import conversation

    out = []
    for row in rows:
        msgs = conversation.messages(row)
        out.append(
            {
                "_prompt": msgs[:-1],
                "_response": msgs[-1:],
                "_system": conversation.system(row),
                "_tools": conversation.tools(row),
                "_images": None,
                "_videos": None,
                "_audios": None,
            }
        )
    return out


def dataset_attr(formatting: str, columns: dict | None = None, tags: dict | None = None):
    """A DatasetAttr as LLaMA-Factory builds it from a dataset_info.json entry."""
    from llamafactory.data.parser import DatasetAttr

    attr = DatasetAttr("file", dataset_name="reference.json")
    entry: dict = {"formatting": formatting}
    if columns:
        entry["columns"] = columns
    if tags:
        entry["tags"] = tags
    attr.join(entry)
    return attr


def lf_convert(raw_rows: list[dict], attr) -> list[dict]:
    """LLaMA-Factory's converter for `attr` on raw rows. `datasets` gives every row every column of
    the file (None where a row lacks it); the rows are completed the same way."""
    from llamafactory.data.converter import get_dataset_converter
    from llamafactory.hparams import DataArguments

    converter = get_dataset_converter(attr.formatting, attr, DataArguments())
    names = {k for row in raw_rows for k in row}
    return [converter({k: row.get(k) for k in names}) for row in raw_rows]


def lf_sft(template, tokenizer, aligned: list[dict], template_name: str, processor=None) -> dict:
    """LLaMA-Factory's SupervisedDatasetProcessor on aligned examples: {"input_ids", "labels", ...}
    with one entry per example it keeps (it drops examples without a prompt/response pair);
    `processor`: a multimodal model's, which its template's plugin then sees."""
    from llamafactory.data.processor import SupervisedDatasetProcessor
    from llamafactory.hparams import DataArguments

    proc = SupervisedDatasetProcessor(
        template=template,
        tokenizer=tokenizer,
        processor=processor,
        data_args=DataArguments(template=template_name, cutoff_len=1_000_000),
    )
    batch = {k: [ex[k] for ex in aligned] for k in ALIGNED}
    return proc.preprocess_dataset(batch)


def llamafactory_preprocess(
    tmp_path,
    data_dir,
    tokenizer_dir,
    cutoff_len,
    stage="sft",
    names=("llmft_train", "llmft_heldout"),
    **extra,
):
    """LLaMA-Factory's own get_dataset (load, align, tokenize) on the datasets `names` (train,
    held-out) of `data_dir`/dataset_info.json, with the arguments our rendered YAML gives it.
    `stage`: LLaMA-Factory's data stage (sft; rm = pairwise, as its dpo stage reads data; kto)."""
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    args = {
        "model_name_or_path": str(tokenizer_dir),
        "stage": "sft" if stage == "sft" else "dpo" if stage == "rm" else stage,
        "do_train": True,
        "finetuning_type": "full",
        "dataset": names[0],
        "eval_dataset": names[1],
        "dataset_dir": str(data_dir),
        "template": "default",
        "cutoff_len": cutoff_len,
        "preprocessing_num_workers": 1,
        "output_dir": str(tmp_path / "lf_out"),
        "cache_dir": str(tmp_path / "hf_cache"),
        "overwrite_cache": True,
        "report_to": "none",
        **extra,
    }
    model_args, data_args, training_args, *_ = get_train_args(args)
    module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(module["tokenizer"], data_args)
    return get_dataset(template, model_args, data_args, training_args, stage=stage, **module)


def rows_of(enc, i):
    """Row i of an Encoded as (input_ids, labels) lists, as LLaMA-Factory's outputs hold them."""
    a, b = enc.offsets[i], enc.offsets[i + 1]
    return enc.ids[a:b].tolist(), enc.labels[a:b].tolist()
