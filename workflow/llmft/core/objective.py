"""A training stage's objective as sft's planner and renderer take it: what sequences one row puts
through the model, whether a reference model is resident beside the policy, which logits the loss
keeps, and what LLaMA-Factory is told to train. sft's own objective is SFT; the preference stage
supplies its own (llmft.preference.stage.objective), so the planner never asks which stage it plans.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llmft.core.platform import Platform
from llmft.core.settings import Config

# A padding-free forward (llmft.preference.padfree) runs the output layer this many tokens at a time:
# at a 128 k vocabulary a chunk's bf16 logits, their fp32 upcast and its gradient are ~1.3 GiB (against
# ~8 GiB per 16 k tokens when all are materialised). The planner costs one such chunk.
PADFREE_CHUNK = 1024


@dataclass(frozen=True)
class Objective:
    """What one training step of a stage holds and how it is rendered; the defaults are sft's."""

    # the work folder's prefix (<prefix>-<config hash>) and the stage's name in the render log
    name: str = "sft"
    # how a plan that does not fit names the stage
    what: str = "sft"
    # the render log's line on what trains (its learning rate follows); "" for sft
    announce: str = ""
    # sequences one row puts through the model in one batch (a preference pair's chosen and rejected)
    sequences_per_row: int = 1
    # the reference model's weights on each GPU: none | forward (the policy with its adapter off) | copy
    # | cached (its log-probabilities read from a step before training: no weights, no forward)
    reference: str = "none"
    # the loss needs the logits themselves (log-probabilities of every answer token): Liger's fused
    # loss saves nothing there, and LLaMA-Factory's padded forward keeps more per token
    logits: bool = False
    # batches of rows of similar length (transformers' length-grouped sampler)
    group_by_length: bool = False
    # rows of a micro-batch as one row without padding, log-probabilities a chunk at a time
    padding_free: bool = False
    # why the objective's settings are what they are, in the plan's reasons after the kernel's
    reasons: tuple[str, ...] = ()
    # keys to change, first in a plan's refusal
    tips: tuple[str, ...] = ()
    # LLaMA-Factory's dataset names of the train and held-out split (the data stage's dataset_info.json)
    datasets: tuple[str, str] = ("llmft_train", "llmft_heldout")
    # LLaMA-Factory arguments of the objective (stage, loss, reference), over the plan's defaults
    trainer_args: dict = field(default_factory=dict)
    # rows are packed and pre-tokenized as prepare_data / pack_data write them (sft); else LLaMA-Factory
    # loads the data stage's tokenized folder when there is one and tokenizes in the job otherwise
    packs_rows: bool = True
    # the stage trains prepare_data's rows, so a continued run's plan counts its cost against a retrain
    continues: bool = True
    # keys of the rendered YAML's `llmft:` block for the objective's trainer patches (llmft.worker)
    worker: dict = field(default_factory=dict)

    @property
    def in_plan(self) -> bool:
        """Whether the plan says what its rows hold: sft's plan reads as it did before other objectives."""
        return self.sequences_per_row > 1


SFT = Objective()


@dataclass(frozen=True)
class StageTraining:
    """A training stage as sft's planner and renderer take it: its config view (whose `sft` section
    holds the stage's training settings), its objective on a platform, and the check of its data
    against the planned objective (None: nothing to check)."""

    cfg: Config
    objective_for: Callable[[Platform], Objective]
    check_data: Callable[[Objective, str], None] | None = None


def sft_objective(platform: Platform) -> Objective:
    """sft's objective, the same on every platform."""
    return SFT
