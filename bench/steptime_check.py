"""The planner's step-time estimate (workflow/llmft/sft/steptime.py) against measured steps, one GPU.

For one model the planner weighs three ways to train: without recompute at the micro-batch that fits,
with gradient checkpointing, and with ZeRO-3 + CPU offload. This renders each through llmft
(render-sft from this node's facts, pack-data) and trains a few steps with LLaMA-Factory + DeepSpeed
through llmft's launcher, then prints, per plan, the estimated and the measured median step time
(llmft_steps.jsonl, first steps skipped) and whether the estimate ranks them as measured.

    python bench/steptime_check.py --model DIR --data ROWS.json --work DIR --out RESULT.json
        [--steps 8] [--only auto,recompute,offload]

Run by bench/steptime_gpu.sh on the device; BENCH_DRY_RUN-style use on a CPU works with a tiny model
(`--cpu`), to check the wiring before spending device time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from llmft.core.config import validate  # noqa: E402
from llmft.core.io import read_jsonl  # noqa: E402
from llmft.core.platform import Platform  # noqa: E402
from llmft.core.settings import Config  # noqa: E402
from llmft.sft.render import render  # noqa: E402

# The plans compared: the planner's own choice and the best plan on the other side of each trade-off.
VARIANTS = {
    "auto": {},
    "recompute": {"gradient_checkpointing": True, "offload": False},
    "offload": {"gradient_checkpointing": False, "offload": True, "zero_stage": 3},
}
SKIP_STEPS = 2  # the first steps build kernels and warm the allocator


def base_config(model: str, steps: int, cpu: bool) -> dict:
    return {
        "run": "steptime",
        "hardware": {"gpus_per_node": 0 if cpu else 1, "processes_per_node": 1},
        "model": {"name_or_path": model, "template": "default"},
        "data": {"cutoff_len": 256 if cpu else 2048},
        "sft": {
            "precision": "fp32" if cpu else "bf16",
            "max_steps": steps,
            "logging_steps": 1,
            "save_steps": 100000,
            # no held-out pass inside the timed steps
            "extra": {"eval_strategy": "no"},
        },
    }


def run(cmd: list[str], log: Path, timeout: float) -> int:
    with open(log, "w") as fh:
        try:
            return subprocess.run(
                cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO
            ).returncode
        except subprocess.TimeoutExpired:
            return 124


def measured(work_dir: Path) -> dict:
    steps = [e for e in read_jsonl(work_dir / "llmft_steps.jsonl") if "time" in e]
    gaps = [
        (b["time"] - a["time"]) for a, b in zip(steps, steps[1:], strict=False) if a["step"] >= SKIP_STEPS
    ]
    log = read_jsonl(work_dir / "trainer_log.jsonl") if (work_dir / "trainer_log.jsonl").exists() else []
    vram = max((e.get("vram_allocated", 0) for e in log), default=0)
    return {
        "steps": len(steps),
        "step_seconds": [round(g, 3) for g in gaps],
        "median_step_s": round(statistics.median(gaps), 3) if gaps else None,
        "peak_vram_allocated_gib": vram or None,
        "losses": [e["loss"] for e in log if "loss" in e],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="alpaca rows (bench/sft_models.py data)")
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--only", default=",".join(VARIANTS))
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--timeout", type=float, default=420)
    args = ap.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'workflow'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    os.environ.update(env)
    result: dict = {"model": args.model, "steps": args.steps, "runs": {}}

    t = time.time()
    facts = work / "facts.json"
    run([py, "-m", "llmft.env.nodefacts", "--out", str(facts), "--imports", "torch"], work / "facts.log", 300)
    node = json.loads(facts.read_text())
    # The machine's memory is a balloon that grows as it is used: MemTotal reads low at first. Its
    # lent size (128 GiB) is what a job can fill.
    if not args.cpu:
        node["host_memory_gib"] = max(node.get("host_memory_gib") or 0, 125.0)
    result["node"] = {k: node.get(k) for k in ("torch_version", "host_cpus", "host_memory_gib", "devices")}
    data = work / "data"
    base = validate(base_config(args.model, args.steps, args.cpu))
    if not (data / "tokenized").exists():
        run([py, "-m", "llmft", "prepare-data", "--config-json", json.dumps(
            {**base, "data": {**base["data"], "sources": [{"path": args.data}], "invalid_rows": "drop"}}),
            "--tokenizer", args.model, "--out-dir", str(data)], work / "prepare.log", 600)  # fmt: skip
    result["setup_s"] = round(time.time() - t, 1)

    for name in args.only.split(","):
        cfg = validate({**base, "sft": {**base["sft"], **VARIANTS[name]}})
        platform = Platform.from_facts(Config.from_dict(cfg), [node], where="nodefacts on this machine")
        rd = work / name
        rd.mkdir(exist_ok=True)
        yaml_path, ds_path = rd / "llamafactory.yaml", rd / "deepspeed.json"
        t = time.time()
        rendered = render(
            Config.from_dict(cfg),
            args.model,
            str(data),
            str(yaml_path),
            str(ds_path),
            str(rd / "w"),
            platform,
        )
        plan = rendered["llmft"]["plan"]
        pack = ["pack-data", "--yaml", str(yaml_path), "--tokenizer", args.model, "--data-dir", str(data)]
        run([py, "-m", "llmft", *pack, "--stamp-out", str(rd / "packed.json")], rd / "pack.log", 600)
        rc = run(
            [
                py,
                "-m",
                "llmft",
                "sft",
                "launch",
                "--config-json",
                json.dumps(cfg),
                "--yaml",
                str(yaml_path),
            ],
            rd / "train.log",
            args.timeout,
        )
        out = {
            "rc": rc,
            "wall_s": round(time.time() - t, 1),
            "settings": {k: plan[k] for k in ("zero_stage", "offload", "micro_batch", "gradient_accumulation",
                                              "gradient_checkpointing", "packing", "attention", "liger")},
            "predicted": plan["step"],
            "predicted_peak_gib": plan["memory"]["peak"],
            "reasons": plan["reasons"],
        }  # fmt: skip
        work_dir = Path(rendered["output_dir"])
        if (work_dir / "llmft_steps.jsonl").exists():
            out["measured"] = measured(work_dir)
            m, p = out["measured"]["median_step_s"], plan["step"]["total_s"]
            if m:
                out["estimate_error"] = round(p / m - 1, 3)
        # LLaMA-Factory saves the trained model at the end (9 GB at 4.5 B): keep the logs, not that,
        # or three plans fill the device machine's disk.
        for log_name in ("llmft_steps.jsonl", "trainer_log.jsonl"):
            if (work_dir / log_name).exists():
                shutil.copy(work_dir / log_name, rd / log_name)
        shutil.rmtree(work_dir, ignore_errors=True)
        if rc != 0:
            out["log_tail"] = (rd / "train.log").read_text()[-2500:]
        result["runs"][name] = out
        print(json.dumps({name: {k: v for k, v in out.items() if k != "log_tail"}}), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))

    done = {n: r for n, r in result["runs"].items() if (r.get("measured") or {}).get("median_step_s")}
    if len(done) > 1:
        by_est = sorted(done, key=lambda n: done[n]["predicted"]["total_s"])
        by_meas = sorted(done, key=lambda n: done[n]["measured"]["median_step_s"])
        result["ranking"] = {"estimated": by_est, "measured": by_meas, "agree": by_est == by_meas}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result.get("ranking")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
