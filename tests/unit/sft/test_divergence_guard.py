"""The divergence guard's rule on real TrainingArguments and TrainerState: a NaN stops at once, a
gradient spike stops only when the next logged loss confirms it (its own, when no step comes after
it), and a checkpoint saved since a confirmed spike is moved aside. The same through the real
launcher on real spikes: tests/workflow/test_divergence_guard_run.py."""

import json

import pytest
from llmft.sft.callbacks import Diverged, DivergenceGuard
from llmft.sft.faults import checkpoints
from transformers import TrainerControl, TrainerState, TrainingArguments


@pytest.fixture
def run(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=5e-4, report_to=[], use_cpu=True)
    state = TrainerState()
    state.max_steps = 1000
    guard = DivergenceGuard(factor=100, precision="fp32", finetuning_type="full", cutoff_len=64)

    def log(step, loss, grad_norm):
        state.global_step = step
        logs = {"loss": loss, "grad_norm": grad_norm, "learning_rate": 5e-4}
        guard.on_log(args, state, TrainerControl(), logs=logs)

    # a run that has converged: loss near zero, gradient norms around 0.01
    for step in range(10, 210, 10):
        log(step, 0.002, 0.01 + step * 1e-6)
    return guard, log, args, state, tmp_path


def diagnosis(work):
    return json.loads((work / "llmft_divergence.json").read_text())


def test_a_lone_spike_near_zero_loss_is_cleared_by_the_next_logged_step(run):
    guard, log, _, _, work = run
    log(210, 0.004, 3.0)  # 300x the running median
    assert guard.suspect is not None
    log(220, 0.003, 0.012)
    log(230, 0.002, 0.011)
    assert guard.suspect is None and [c["step"] for c in guard.cleared] == [210]
    assert [h["step"] for h in guard.history[-3:]] == [210, 220, 230]
    assert not (work / "llmft_divergence.json").exists()


def test_a_spike_whose_next_logged_loss_rose_stops_and_sets_aside_what_was_saved_since(run):
    _, log, _, _, work = run
    for step in (200, 210):
        (work / f"checkpoint-{step}").mkdir()
    log(210, 0.004, 3.0)
    with pytest.raises(Diverged) as stopped:
        log(220, 0.9, 0.5)  # the loss rose from a running median of 0.002
    found = diagnosis(work)
    assert found["step"] == 220 and "at step 210 was 297x" in found["what"]
    assert "the loss rose to 0.9 from a running median 0.002" in found["what"]
    assert "training stopped at step 220" in str(stopped.value)
    assert found["set_aside"] == ["diverged-checkpoint-210"]
    assert [step for step, _ in checkpoints(work)] == [200]  # resume and publish see the one before


def test_grad_norms_that_stay_high_while_the_loss_stays_low_do_not_stop(run):
    guard, log, _, _, work = run
    log(210, 0.004, 3.0)
    log(220, 0.03, 1.2)  # still 120x the median, the loss still near zero
    log(230, 0.03, 4.0)
    log(240, 0.02, 0.5)
    assert [c["step"] for c in guard.cleared] == [210, 230]
    assert not (work / "llmft_divergence.json").exists()


def test_a_loss_that_doubles_near_zero_is_not_a_confirmation(run):
    guard, log, _, _, _ = run
    log(210, 0.004, 3.0)
    log(220, 0.05, 0.02)  # 25x the median loss, but up by under LOSS_RISE
    assert guard.suspect is None and guard.cleared


@pytest.mark.parametrize("loss, stops", [(0.004, False), (0.5, True)])
def test_a_spike_at_the_last_step_is_judged_by_its_own_loss(run, loss, stops):
    guard, log, _, state, work = run
    state.max_steps = 210
    if stops:
        with pytest.raises(Diverged):
            log(210, loss, 3.0)
        assert diagnosis(work)["step"] == 210
    else:
        log(210, loss, 3.0)
        assert guard.suspect is None and guard.cleared


@pytest.mark.parametrize("loss, stops", [(0.004, False), (0.5, True)])
def test_a_spike_no_logged_step_follows_is_judged_by_its_own_loss_at_the_end(run, loss, stops):
    guard, log, args, state, work = run
    (work / "checkpoint-210").mkdir()  # the final save, after the spike's log
    log(210, loss, 3.0)
    if stops:
        with pytest.raises(Diverged):
            guard.on_train_end(args, state, TrainerControl())
        assert diagnosis(work)["set_aside"] == ["diverged-checkpoint-210"]
    else:
        guard.on_train_end(args, state, TrainerControl())
        assert checkpoints(work) and not (work / "llmft_divergence.json").exists()


def test_a_nan_stops_at_once_even_with_a_suspect_pending(run):
    _, log, _, _, work = run
    log(210, 0.004, 3.0)
    with pytest.raises(Diverged):
        log(220, float("nan"), 0.01)
    assert diagnosis(work)["what"] == "loss is nan"


def test_factor_zero_stops_only_on_nan(run):
    guard, log, _, _, _ = run
    guard.factor = 0
    log(210, 0.004, 3000.0)
    log(220, 0.004, 3000.0)
    assert guard.suspect is None and not guard.cleared
