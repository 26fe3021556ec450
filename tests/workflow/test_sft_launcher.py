"""llmft's SFT launcher on real CPU training (tiny model, 2 processes, gloo): no mocks.

- a stop signal makes every rank save a checkpoint at the same step and exit; the same command then
  resumes from it, loses no step, and trainer_log.jsonl keeps the whole history;
- the same for LoRA (its checkpoints hold the adapter), whose published outputs are the adapter and
  the merged model;
- an absurd learning rate stops training at the first NaN with a diagnosis that names it, for full
  and LoRA fine-tuning;
- neat packing through varlen attention (the GPU path, on its CPU reference) counts its tokens on
  the host, equal to transformers' own count at every step.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import DEMO, REPO, shared_run

pytestmark = pytest.mark.workflow


def llmft(*args, cwd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmft", *args], cwd=cwd, capture_output=True, text=True, **kw
    )


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    """The demo's tiny model and prepared data, copied from the session's demo run (the pipeline's own
    base_model and prepare_data jobs)."""
    root = tmp_path_factory.mktemp("sft")
    (root / "config").mkdir()
    (root / "config/config.yaml").write_text((REPO / "config/config.yaml").read_text())
    demo = shared_run("demo", **DEMO).work / "results/demo"
    for part in ("base_model", "data"):
        shutil.copytree(demo / part, root / part)
    # this machine's facts, as verify_env's probe records them: what render-sft plans from
    probe = [sys.executable, "-m", "llmft.env.nodefacts", "--out", "facts.json", "--imports", "torch"]
    proc = subprocess.run(probe, cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root


def render(root: Path, name: str, sft: dict, work_root: str = "work") -> tuple[str, dict]:
    """Render the demo config with `sft` overrides; return (overrides JSON, rendered args)."""
    overrides = json.dumps({"sft": {"logging_steps": 1, **sft}})
    out = f"{name}.yaml"
    proc = llmft(
        "render-sft", "--overrides", overrides, "--base-model", "base_model", "--verify", "facts.json",
        "--data-dir", "data",
        "--out-yaml", out, "--out-deepspeed", f"{name}.json", "--work-root", work_root, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return overrides, yaml.safe_load((root / out).read_text())


def launch(root: Path, overrides: str, name: str, tag: str = "") -> subprocess.Popen:
    """The per-node launcher as the sft rule runs it; output to a file (a full pipe would block it)."""
    log = open(root / f"{name}{tag}.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmft",
            "sft",
            "launch",
            "--overrides",
            overrides,
            "--yaml",
            f"{name}.yaml",
        ],
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    proc.log_path, proc.log_file = root / f"{name}{tag}.log", log
    return proc


def publish(root: Path, overrides: str, name: str) -> dict:
    """The sft rule's last step: publish the model, write train_summary.json; return the summary."""
    proc = llmft(
        "sft", "finalize", "--overrides", overrides, "--yaml", f"{name}.yaml",
        "--model-out", f"{name}_model", "--summary-out", f"{name}_summary.json", cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((root / f"{name}_summary.json").read_text())


def finish(proc: subprocess.Popen, timeout: int = 300) -> str:
    proc.wait(timeout=timeout)
    proc.log_file.close()
    return proc.log_path.read_text()


def steps_done(work: Path) -> list[int]:
    path = work / "llmft_steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"time"' in line]


# Stopped after 8 of STEPS steps: the stop lands well before the end; the rerun trains the rest.
STEPS = 30


@pytest.mark.parametrize(
    "sig,zero_stage,kind",
    [(signal.SIGUSR1, 3, "full"), (signal.SIGTERM, 0, "full"), (signal.SIGUSR1, 3, "lora")],
)
@pytest.mark.reliability(
    fault=(
        "SIGUSR1 or SIGTERM during training (Slurm's warning signal, preemption, a manual stop); a "
        "rerun of a finished training"
    ),
    seen=(
        "every rank saves at the same step and exits 75; the rerun resumes; the summary counts "
        "resumed, trained and lost steps apart; a finished training is published again without "
        "training"
    ),
    steps_lost="none",
    data_lost="none",
)
def test_stop_signal_saves_and_the_rerun_resumes_without_losing_steps(stage, sig, zero_stage, kind):
    # The demo's ZeRO-3 (DeepSpeed checkpoints) and plain DDP (torch checkpoints: transformers 5.6
    # loads them with map_location "cpu:0" on CPU processes, which llmft.sft.train's shim makes "cpu");
    # LoRA under ZeRO-3: the checkpoint holds the adapter and its optimizer states, the base stays.
    sft = {"max_steps": STEPS, "save_steps": 1000, "zero_stage": zero_stage, "finetuning_type": kind}
    if kind == "lora":
        sft["learning_rate"] = 3.0e-3
    name = f"resume_{sig.name}_{kind}"
    final = "adapter_model.safetensors" if kind == "lora" else "model.safetensors"
    overrides, args = render(stage, name, sft)
    work = stage / args["output_dir"]
    proc = launch(stage, overrides, name)
    deadline = time.time() + 240
    while len(steps_done(work)) < 8 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    signalled_at = len(steps_done(work))
    assert proc.poll() is None and signalled_at >= 8, proc.log_path.read_text()[-3000:]
    os.kill(proc.pid, sig)
    out = finish(proc, 240)
    assert proc.returncode == 75, out[-3000:]  # EX_TEMPFAIL: saved, run me again
    saved = json.loads((work / "llmft_preempted.json").read_text())["step"]
    assert saved >= signalled_at and (work / f"checkpoint-{saved}").is_dir()
    assert not (work / final).exists()  # no final model from an interrupted run
    if kind == "lora":  # the checkpoint is the adapter's, with its optimizer state
        assert (work / f"checkpoint-{saved}/adapter_model.safetensors").is_file()
    resumed = launch(stage, overrides, name, tag="_resumed")
    out = finish(resumed)
    assert resumed.returncode == 0, out[-3000:]
    assert f"Resuming training from {args['output_dir']}/checkpoint-{saved}" in out
    steps = steps_done(work)
    # every step ran exactly once: the interrupted part up to the checkpoint, then the rest
    assert steps == list(range(1, saved + 1)) + list(range(saved + 1, STEPS + 1))
    log = [json.loads(line) for line in (work / "trainer_log.jsonl").read_text().splitlines()]
    logged = [e["current_steps"] for e in log if "loss" in e]
    assert logged[0] == 1 and logged[-1] == STEPS and saved in logged  # the history before the stop is kept
    assert (work / final).exists()
    # the stop is kept in the event history, not left as a marker of the finished attempt
    events = [json.loads(line) for line in (work / "llmft_events.jsonl").read_text().splitlines()]
    assert {"file": "llmft_preempted.json", "step": saved} in [
        {"file": e["file"], "step": e["content"].get("step")}
        for e in events
        if isinstance(e["content"], dict)
    ]
    assert not (work / "llmft_preempted.json").exists()
    # the summary says what the resumed attempt itself did, and its tokens/s counts only its steps
    summary = publish(stage, overrides, name)
    attempt = summary["attempt"]
    assert attempt["attempts"] == 2 and attempt["resumed_from_step"] == saved
    assert attempt["steps_trained"] == STEPS - saved and attempt["steps_lost"] == 0
    assert summary["throughput_steps"][0] > saved and 0 < summary["tokens_per_second_per_gpu"]
    assert (
        summary["finetuning_type"] == kind
        and 0 < summary["trainable_params"] <= summary["trained_model_params"]
    )
    if kind == "lora":  # the adapter beside the model, which is the base with the adapter merged in
        assert (stage / "adapter/adapter_model.safetensors").is_file()
        assert (stage / f"{name}_model/model.safetensors").is_file()
        assert not (stage / f"{name}_model/adapter_config.json").exists()
    # a rerun of the finished training (its published outputs deleted) publishes it again, no training
    again = launch(stage, overrides, name, tag="_again")
    out = finish(again)
    assert again.returncode == 0 and "publishing it again, not training" in out, out[-2000:]
    assert "Resuming training" not in out and steps_done(work) == steps
    summary = publish(stage, overrides, name)
    assert (
        summary["attempt"]["republished_without_training"]
        and summary["attempt"]["steps_trained"] == STEPS - saved
    )


@pytest.mark.parametrize("kind", ["full", "lora"])
@pytest.mark.reliability(
    fault="training diverges (NaN loss)",
    seen="training stops at the first step whose loss is not finite, before any save, with a "
    "diagnosis naming sft.learning_rate as the likely cause",
    steps_lost="the diverged run (by design)",
    data_lost="none: no model is published",
)
def test_absurd_learning_rate_stops_at_the_first_nan_with_a_diagnosis(stage, kind):
    sft = {
        "zero_stage": 0,
        "max_steps": 40,
        "learning_rate": 1.0e30,
        "warmup_ratio": 0.0,
        "finetuning_type": kind,
    }
    overrides, args = render(stage, f"diverge_{kind}", sft)
    work = stage / args["output_dir"]
    proc = launch(stage, overrides, f"diverge_{kind}")
    out = finish(proc)
    assert proc.returncode == 3, out[-3000:]
    diagnosis = json.loads((work / "llmft_divergence.json").read_text())
    step = diagnosis["step"]
    assert step < 10 and "nan" in diagnosis["what"].lower()
    # the first bad step: every step before it was logged (logging_steps 1) with a finite loss,
    # and no step ran after it
    recent = diagnosis["recent"]
    assert [h["step"] for h in recent] == list(range(max(1, step - 10), step))
    assert all(math.isfinite(h["loss"]) for h in recent)
    assert steps_done(work)[-1] == step
    assert any(
        c.startswith("learning rate: sft.learning_rate=1e+30") and f"for {kind} fine-tuning" in c
        for c in diagnosis["causes"]
    )
    assert diagnosis["causes"][0].startswith("learning rate: ")  # the likely cause, first
    assert "Likely causes" in out  # the launcher prints it into the sft log
    assert not (work / "model.safetensors").exists() and not (work / "adapter_model.safetensors").exists()
    assert not list(work.glob("checkpoint-*"))
    # nothing to publish from a diverged run: finalize refuses
    proc = llmft(
        "sft", "finalize", "--overrides", overrides, "--yaml", f"diverge_{kind}.yaml",
        "--model-out", f"diverge_{kind}_model", "--summary-out", f"diverge_{kind}.json", cwd=stage,
    )  # fmt: skip
    assert proc.returncode != 0 and "training left no" in proc.stderr
    assert not (stage / f"diverge_{kind}_model").exists()


def test_warmup_stable_decay_holds_the_peak_then_decays_over_the_ratio_of_the_steps(stage):
    """sft.lr_scheduler_type warmup_stable_decay through DeepSpeed ZeRO-3: the launcher turns
    sft.decay_ratio into the decay's steps from the trainer's own step count."""
    sft = {"zero_stage": 3, "max_steps": 20, "warmup_ratio": 0.1, "learning_rate": 1.0e-3}
    sft.update(lr_scheduler_type="warmup_stable_decay", decay_ratio=0.25)
    overrides, args = render(stage, "wsd", sft)
    assert args["llmft"]["decay_ratio"] == 0.25
    proc = launch(stage, overrides, "wsd")
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    log = (stage / args["output_dir"] / "trainer_log.jsonl").read_text().splitlines()
    lr = {e["current_steps"]: e["lr"] for e in map(json.loads, log) if "loss" in e}
    assert sorted(lr) == list(range(1, 21))
    # each step's rate: 2 warm-up steps, the peak until the decay's first step (16 = 20 - 5 + 1),
    # then a cosine towards zero (LLaMA-Factory alone would start decaying after step 9)
    assert lr[1] < lr[2] < lr[3] == 1.0e-3
    assert all(lr[i] == 1.0e-3 for i in range(3, 17))
    assert all(lr[i] > lr[i + 1] for i in range(16, 20)) and lr[20] < 0.1 * 1.0e-3


PRELUDE_BOTH_COUNTS = """
import json, os, sys, transformers
from llmft.core import varlen

own = transformers.Trainer._track_num_input_tokens  # transformers' count: reads the device
varlen.count_tokens_on_host()
host = transformers.Trainer._track_num_input_tokens


def both(self, inputs):
    before = self.state.num_input_tokens_seen
    own(self, {k: v for k, v in inputs.items() if k != varlen.TOKENS_KEY})
    theirs, self.state.num_input_tokens_seen = self.state.num_input_tokens_seen, before
    host(self, inputs)
    with open(f"counts_rank{os.environ['RANK']}.jsonl", "a") as fh:
        fh.write(json.dumps([varlen.TOKENS_KEY in inputs, theirs, self.state.num_input_tokens_seen]) + "\\n")


transformers.Trainer._track_num_input_tokens = both
from llmft.sft.train import main

sys.exit(main(["varlen_count.yaml"]))
"""


def test_varlen_batches_count_their_tokens_on_the_host_as_transformers_counts_them(stage):
    """The GPU path's collator (neat packing through llmft's varlen attention, here on its CPU
    reference) under ZeRO-3 on two processes, through LLaMA-Factory: counted on the host (the
    collator's integer, summed over ranks through a gloo group), every step's running token count
    equals the one transformers' own count reads back from the device."""
    render(stage, "varlen_count", {"max_steps": 3, "packing": "neat"})
    path = stage / "varlen_count.yaml"
    text = path.read_text()
    assert "  attention: auto" in text and "include_num_input_tokens_seen: all" in text  # the CPU plan
    text = text.replace("  attention: auto", "  attention: varlen", 1)
    path.write_text(
        text.replace("include_num_input_tokens_seen: all", "include_num_input_tokens_seen: non_padding")
    )
    (stage / "varlen_count.py").write_text(PRELUDE_BOTH_COUNTS)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "varlen_count.py"],
        cwd=stage, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "neat packing runs through llmft_varlen" in proc.stdout + proc.stderr
    for rank in (0, 1):
        rows = [json.loads(x) for x in (stage / f"counts_rank{rank}.jsonl").read_text().splitlines()]
        assert len(rows) == 3 and all(keyed for keyed, _, _ in rows)  # every batch carried the count
        assert [ours for _, _, ours in rows] == [theirs for _, theirs, _ in rows]
        assert rows[0][2] > 0
