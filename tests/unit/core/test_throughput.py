"""llmft.core.throughput: the run's one throughput figure, over the last attempt's measured steps."""

import pytest
from llmft.core.throughput import measured_throughput
from llmft.sft.publish import attempts_summary


def _attempt(start: int, started: float, steps: range, seconds_per_step: float, tokens_per_step: int):
    out = [{"attempt_start": start, "started": started, "tokens": tokens_per_step * start}]
    for i, s in enumerate(steps, 1):
        out.append({"step": s, "time": started + i * seconds_per_step, "tokens": tokens_per_step * s})
        out.append({"step": s, "loss": 1.0 / s})  # loss lines carry no time: not steps
    return out


def test_the_last_attempt_after_its_first_quarter_less_evaluations_per_process():
    # attempt 1: steps 1-12 at 1 s each, killed; attempt 2 resumed from 10: steps 11-30, 2 s each
    records = _attempt(0, 0.0, range(1, 13), 1.0, 100) + _attempt(10, 100.0, range(11, 31), 2.0, 100)
    # evaluations logged at steps 10 (before the window), 20 and 25 (inside), 30 (after the last step)
    history = [{"step": s, "eval_runtime": 3.0, "eval_loss": 0.5} for s in (10, 20, 25, 30)]
    got = attempts_summary(records, history, world=2)
    # 20 steps: the window starts at the record of index 20 // 4 = 5, step 16 (time 112), ends at
    # step 30 (time 140); 14 steps of 100 tokens in 28 s less the evaluations at 20 and 25
    assert got["throughput_steps"] == [17, 30]
    assert got["tokens_per_second_per_gpu"] == pytest.approx(1400 / (28 - 6.0) / 2, abs=0.05)
    assert "tokens_per_second" not in got  # the one figure, under one name
    assert (got["resumed_from_step"], got["steps_trained"], got["steps_lost"]) == (10, 20, 2)


def test_an_attempt_of_one_step_is_measured_from_its_start():
    start = {"attempt_start": 7, "started": 50.0, "tokens": 700}
    got = measured_throughput([{"step": 8, "time": 54.0, "tokens": 1500}], start, [], 1)
    assert got == {"tokens_per_second_per_gpu": 200.0, "throughput_steps": [8, 8]}


def test_no_time_left_after_the_evaluations_is_no_figure():
    steps = [{"step": s, "time": float(s), "tokens": 10 * s} for s in (1, 2, 3)]
    got = measured_throughput(
        steps, {"attempt_start": 0, "started": 0.0}, [{"step": 1, "eval_runtime": 5.0}], 1
    )
    assert got == {"tokens_per_second_per_gpu": None, "throughput_steps": [2, 3]}
