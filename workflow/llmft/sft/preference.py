"""The preference stage (DPO, ORPO, SimPO, KTO) as sft's machinery sees it: a view of the config whose
`sft` section holds the preference stage's settings, the reference model, and LLaMA-Factory's
preference arguments. The planner, the renderer and sft's check / launch / finalize steps take it as
they take sft's own config; nothing of theirs is copied here.

Starting point: `start_from: sft` trains the sft run's published model (after LoRA sft that is the
base with sft's adapter merged in). A LoRA preference stage trains a new adapter on it rather than
continuing sft's adapter: LLaMA-Factory's reference for LoRA is the policy with its adapter disabled,
which is then exactly the sft model, the reference the DPO recipe asks for (continuing sft's adapter
would make the reference the base model, before sft).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from llmft.core.config import BUILTIN_MODEL, ConfigError, uses_reference

# The column prepare_preference adds to the tokenized pairs: each pair's longer side (prompt + answer)
# in tokens, the width a micro-batch holding it is padded to; transformers' length-grouped sampler
# reads it (its default length_column_name), LLaMA-Factory's pairwise collator ignores it.
LENGTH_COLUMN = "length"

# LLaMA-Factory's dataset names of the preference split (prepare_preference's dataset_info.json).
TRAIN_DATASET = "llmft_pref_train"
HELDOUT_DATASET = "llmft_pref_heldout"
# Peak learning rates of `learning_rate: auto`: full/freeze DPO recipes (Zephyr, Tulu 2) train at
# 5e-7; LoRA moves only its adapters and trains 10x higher.
AUTO_LR = {"full": 5e-7, "freeze": 5e-7, "lora": 5e-6}
# builtin:tiny, the demo's random-init model, does not move at those rates: at 5e-7 the demo's DPO
# loss moved 0.09 % and its held-out likelihood accuracy not at all; at 1e-3 (sft's demo rate), in
# the same 11 steps, likelihood accuracy went 0.24 -> 0.83.
TINY_LR = 1e-3
# The sft keys the preference stage sets itself.
OWN_KEYS = (
    "num_train_epochs",
    "max_steps",
    "warmup_ratio",
    "lr_scheduler_type",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
)


def finetuning_type(cfg: dict) -> str:
    kind = cfg["preference"]["finetuning_type"]
    return cfg["sft"]["finetuning_type"] if kind == "auto" else kind


def learning_rate(cfg: dict) -> float:
    lr = cfg["preference"]["learning_rate"]
    if lr != "auto":
        return lr
    return TINY_LR if cfg["model"]["name_or_path"] == BUILTIN_MODEL else AUTO_LR[finetuning_type(cfg)]


def reference(cfg: dict) -> str:
    """none | start (the starting model) | base (model.name_or_path)."""
    pref = cfg["preference"]
    if not uses_reference(pref):
        return "none"
    ref = "start" if pref["reference"] == "auto" else pref["reference"]
    # From base, the base is the starting model.
    return "start" if ref == "base" and pref["start_from"] == "base" else ref


def reference_weights(cfg: dict) -> str:
    """What the reference model adds to a GPU: none (no reference, or LoRA's adapter-free policy, the
    same weights) or copy (a frozen second set of weights, forward only)."""
    ref = reference(cfg)
    if ref == "none" or (ref == "start" and finetuning_type(cfg) == "lora"):
        return "none"
    return "copy"


def view(cfg: dict) -> dict:
    """cfg with `sft` replaced by the preference stage's training settings: sft's hardware and
    batch-planning keys, the stage's own schedule, rate and finetuning type. Preference rows are not
    packed (LLaMA-Factory's pairwise and KTO data are row by row); a row is at most
    preference.data.cutoff_len tokens a side, so that is the sequence length the planner sizes."""
    out = copy.deepcopy(cfg)
    out["data"]["cutoff_len"] = cfg["preference"]["data"]["cutoff_len"]
    pref, sft = cfg["preference"], out["sft"]
    kind = finetuning_type(cfg)
    sft.update({k: pref[k] for k in OWN_KEYS})
    sft["finetuning_type"] = kind
    sft["learning_rate"] = learning_rate(cfg)
    sft["packing"] = "off"
    if kind != "lora":
        sft["quantization_bit"] = "none"
    out["stage"] = pref["method"]
    return out


def llamafactory_args(cfg: dict, ref_model: str | None) -> dict:
    """LLaMA-Factory's preference arguments (stage, loss, beta, reference)."""
    pref = cfg["preference"]
    args: dict = {"stage": pref["method"], "pref_beta": pref["beta"]}
    if pref["method"] == "dpo":
        args.update(pref_loss=pref["loss"], pref_ftx=pref["ftx"])
        if pref["loss"] == "simpo":
            args["simpo_gamma"] = pref["simpo_gamma"]
    else:
        args.update(
            kto_chosen_weight=pref["kto_desirable_weight"],
            kto_rejected_weight=pref["kto_undesirable_weight"],
        )
    if reference(cfg) == "base" and ref_model:
        args["ref_model"] = ref_model
    return args


def sequences_per_row(cfg: dict) -> int:
    """Sequences one training row puts through the model: a pair's chosen and rejected answers in one
    batch (LLaMA-Factory's PairwiseDataCollatorWithPadding); a KTO row and its mismatched KL row."""
    return 2


def sampler_args(plan) -> dict:
    """LLaMA-Factory's (transformers') sampler arguments of a plan that batches pairs by length."""
    if not plan.group_by_length:
        return {}
    return {"train_sampling_strategy": "group_by_length", "length_column_name": LENGTH_COLUMN}


def pairs_have_lengths(data_dir: str) -> bool:
    """Whether both splits of the tokenized pairs in data_dir hold LENGTH_COLUMN (prepare_preference
    writes it; the sampler needs it in the held-out split too, for LLaMA-Factory's evaluation)."""
    from llmft.core.lf.pretokenize import TOKENIZED_DIR

    for split in ("train", "validation"):
        info = Path(data_dir) / TOKENIZED_DIR / split / "dataset_info.json"
        try:
            if LENGTH_COLUMN not in json.loads(info.read_text())["features"]:
                return False
        except (OSError, ValueError, KeyError, TypeError):
            return False
    return True


def settle_grouping(cfg: dict, plan, data_dir: str) -> None:
    """A plan that batches pairs by length (preference.group_by_length: true; auto leaves it off)
    needs their lengths in the tokenized data: without them transformers' sampler stops the job at
    its start, as it does under plain LLaMA-Factory. Refused by name before the job."""
    from llmft.core.lf.pretokenize import TOKENIZED_DIR

    if not plan.group_by_length or pairs_have_lengths(data_dir):
        return
    raise ConfigError(
        f"config key preference.group_by_length: true, but {data_dir}/{TOKENIZED_DIR} holds no pair "
        f"lengths (column {LENGTH_COLUMN!r}, which prepare_preference writes); rerun prepare_preference "
        "or set the key to auto"
    )
