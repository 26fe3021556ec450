"""The divergence guard through the real launcher (tiny model, 2 processes, gloo), on real gradient
spikes that the training data makes: hundreds of near-identical easy rows drive the loss near zero,
then two hard rows (six random words to recite) make one step's gradient norm hundreds of times its
running median, and later a run of hard rows makes a spike whose next logged loss rises.

LLaMA-Factory's `disable_shuffling` (through sft.extra) keeps prepare_data's row order, so step s
trains rows (s - 1) * 8 to s * 8 - 1 (2 ranks x 4 rows); a constant learning rate keeps every step
alike.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.workflow.test_sft_launcher import finish, launch, llmft, publish, render

pytestmark = pytest.mark.workflow

ROWS_PER_STEP = 8
SAVE = 10
EASY_BEFORE, EASY_BETWEEN, HARD_BLOCK = 401, 211, 64  # lone spike at step 46, the hard run from step 70
WORDS = (
    "apple river stone cloud music paper light green orange table window garden yellow silver horse winter "
    "bread"
).split()


def easy(i: int) -> dict:
    return {"instruction": f"Item {i}: answer yes.", "input": "", "output": "yes"}


def hard(i: int) -> dict:
    rng = random.Random(i)
    return {
        "instruction": f"Recite list {i}.",
        "input": "",
        "output": " ".join(rng.choice(WORDS) for _ in range(6)),
    }


@pytest.fixture(scope="module")
def spiky(tmp_path_factory):
    """The tiny model and the spiky data, prepared by the pipeline's own stage commands; returns
    (folder, step of the lone spike, first step of the hard run)."""
    root = tmp_path_factory.mktemp("spikes")
    rows = (
        [easy(i) for i in range(EASY_BEFORE)]
        + [hard(0), hard(1)]
        + [easy(EASY_BEFORE + i) for i in range(EASY_BETWEEN)]
        + [hard(i) for i in range(2, 2 + HARD_BLOCK)]
    )
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg["data"]["sources"] = [{"path": "rows.jsonl", "format": "alpaca"}]
    (root / "config").mkdir()
    (root / "config/config.yaml").write_text(yaml.safe_dump(cfg))
    for cmd in (
        ["base-model", "--out", "base_model"],
        ["prepare-data", "--tokenizer", "base_model", "--out-dir", "data"],
    ):
        proc = llmft(*cmd, cwd=root)
        assert proc.returncode == 0, proc.stderr[-2000:]
    probe = [sys.executable, "-m", "llmft.env.nodefacts", "--out", "facts.json", "--imports", "torch"]
    proc = subprocess.run(probe, cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # where the held-out split left the hard rows: it is decided by each row's content
    train = [json.loads(line)["instruction"] for line in (root / "data/train.jsonl").read_text().splitlines()]
    at = [i for i, text in enumerate(train) if text.startswith("Recite")]
    lone, block = at[0] // ROWS_PER_STEP + 1, at[2] // ROWS_PER_STEP + 1
    assert at[1] // ROWS_PER_STEP + 1 == lone and block % SAVE == 0, (lone, block)
    return root, lone, block


def train(root: Path, name: str, max_steps: int) -> tuple[str, dict, object]:
    sft = {
        "zero_stage": 0, "per_device_train_batch_size": ROWS_PER_STEP // 2, "max_steps": max_steps,
        "save_steps": SAVE, "learning_rate": 3.0e-3, "warmup_ratio": 0.0, "lr_scheduler_type": "constant",
        "extra": {"disable_shuffling": True},
    }  # fmt: skip
    overrides, args = render(root, name, sft)
    proc = launch(root, overrides, name)
    return overrides, args, proc


def spike_warning(step: int) -> str:
    return (
        rf"\[llmft\.sft\.callbacks\] gradient norm [\d.]+ at step {step} was \d+x its running median [\d.e-]+"
    )


@pytest.mark.reliability(
    fault="a gradient norm hundreds of times its running median once the loss is near zero (one hard batch)",
    seen="a warning naming the spike's step, its norm against the running median, and the next "
    "logged step's loss; training goes on to the end and the model is published",
    steps_lost="none",
    data_lost="none",
)
def test_a_lone_gradient_spike_is_warned_of_and_training_goes_on_to_publish(spiky):
    root, lone, block = spiky
    overrides, args, proc = train(root, "lone", block - SAVE)
    out = finish(proc, 900)  # a loaded machine; about a minute when idle
    assert proc.returncode == 0, out[-3000:]
    assert re.search(spike_warning(lone) + ": the next logged step's loss decides", out), out[-3000:]
    cleared = spike_warning(lone) + rf"; at step {lone + 1} the loss is [\d.e-]+: not a divergence"
    assert re.search(cleared, out), out[-3000:]
    work = root / args["output_dir"]
    assert not (work / "llmft_divergence.json").exists() and not list(work.glob("diverged-*"))
    summary = publish(root, overrides, "lone")
    assert summary["steps"] == block - SAVE
    assert (root / "lone_model/model.safetensors").is_file()


@pytest.mark.reliability(
    fault="training diverges (a gradient spike, then the loss rises)",
    seen="training stops at the next logged step (exit 3) with a diagnosis naming the spike and the "
    "loss; the checkpoint saved at the spike is renamed diverged-checkpoint-N",
    steps_lost="the diverged run (by design); the checkpoint before the spike is the newest left",
    data_lost="none: no model is published",
)
def test_a_confirmed_spike_stops_sets_aside_the_checkpoint_since_and_publishes_nothing(spiky):
    root, lone, block = spiky
    overrides, args, proc = train(root, "confirmed", block + SAVE)
    out = finish(proc, 900)  # a loaded machine; about a minute when idle
    assert proc.returncode == 3, out[-3000:]
    assert f"[llmft] training stopped at step {block + 1}: gradient norm" in out, out[-3000:]
    work = root / args["output_dir"]
    diagnosis = json.loads((work / "llmft_divergence.json").read_text())
    assert diagnosis["step"] == block + 1
    assert f"at step {block} was" in diagnosis["what"] and "the loss rose to" in diagnosis["what"]
    assert lone in [c["step"] for c in diagnosis["cleared_spikes"]]  # the lone spike before it held
    assert diagnosis["set_aside"] == [f"diverged-checkpoint-{block}"]
    assert sorted(p.name for p in work.glob("*checkpoint-*")) == [
        f"checkpoint-{block - SAVE}",
        f"diverged-checkpoint-{block}",
    ]
    assert not (work / "model.safetensors").exists()
    proc = llmft(
        "sft", "finalize", "--overrides", overrides, "--yaml", "confirmed.yaml",
        "--model-out", "confirmed_model", "--summary-out", "confirmed_summary.json", cwd=root,
    )  # fmt: skip
    assert proc.returncode != 0 and "training left no model" in proc.stderr
    assert not (root / "confirmed_model").exists() and not (root / "confirmed_summary.json").exists()
