"""The run's one throughput figure: tokens/s per GPU over the measured steps of the last attempt.
sft writes it to train_summary.json (llmft.sft.publish), the report copies it to summary.json and
the run page, whose MFU is computed from it; the trend page and bench/ read summary.json's."""

from __future__ import annotations

# The run page's label of the figure (per process on CPU), with the steps it measured.
THROUGHPUT_FORMULA = (
    "tokens/s per GPU = (T_b - T_a) / (t_b - t_a - E) / world size, steps a+1..b: the last attempt's "
    "after its first quarter; T, t: tokens (all processes) and time at a step's end; E: evaluation seconds"
)


def measured_throughput(steps: list[dict], start: dict, history: list[dict], world: int) -> dict:
    """Tokens/s per GPU over the measured steps of one attempt: its step records (llmft_steps.jsonl,
    `tokens` summed over all processes at the end of each optimizer step), its start record, and
    the trainer's log history (for the evaluations that ran between steps).

        tokens_per_second_per_gpu = (tokens[b] - tokens[a]) / (time[b] - time[a] - eval_s) / world

    b is the attempt's last step; a is the step record at index n // 4 of its n steps (the first
    quarter is warm-up: compilation, the allocator's first shapes), or the attempt's start when it
    trained one step. The measured steps are a+1 .. b. eval_s is the `eval_runtime` of evaluations
    logged at steps a .. b-1: one logged at step s runs after step s ends, before step s+1 does."""
    b = steps[-1]
    if len(steps) > 1:
        a = steps[len(steps) // 4]
    else:
        a = {"step": start["attempt_start"], "time": start["started"], "tokens": start.get("tokens") or 0}
    eval_s = sum(
        h["eval_runtime"] for h in history if "eval_runtime" in h and a["step"] <= h["step"] < b["step"]
    )
    seconds = b["time"] - a["time"] - eval_s
    rate = (b["tokens"] - a["tokens"]) / seconds / world if seconds > 0 else None
    return {
        "tokens_per_second_per_gpu": round(rate, 1) if rate is not None else None,
        "throughput_steps": [a["step"] + 1, b["step"]],
    }
