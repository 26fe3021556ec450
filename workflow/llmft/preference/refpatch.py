"""DPO and KTO without a resident reference model: LLaMA-Factory's trainers read the reference step's
log-probabilities (llmft.preference.reference) instead of running the reference model.

`install(record)` (the training worker, before run_exp, when the rendered YAML's `llmft:` block names
the run's reference record):
- `create_ref_model`, as LLaMA-Factory's dpo and kto workflows call it, returns None: no reference
  weights are loaded, prepared by DeepSpeed or kept on a GPU;
- `CustomDPOTrainer.compute_reference_log_probs` and `CustomKTOTrainer.compute_reference_log_probs`
  return the cached value of each sequence of the batch, looked up by its fingerprint (its real
  tokens and label mask: reference.sequence_key), so no row ids are needed and any sampler, padding
  or batch size finds the same values. A sequence the record does not hold stops the step by name.

The loss, its metrics and gradients are LLaMA-Factory's own: only where the reference values come
from changes (tests/unit/preference/test_refpatch.py compares both on one batch).
"""

from __future__ import annotations

import logging

import torch
from llmft.preference.reference import ReferenceError, sequence_key

log = logging.getLogger("llmft.preference.refpatch")


class CachedReference:
    """Reference log-probabilities by sequence fingerprint (reference.load_record's mapping)."""

    def __init__(self, values: dict[str, float], source: str = ""):
        self.values, self.source = values, source

    def lookup(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor):
        """Each row's cached reference log-probability (float32, on the batch's device)."""
        keep = attention_mask.bool().cpu()
        ids, lab = input_ids.cpu(), labels.cpu()
        out = []
        for r in range(ids.shape[0]):
            row_ids, row_labels = ids[r][keep[r]].numpy(), lab[r][keep[r]].numpy()
            key = sequence_key(row_ids, row_labels)
            if key not in self.values:
                raise ReferenceError(
                    f"reference log-probabilities {self.source}: no value for a sequence of {len(row_ids)} "
                    f"tokens (fingerprint {key}); the tokenized pairs changed since the reference step: "
                    "rerun it"
                )
            out.append(self.values[key])
        return torch.tensor(out, dtype=torch.float32, device=input_ids.device)


def dpo_reference(self, model, batch: dict):
    """CustomDPOTrainer.compute_reference_log_probs from the cache: (chosen, rejected) per pair."""
    cache = getattr(self, "_llmft_reference", None)
    if cache is None:
        return self._llmft_resident_reference(model, batch)
    if not self.finetuning_args.use_ref_model:
        return None, None
    values = cache.lookup(batch["input_ids"], batch["attention_mask"], batch["labels"])
    half = values.shape[0] // 2
    return values[:half], values[half:]


def kto_reference(self, model, batch: dict):
    """CustomKTOTrainer.compute_reference_log_probs from the cache: (desirable rows, undesirable rows,
    KL rows)."""
    cache = getattr(self, "_llmft_reference", None)
    if cache is None:
        return self._llmft_resident_reference(model, batch)
    target = cache.lookup(batch["input_ids"], batch["attention_mask"], batch["labels"])
    kl = cache.lookup(batch["kl_input_ids"], batch["kl_attention_mask"], batch["kl_labels"])
    tags = batch["kto_tags"].to(target.device).bool()
    return target[tags], target[~tags], kl


def no_ref_model(model_args, finetuning_args, add_valuehead: bool = False):
    """create_ref_model when the reference's log-probabilities are cached: none is loaded."""
    log.info("reference model: not loaded, its log-probabilities are read from the reference step")
    return None


def patch_trainers() -> None:
    """Give both trainers the cache-aware compute_reference_log_probs (a trainer without a cache
    attached keeps LLaMA-Factory's own)."""
    from llamafactory.train.dpo.trainer import CustomDPOTrainer
    from llamafactory.train.kto.trainer import CustomKTOTrainer

    for cls, method in ((CustomDPOTrainer, dpo_reference), (CustomKTOTrainer, kto_reference)):
        if not getattr(cls, "_llmft_refpatch", False):
            cls._llmft_resident_reference = cls.compute_reference_log_probs
            cls.compute_reference_log_probs = method
            cls._llmft_refpatch = True


def install(record: str) -> None:
    """Train against the reference log-probabilities of the run's reference record `record`
    (checked: a stale or foreign cache is refused by name before training starts)."""
    from llamafactory.train.dpo import workflow as dpo_workflow
    from llamafactory.train.dpo.trainer import CustomDPOTrainer
    from llamafactory.train.kto import workflow as kto_workflow
    from llamafactory.train.kto.trainer import CustomKTOTrainer
    from llmft.preference.reference import load_record

    cache = CachedReference(load_record(record), source=str(record))
    patch_trainers()
    CustomDPOTrainer._llmft_reference = cache
    CustomKTOTrainer._llmft_reference = cache
    dpo_workflow.create_ref_model = no_ref_model
    kto_workflow.create_ref_model = no_ref_model
    log.info("reference: %d cached log-probabilities from %s, no reference model", len(cache.values), record)
