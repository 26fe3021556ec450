"""The preference stage (DPO, ORPO, SimPO, KTO) as sft's machinery sees it: a view of the config whose
`sft` section holds the preference stage's settings, and the training objective (llmft.core.objective)
sft's planner and renderer take with it: two sequences a row, the reference model, the logits a
preference loss keeps, length grouping, the padding-free forward, LLaMA-Factory's preference
arguments. The planner, the renderer and sft's check / launch / finalize steps take the view as they
take sft's own config; nothing of theirs is copied here.

Starting point: `start_from: sft` trains the sft run's published model (after LoRA sft that is the
base with sft's adapter merged in). A LoRA preference stage trains a new adapter on it rather than
continuing sft's adapter: LLaMA-Factory's reference for LoRA is the policy with its adapter disabled,
which is then exactly the sft model, the reference the DPO recipe asks for (continuing sft's adapter
would make the reference the base model, before sft).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from llmft.core.config import BUILTIN_MODEL, ConfigError
from llmft.core.objective import Objective, StageTraining
from llmft.core.platform import Platform
from llmft.core.settings import Config

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
# The run's reference record (the preference_reference step's output), which the training worker reads
# when the reference's log-probabilities are cached (llmft.preference.refpatch).
REFERENCE_RECORD = "results/{run}/preference/reference/reference.json"
# The sft keys the preference stage sets itself.
OWN_KEYS = (
    "num_train_epochs",
    "max_steps",
    "warmup_ratio",
    "lr_scheduler_type",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
)


def finetuning_type(cfg: Config) -> str:
    kind = cfg.preference.finetuning_type
    return cfg.sft.finetuning_type if kind == "auto" else kind


def learning_rate(cfg: Config) -> float:
    lr = cfg.preference.learning_rate
    if lr != "auto":
        return lr
    return TINY_LR if cfg.model.name_or_path == BUILTIN_MODEL else AUTO_LR[finetuning_type(cfg)]


def reference(cfg: Config) -> str:
    """none | start (the starting model) | base (model.name_or_path)."""
    pref = cfg.preference
    if not pref.uses_reference:
        return "none"
    ref = "start" if pref.reference == "auto" else pref.reference
    # From base, the base is the starting model.
    return "start" if ref == "base" and pref.start_from == "base" else ref


def reference_weights(cfg: Config) -> str:
    """What the reference model adds to a GPU: none (no reference, or LoRA's adapter-free policy, the
    same weights) or copy (a frozen second set of weights, forward only)."""
    ref = reference(cfg)
    if ref == "none" or (ref == "start" and finetuning_type(cfg) == "lora"):
        return "none"
    return "copy"


def view(cfg: Config) -> Config:
    """cfg with `sft` replaced by the preference stage's training settings: sft's hardware and
    batch-planning keys, the stage's own schedule, rate and finetuning type. Preference rows are not
    packed (LLaMA-Factory's pairwise and KTO data are row by row); a row is at most
    preference.data.cutoff_len tokens a side, so that is the sequence length the planner sizes."""
    pref = cfg.preference
    kind = finetuning_type(cfg)
    own = {k: getattr(pref, k) for k in OWN_KEYS}
    own.update(finetuning_type=kind, learning_rate=learning_rate(cfg), packing="off")
    if kind != "lora":
        own["quantization_bit"] = "none"
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, cutoff_len=pref.data.cutoff_len),
        sft=dataclasses.replace(cfg.sft, **own),
    )


def llamafactory_args(cfg: Config, ref_model: str | None) -> dict:
    """LLaMA-Factory's preference arguments (stage, loss, beta, reference)."""
    pref = cfg.preference
    args: dict = {"stage": pref.method, "pref_beta": pref.beta}
    if pref.method == "dpo":
        args.update(pref_loss=pref.loss, pref_ftx=pref.ftx)
        if pref.loss == "simpo":
            args["simpo_gamma"] = pref.simpo_gamma
    else:
        args.update(
            kto_chosen_weight=pref.kto_desirable_weight,
            kto_rejected_weight=pref.kto_undesirable_weight,
        )
    if reference(cfg) == "base" and ref_model and reference_logps(cfg)[0] != "cached":
        args["ref_model"] = ref_model
    return args


def sequences_per_row(cfg: Config) -> int:
    """Sequences one training row puts through the model: a pair's chosen and rejected answers in one
    batch (LLaMA-Factory's PairwiseDataCollatorWithPadding); a KTO row and its mismatched KL row."""
    return 2


def sampler_args(grouped: bool) -> dict:
    """LLaMA-Factory's (transformers') sampler arguments of a plan that batches pairs by length."""
    if not grouped:
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


def check_data(objective: Objective, data_dir: str) -> None:
    """A plan that batches pairs by length (preference.group_by_length: true; auto leaves it off)
    needs their lengths in the tokenized data: without them transformers' sampler stops the job at
    its start, as it does under plain LLaMA-Factory. Refused by name before the job."""
    from llmft.core.lf.pretokenize import TOKENIZED_DIR

    if not objective.group_by_length or pairs_have_lengths(data_dir):
        return
    raise ConfigError(
        f"config key preference.group_by_length: true, but {data_dir}/{TOKENIZED_DIR} holds no pair "
        f"lengths (column {LENGTH_COLUMN!r}, which prepare_preference writes); rerun prepare_preference "
        "or set the key to auto"
    )


def reference_logps(cfg: Config) -> tuple[str, str]:
    """(none | resident | cached, why): where the reference's log-probabilities come from
    (preference.reference_logps), decided from the config alone, as the DAG holds the reference step
    or not. `auto`: cached on GPUs, where it saves the reference's weights (full/freeze) and its
    forward pass in every step; resident on CPU processes."""
    setting = cfg.preference.reference_logps
    if reference(cfg) == "none":
        why = "" if setting == "auto" else (
            f"reference_logps {setting} ignored: preference.loss {cfg.preference.loss} has no "
            "reference model"
        )  # fmt: skip
        return "none", why
    quantized = finetuning_type(cfg) == "lora" and cfg.sft.quantization_bit != "none"
    if setting == "cached":
        return "cached", (
            "reference_logps cached: the reference step's log-probabilities of every sequence "
            "(results/cache/reference/), no reference model loaded or run in training"
            + ("; the reference is the unquantized model, not the quantized base" if quantized else "")
        )
    if setting == "resident":
        return "resident", ""
    if quantized:
        return "resident", (
            f"reference_logps auto -> resident: sft.quantization_bit {cfg.sft.quantization_bit}, "
            "so the resident reference is the quantized base (no extra weights); the reference step "
            "would score the unquantized model"
        )
    if cfg.hardware.on_cpu:
        return "resident", (
            "reference_logps auto -> resident: CPU processes, where the reference's forward in each "
            "step costs less than a job of its own (model load, process start); cached skips it"
        )
    saves = "its frozen weights on each GPU and " if reference_weights(cfg) == "copy" else ""
    return "cached", (
        f"reference_logps auto -> cached: training holds no reference model ({saves}its forward pass "
        "over every token in each step); the reference step runs it once over every sequence, and "
        "later runs with the same reference model reuse its log-probabilities"
    )


def planned_reference(cfg: Config) -> str:
    """The reference model's weights on each GPU as the planner costs them: none, forward (LoRA: the
    policy's own weights with the adapter disabled), copy, or cached (read from the reference step)."""
    if reference_logps(cfg)[0] == "cached":
        return "cached"
    ref = reference_weights(cfg)
    if ref == "none" and reference(cfg) != "none":
        ref = "forward"
    return ref


def length_grouping(cfg: Config) -> tuple[bool, str]:
    """preference.group_by_length for a dpo stage's view, with the reason for what `auto` chose."""
    if cfg.preference.method != "dpo":
        return False, ""
    setting = cfg.preference.group_by_length
    if setting != "auto":
        return bool(setting), ""
    return False, (
        "group_by_length auto -> off: on one H200 (1.24 B DPO) the plan with it measured 1.12x a "
        "hand-tuned LLaMA-Factory DPO, against 1.19x without it in an earlier call (never compared in "
        "one call); preference.group_by_length: true batches pairs of similar length"
    )


def padding_free(cfg: Config, platform: Platform) -> tuple[bool, str]:
    """preference.padding_free for a dpo stage's view, with the reason for what was chosen: the pairs
    of a micro-batch as one row through varlen attention, log-probabilities without full logits."""
    if cfg.preference.method != "dpo":
        return False, ""
    setting = cfg.preference.padding_free
    fp32 = platform.on_gpu and cfg.sft.precision == "fp32"  # no FlashAttention kernel in fp32
    kernel = not platform.on_gpu or "varlen" in platform.attention
    where = "torch's varlen kernel" if platform.on_gpu else "per-pair SDPA on the CPU"
    if setting is True:
        if fp32:
            raise ConfigError(
                "config key preference.padding_free: true needs torch's varlen attention, which "
                "computes in fp16/bf16 only, and sft.precision is fp32: set sft.precision: bf16 or "
                "preference.padding_free: auto"
            )
        if not kernel:
            raise ConfigError(
                "config key preference.padding_free: true needs torch's varlen attention "
                "(torch.nn.attention.varlen), which no node ran (verify_env's attention finding); "
                "set it to auto or false"
            )
        return (
            True,
            f"padding_free on: the pairs of a micro-batch as one row ({where}), chunked log-probabilities",
        )
    if setting is False:
        return False, ""
    if cfg.sft.flash_attn != "auto":
        return False, f"padding_free auto -> off: sft.flash_attn is set to {cfg.sft.flash_attn!r}"
    if fp32:
        return False, "padding_free auto -> off: sft.precision is fp32 (varlen attention is fp16/bf16 only)"
    if not kernel:
        return False, "padding_free auto -> off: no node ran torch's varlen attention"
    return True, (
        f"padding_free auto -> on: the pairs of a micro-batch as one row without padding ({where}); "
        "log-probabilities a chunk of tokens at a time, never the whole batch's fp32 logits"
    )


def objective(view_cfg: Config, platform: Platform, ref_model: str | None = None) -> Objective:
    """The preference stage's training objective for sft's planner and renderer, from its config view
    (`view`) on `platform`: a pair's (or a KTO row's) two sequences, its reference model, the logits
    its loss keeps, length grouping and the padding-free forward (each with why), LLaMA-Factory's
    preference arguments (`ref_model`: the reference's folder when it is not the starting model)."""
    seqs, ref = sequences_per_row(view_cfg), planned_reference(view_cfg)
    grouped, grouped_why = length_grouping(view_cfg)
    free, free_why = padding_free(view_cfg, platform)
    cached, cached_why = reference_logps(view_cfg)
    method = view_cfg.preference.method
    tips = (
        "preference.reference_logps: cached (its log-probabilities from a step before training, no copy)",
        "preference.finetuning_type: lora (its reference is the adapter-free model, no copy)",
    )
    worker = {"reference_logps": REFERENCE_RECORD.format(run=view_cfg.run)} if cached == "cached" else {}
    return Objective(
        name="preference",
        what=f"the preference stage ({method}: {seqs} sequences per row, reference model {ref})",
        announce=f"preference stage: {method}, reference model {reference(view_cfg)}"
        + (" (log-probabilities cached by the reference step)" if cached == "cached" else ""),
        sequences_per_row=seqs,
        reference=ref,
        logits=seqs > 1,
        group_by_length=grouped,
        padding_free=free,
        reasons=tuple(why for why in (grouped_why, free_why, cached_why) if why),
        tips=tips if ref == "copy" else (),
        datasets=(TRAIN_DATASET, HELDOUT_DATASET),
        trainer_args={**llamafactory_args(view_cfg, ref_model), **sampler_args(grouped)},
        packs_rows=False,
        continues=False,
        worker=worker,
    )


def training(cfg: Config, ref_model: str | None = None) -> StageTraining:
    """The preference stage as sft's planner and renderer take it: its config view, its objective on a
    platform (`ref_model`: the reference's folder when it is not the starting model) and its data
    check."""
    if cfg.preference is None:
        raise ConfigError("config key preference: not set, so there is no preference stage to plan or render")
    staged = view(cfg)
    return StageTraining(staged, lambda platform: objective(staged, platform, ref_model), check_data)
