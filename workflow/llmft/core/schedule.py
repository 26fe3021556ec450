"""`sft.lr_scheduler_type: warmup_stable_decay` with its decay as a share of the run's steps.

transformers' warmup-stable-decay schedule (a linear warm-up, a constant learning rate, then a cosine
decay to zero) takes its phases in optimizer steps, which a run learns only once its rows are packed
and batched. LLaMA-Factory fills them in itself: a third of the steps after the warm-up held at the
peak, the other two thirds decaying. `sft.decay_ratio` gives the decay as a share of all the steps
instead, like `sft.warmup_ratio`; the launcher (llmft.sft.train) turns it into steps when the trainer
creates its schedule, from the same step count the trainer plans with. A config that gives
`num_decay_steps` or `num_stable_steps` in `sft.extra.lr_scheduler_kwargs` keeps LLaMA-Factory's
handling (render sends no ratio).
"""

from __future__ import annotations

WSD = "warmup_stable_decay"
# schedules whose transformers function refuses to start without min_lr or min_lr_rate in
# lr_scheduler_kwargs
NEEDS_MIN_LR = ("cosine_with_min_lr", "cosine_warmup_with_min_lr")
# warmup_stable_decay's phases in steps, as a config may give them (then sft.decay_ratio is not read)
STEP_KEYS = {"num_decay_steps", "num_stable_steps"}


def reads_ratio(kind: str, kwargs: dict | None) -> bool:
    """Whether a schedule takes its decay from sft.decay_ratio: warmup_stable_decay whose phases the
    config does not give in steps (lr_scheduler_kwargs)."""
    return kind == WSD and not STEP_KEYS & set(kwargs or {})


def decay_steps(ratio: float, total: int) -> int:
    """The optimizer steps of the final decay: `ratio` of `total`, at least one."""
    return max(1, round(ratio * total))


def install(ratio: float) -> None:
    """Make transformers' warmup_stable_decay schedule decay over `ratio` of the steps the trainer
    plans (num_training_steps) and hold the peak from the warm-up's end until then, replacing the
    phases LLaMA-Factory filled in."""
    from transformers import optimization
    from transformers.trainer_utils import SchedulerType

    table = optimization.TYPE_TO_SCHEDULER_FUNCTION
    original = table[SchedulerType.WARMUP_STABLE_DECAY]
    original = getattr(original, "llmft_original", original)

    def wsd(optimizer, num_warmup_steps, num_training_steps=None, **kwargs):
        kwargs.pop("num_stable_steps", None)
        kwargs["num_decay_steps"] = decay_steps(ratio, num_training_steps)
        return original(
            optimizer, num_warmup_steps=num_warmup_steps, num_training_steps=num_training_steps, **kwargs
        )

    wsd.llmft_original = original
    table[SchedulerType.WARMUP_STABLE_DECAY] = wsd
