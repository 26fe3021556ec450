"""GPU DPO benchmark: llmft's own plan for the preference stage against a hand-tuned
LLaMA-Factory DPO config, same 1.24 B model, same pairs, one call, both through llmft's render path
(`render-sft --stage preference`) and launcher (`sft launch`), as bench/sft_bench.py runs sft.

    python bench/dpo_bench.py pairs --out OUT [--rows N]     # the pairs both variants train on
    python bench/dpo_bench.py run NAME --out OUT             # one variant (see below)
    python bench/dpo_bench.py all --out OUT [--json R.json]  # pairs, hand, ours, resident, the ratios
    python bench/dpo_bench.py fit --out OUT --cutoff 4096    # each side at the largest micro-batch that fits

The pairs are written as a sharegpt file and prepared by `llmft prepare-preference` as the workflow
prepares them (checked, split, tokenized once with each pair's length; pairs over the cutoff are
dropped): both variants train the same tokenized pairs, which LLaMA-Factory loads as they are.

Throughput = (tokens seen at the last step - tokens seen at the warm-up step) / (seconds between
them) / GPUs, read from llmft_steps.jsonl; tokens are the non-padding input tokens of both sequences
of every pair (chosen and rejected, prompt included), as LLaMA-Factory's include_num_input_tokens_seen
counts them. Ratio = ours / hand. Both variants run full fine-tuning (the reference model a frozen
copy) in bf16 at DPO's usual 5e-7, beta 0.1, sigmoid loss.

hand: what a user who tuned LLaMA-Factory's DPO by hand on one H200 runs: ZeRO-2 (trl keeps the
reference model whole outside ZeRO-3), 4 pairs x 4 accumulation steps (2 x 8 on a GPU under 100 GiB,
such as an H100 80 GB), no gradient checkpointing,
SDPA, no Liger, random batches of pairs (LLaMA-Factory's own pairwise rows carry no length for
transformers' length-grouped sampler), the reference model resident. ours: every throughput key auto
(the planner's choice from this machine's facts; on a GPU preference.reference_logps auto is cached:
`llmft reference-logps` runs first, into an empty store and then again into the full one, each timed,
and training loads no reference model). resident: ours with preference.reference_logps: resident.
padded (only when named): resident with LLaMA-Factory's own padded DPO forward
(preference.padding_free: false). grouped (only when named): ours with preference.group_by_length: true.

With the reference step counted: tokens/s of one epoch = an epoch's tokens (both sequences of every
train pair) / (that count / the measured tokens/s + the reference step's wall seconds), for the cold
step (a first night) and the warm one (a night whose reference model and pairs are cached).

fit: both sides at the largest micro-batch that fits the GPU at one cutoff (--cutoff; the pairs'
lengths scale with it, so the same share is dropped as at 2 048), the pairs per optimizer step fixed
(--pairs-per-step). hand: the hand-tuned settings at each micro-batch of --hand-batches in turn, the
largest that trains (the first that fails, out of memory, ends the search); ours: llmft's plan with the
micro-batch on auto and room for every divisor of the pairs a step (sft.micro_batch_tokens), the
planner's choice, and the planner's verdict (planned peak, or its refusal) on every micro-batch of the
search. Each trained run: planned peak against measured (torch's max allocated, rank 0).

BENCH_DRY_RUN=1 runs the same path on 2 CPU processes with a tiny model (no GPU): a check of the
script, not a measurement: pairs a twentieth as long (cutoff 256). BENCH_MODELS (default
/tmp/models) holds llama1b (bench/sft_models.py), whose tokenizer prepares the pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.sft_bench import (  # noqa: E402
    MODELS,
    SEQ,
    _read_jsonl,
    _throughput,
    llmft_env,
    node_facts,
    render_cmd,
    run_stage,
    train_until,
)

WARMUP = 5  # steps before the throughput window (kernel set-up, first allocations)
STEPS = 30

HAND = {
    "zero_stage": 2,
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 4,
    "gradient_checkpointing": False,
    "flash_attn": "sdpa",
    "liger_kernel": False,
    "group_by_length": False,
}
# ours at the hand-tuned run's tokens per optimizer step (4 x 4 pairs x 2 x 2048), so both learn alike
# padded: ours with LLaMA-Factory's own padded DPO forward (preference.padding_free: false), the plan
# before padding-free pairs; grouped: ours with pairs of similar length batched together
# (preference.group_by_length: true; auto leaves it off), run only when named
VARIANTS = {
    "hand": {**HAND, "reference_logps": "resident"},
    "ours": {"tokens_per_step": 65536},
    "resident": {"tokens_per_step": 65536, "reference_logps": "resident"},
    "padded": {"tokens_per_step": 65536, "padding_free": False, "reference_logps": "resident"},
    "grouped": {"tokens_per_step": 65536, "group_by_length": True},
}
ALL = ("hand", "ours", "resident")  # what `all` runs, in one call
# the preference stage's own keys; the rest are sft's hardware keys, which the stage shares
# Per model size: the model bench/sft_models.py builds, llmft's tokens per optimizer step (ours and
# resident) and the hand-tuned run's change to HAND. At 8 B the LoRA adapter trains (full DPO's
# weights, gradients and Adam states, ~16 bytes a parameter, outgrow one GPU): the hand-tuned run
# checkpoints activations at 2 pairs x 4 accumulation steps (one micro-batch's activations without
# checkpointing outgrow 80 GB), ours plans at about its tokens per step.
SIZES = {
    "1b": {"model": "llama1b", "tokens_per_step": 65536, "hand": {}},
    "8b": {
        "model": "llama8b",
        "tokens_per_step": 32768,
        "hand": {
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 4,
            "gradient_checkpointing": True,
        },
    },
}
PREF_KEYS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "group_by_length",
    "padding_free",
    "reference_logps",
)


def write_pairs(out: Path, rows: int, seed: int = 0, cutoff: int = SEQ) -> Path:
    """DPO pairs of a realistic length (at a 2 048-token cutoff prompts of 200-400 words, answers of
    150-400 words; scaled with the cutoff; a dry run's a twentieth) in the canonical sharegpt form: the
    source both variants' data is prepared from."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(4000)]
    scale = (20 if os.environ.get("BENCH_DRY_RUN") else 1) * SEQ / cutoff

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(vocab) for _ in range(rng.randint(int(lo / scale), int(hi / scale))))

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "pairs.jsonl", "w") as fh:
        for _ in range(rows):
            row = {
                "conversations": [{"from": "human", "value": text(200, 400)}],
                "chosen": {"from": "gpt", "value": text(150, 400)},
                "rejected": {"from": "gpt", "value": text(150, 400)},
            }
            fh.write(json.dumps(row) + "\n")
    return out / "pairs.jsonl"


def prepare_pairs(out: Path, size: str = "1b", cutoff: int = SEQ) -> dict:
    """`llmft prepare-preference` on the pairs (the workflow's prepare_preference): its stats line."""
    cfg = config_for("ours", STEPS, out, size, cutoff=cutoff)
    cmd = [sys.executable, "-m", "llmft", "prepare-preference", "--config-json", json.dumps(cfg)]
    cmd += ["--tokenizer", cfg["model"]["name_or_path"], "--out-dir", str(out / "data")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=llmft_env(), cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"prepare-preference failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    from datasets import load_from_disk

    train = load_from_disk(str(out / "data" / "tokenized"))["train"]
    # an epoch's tokens as the throughput counts them: both sequences of every train pair
    stats["train_tokens"] = sum(
        len(c) + len(r) for c, r in zip(train["chosen_input_ids"], train["rejected_input_ids"], strict=True)
    )
    (out / "pairs.stats.json").write_text(json.dumps(stats, indent=2))
    return stats


def hand_settings(size: str = "1b") -> dict:
    """HAND (with the size's change) on a GPU of 100 GiB or more (H200: planned peak 82 GiB at 1.24 B);
    at 1.24 B on a smaller one (H100 80 GB) what a user would tune down to: 2 pairs x 8 accumulation
    steps, the same pairs per step."""
    import torch

    hand = {**HAND, **SIZES[size]["hand"]}
    if size != "1b" or not torch.cuda.is_available():
        return hand
    if torch.cuda.get_device_properties(0).total_memory >= 100 * 2**30:
        return hand
    return {**hand, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 8}


def config_for(
    name: str,
    steps: int,
    out: Path,
    size: str = "1b",
    finetuning: str = "full",
    cutoff: int = SEQ,
    change: dict | None = None,
) -> dict:
    """A variant's llmft config; `change`: keys over the variant's own (the fit search's micro-batch)."""
    if name == "hand":
        overrides = {**hand_settings(size), "reference_logps": "resident"}
    else:
        overrides = dict(VARIANTS[name])
        overrides["tokens_per_step"] = SIZES[size]["tokens_per_step"]
    overrides.update(change or {})
    dry = bool(os.environ.get("BENCH_DRY_RUN"))
    seq = 256 * cutoff // SEQ if dry else cutoff
    sft = {k: v for k, v in overrides.items() if k not in PREF_KEYS}
    sft.update(precision="bf16", logging_steps=1, save_steps=100000)
    sft["extra"] = {"eval_strategy": "no", "disable_tqdm": True, "preprocessing_num_workers": 16}
    pref = {
        "method": "dpo",
        "loss": "sigmoid",
        "beta": 0.1,
        "start_from": "base",
        "finetuning_type": finetuning,
    }
    pref.update({k: overrides[k] for k in PREF_KEYS if k in overrides}, max_steps=steps)
    # pairs longer than the cutoff are dropped, not cut (up to half of them: the comparison's pairs
    # are whatever fits, the same for both variants); a few held out, which the bench does not score
    source = {"path": str(out / "pairs.jsonl"), "format": "sharegpt"}
    pref["data"] = {
        "sources": [source],
        "cutoff_len": seq,
        "heldout_fraction": 0.05,
        "max_dropped_fraction": 0.5,
    }
    hw = {"vendor": "cuda", "nodes": 1, "gpus_per_node": 1, "gpu_model": ""}  # the node's own GPU
    model = str(MODELS / SIZES[size]["model"])
    if dry:
        hw = {"vendor": "cpu", "nodes": 1, "gpus_per_node": 0, "processes_per_node": 2}
        sft.update(precision="fp32", zero_stage=2 if name == "hand" else 0)
        sft.pop("flash_attn", None)
        model = os.environ.get("BENCH_DRY_MODEL", model)
        if name == "ours":  # auto is resident on CPU: the dry run takes the path auto takes on a GPU
            pref["reference_logps"] = "cached"
    return {
        "run": "bench",
        "hardware": hw,
        "model": {"name_or_path": model, "template": "default"},
        "data": {"cutoff_len": seq},
        "sft": sft,
        "preference": pref,
    }


def render_variant(rd: Path, cfg: dict, out: Path) -> tuple[Path, dict | None, dict | None]:
    """A fresh folder `rd` holding `cfg` (config.yaml) and its `render-sft --stage preference`:
    (the config's path, the rendered LLaMA-Factory YAML, None) or (path, None, run_stage's failed
    result)."""
    shutil.rmtree(rd, ignore_errors=True)  # nothing of an earlier call's run survives
    rd.mkdir(parents=True)
    cfg_path = rd / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    render = render_cmd(cfg_path, cfg["model"]["name_or_path"], node_facts(out), out / "data", rd)
    failed = run_stage([*render, "--stage", "preference"], rd, "render", llmft_env())
    if failed:
        return cfg_path, None, failed
    return cfg_path, yaml.safe_load((rd / "llamafactory.yaml").read_text()), None


def run_variant(
    name: str,
    out: Path,
    steps: int,
    timeout: int,
    size: str = "1b",
    finetuning: str = "full",
    warmup: int = WARMUP,
    cutoff: int = SEQ,
    change: dict | None = None,
    folder: str = "",
) -> dict:
    """Render, launch, stop after the last step is logged (the final save is not timed); throughput
    from step `warmup` on. In out/`folder` (the variant's name by default)."""
    rd = out / (folder or name)
    cfg = config_for(name, steps, out, size, finetuning, cutoff, change)
    cfg_path, rendered, failed = render_variant(rd, cfg, out)
    if failed:
        return failed
    env = llmft_env()
    work = Path(rendered["output_dir"])
    shutil.rmtree(work, ignore_errors=True)
    reference = {}
    if rendered["llmft"].get("reference_logps"):  # the plan trains from the reference step's record
        reference = reference_step(cfg_path, cfg, out, REPO / rendered["llmft"]["reference_logps"], rd, env)
        if reference.get("status") != "ok":
            return reference  # run_stage's failed result (rd/result.json)
    launch = [sys.executable, "-m", "llmft", "sft", "launch", "--config", str(cfg_path)]
    t0 = time.time()
    status = train_until(
        [*launch, "--yaml", str(rd / "llamafactory.yaml")], rd, work, steps, env, t0 + timeout
    )
    steps_log = _read_jsonl(work / "llmft_steps.jsonl")
    (rd / "llmft_steps.jsonl").write_text("".join(json.dumps(e) + "\n" for e in steps_log))
    result = {"name": name, "size": size, "finetuning": finetuning, "status": status}
    result["wall_s"] = round(time.time() - t0, 1)
    if reference:
        result["reference"] = reference
    plan = rendered["llmft"]["plan"]
    keys = ("zero_stage", "micro_batch", "gradient_accumulation", "gradient_checkpointing", "attention")
    result["plan"] = {k: plan[k] for k in (*keys, "liger", "group_by_length", "padding_free")}
    result["predicted_peak_gib"] = plan["memory"]["peak"]
    if sum("time" in e for e in steps_log) > warmup + 1:
        tps, n, seconds = _throughput(steps_log, warmup)
        result.update(tokens_per_s_per_gpu=round(tps / plan["world_size"], 1), window_steps=n)
        result["window_s"] = round(seconds, 2)
    # LLaMA-Factory's RECORD_VRAM (llmft's launcher sets it): torch's max allocated, rank 0, in GiB
    trainer_log = _read_jsonl(work / "trainer_log.jsonl")
    result["peak_vram_allocated_gib"] = (
        max((e.get("vram_allocated", 0) for e in trainer_log), default=0) or None
    )
    if status != "ok":
        result["error"] = (rd / "train.log").read_text()[-3000:]
        result["out_of_memory"] = "out of memory" in result["error"].lower()
    (rd / "result.json").write_text(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return result


def reference_step(cfg_path: Path, cfg: dict, out: Path, record: Path, rd: Path, env: dict) -> dict:
    """`llmft reference-logps` (the workflow's preference_reference) into a store of this benchmark's,
    through run_stage (rd/reference_<leg>.log; a failure is the variant's result), twice: cold (an
    empty store: every sequence computed, the cost a first night pays) and warm (every sequence in the
    store: what a later night with the same reference model and pairs pays)."""
    store = out / "reference_store"
    shutil.rmtree(store, ignore_errors=True)
    record.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "llmft", "reference-logps", "--config", str(cfg_path)]
    cmd += ["--model", cfg["model"]["name_or_path"], "--data-dir", str(out / "data"), "--out", str(record)]
    cmd += ["--store", str(store)]
    result = {}
    for leg in ("cold", "warm"):
        t0 = time.time()
        failed = run_stage(cmd, rd, f"reference_{leg}", env)
        if failed:
            return failed
        result[f"{leg}_s"] = round(time.time() - t0, 1)
        written = json.loads(record.read_text())
        result[leg] = {k: written[k] for k in ("sequences", "computed", "reused", "model", "store")}
    return {"status": "ok", **result}


def with_reference(tps: float, tokens_per_epoch: int, reference_s: float) -> float:
    """Tokens/s of one epoch with the reference step's time counted in it: an epoch's tokens over
    (the epoch's training time at the measured rate + the reference step's wall time)."""
    return tokens_per_epoch / (tokens_per_epoch / tps + reference_s)


def compare(results: dict, pairs: dict, warmup: int = WARMUP) -> dict:
    hand, ours = (results[n].get("tokens_per_s_per_gpu") for n in ("hand", "ours"))
    ratio = round(ours / hand, 3) if hand and ours else None
    print(f"hand-tuned LLaMA-Factory DPO: {hand} tokens/s/GPU ({results['hand']['status']})")
    print(f"llmft's plan:                 {ours} tokens/s/GPU ({results['ours']['status']})")
    print(f"ratio = ours / hand = {ours} / {hand} = {ratio}")
    others = {}
    for name, what in (
        ("resident", "reference_logps: resident"),
        ("padded", "padding_free: false"),
        ("grouped", "group_by_length: true"),
    ):
        tps = results.get(name, {}).get("tokens_per_s_per_gpu")
        if name in results:
            others[name] = round(tps / hand, 3) if hand and tps else None
            print(f"{name} ({what}) / hand = {tps} / {hand} = {others[name]}")
    reference = results["ours"].get("reference")
    if reference and ours and hand:
        tokens = pairs["train_tokens"]
        for leg in ("cold", "warm"):
            tps = with_reference(ours, tokens, reference[f"{leg}_s"])
            others[f"with_reference_{leg}"] = round(tps / hand, 3)
            print(
                f"ours with the {leg} reference step ({reference[f'{leg}_s']} s) in one epoch of "
                f"{tokens} tokens: {round(tps, 1)} / {hand} = {others[f'with_reference_{leg}']}"
            )
    print(
        "tokens/s = (non-padding tokens of both sequences of every pair seen at the last step - at step "
        f"{warmup}) / seconds between them / GPUs; with the reference step: an epoch's tokens / (an "
        "epoch's tokens / tokens/s + the reference step's wall seconds)"
    )
    return {
        "pairs": pairs,
        "variants": results,
        "ratio": ratio,
        **{f"{k}_ratio": v for k, v in others.items()},
    }


def planned(name: str, out: Path, size: str, finetuning: str, cutoff: int, change: dict) -> dict:
    """The planner's verdict on one setting, rendered only: its planned peak, or its refusal."""
    rd = out / f"plan_{name}_m{change['per_device_train_batch_size']}"
    cfg = config_for(name, STEPS, out, size, finetuning, cutoff, change)
    _, rendered, failed = render_variant(rd, cfg, out)
    verdict = {"micro_batch": change["per_device_train_batch_size"]}
    if failed:
        return {**verdict, "refused": failed["error"].strip().splitlines()[-1]}
    plan = rendered["llmft"]["plan"]
    return {**verdict, "planned_peak_gib": plan["memory"]["peak"], "usable_gib": plan["usable_gib"]}


SEARCH_KEYS = (
    "status",
    "out_of_memory",
    "tokens_per_s_per_gpu",
    "predicted_peak_gib",
    "peak_vram_allocated_gib",
)


def fit(out: Path, args) -> tuple[dict, dict]:
    """Each side at the largest micro-batch that fits at args.cutoff, the pairs a step fixed (see the
    module's docstring): (the two sides' runs, the hand-tuned search and the planner's verdicts)."""
    scale = {"size": args.size, "finetuning": args.finetuning, "warmup": args.warmup, "cutoff": args.cutoff}
    batches = [int(m) for m in args.hand_batches.split(",")]
    results, search = {}, {"hand": [], "planner": []}

    def save() -> None:  # after every run: a call cut short keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps({"partial": True, "variants": results, "search": search}))

    tokens = args.pairs_per_step * 2 * args.cutoff
    ours = {"tokens_per_step": tokens, "micro_batch_tokens": tokens}
    for m in sorted({*batches, args.pairs_per_step}):
        change = {**ours, "per_device_train_batch_size": m}
        search["planner"].append(planned("ours", out, args.size, args.finetuning, args.cutoff, change))
    results["ours"] = run_variant("ours", out, args.steps, args.timeout, **scale, change=ours)
    save()
    for m in batches:
        change = {
            "per_device_train_batch_size": m,
            "gradient_accumulation_steps": max(1, args.pairs_per_step // m),
        }
        r = run_variant("hand", out, args.steps, args.timeout, **scale, change=change, folder=f"hand_m{m}")
        search["hand"].append({"micro_batch": m, **{k: r.get(k) for k in SEARCH_KEYS}})
        if r.get("status") != "ok":
            results.setdefault("hand", r)  # none trained: the first failure is the hand side's result
            break
        results["hand"] = r
        save()
    for r in results.values():
        peak, planned_peak = r.get("peak_vram_allocated_gib"), r.get("predicted_peak_gib")
        if peak and planned_peak:
            r["measured_over_planned"] = round(peak / planned_peak, 3)
    return results, search


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pairs", help="write the pairs both variants train on")
    a.add_argument("--out", required=True, help="the benchmark's folder")
    a.add_argument("--rows", type=int, default=2000, help="pairs to write")
    a.add_argument("--size", choices=sorted(SIZES), default="1b", help="whose tokenizer prepares them")
    r = sub.add_parser("run", help="one variant")
    r.add_argument("name", choices=sorted(VARIANTS), help="hand, ours, padded or grouped")
    r.add_argument("--out", required=True, help="the benchmark's folder (pairs already written)")
    r.add_argument("--steps", type=int, default=STEPS, help="optimizer steps to train")
    r.add_argument("--timeout", type=int, default=900, help="seconds before a variant is stopped")
    b = sub.add_parser("all", help="pairs, both variants, the comparison")
    f = sub.add_parser("fit", help="both sides at the largest micro-batch that fits at one cutoff")
    f.add_argument("--cutoff", type=int, default=4096, help="data.cutoff_len (the pairs scale with it)")
    f.add_argument("--pairs-per-step", type=int, default=8, help="pairs per optimizer step, both sides")
    f.add_argument("--hand-batches", default="1,2,4,8", help="the hand-tuned micro-batches tried, in turn")
    for q in (r, b, f):
        q.add_argument("--size", choices=sorted(SIZES), default="1b", help="the model (bench/sft_models.py)")
        q.add_argument(
            "--finetuning", choices=("full", "lora"), default="full", help="preference.finetuning_type"
        )
        q.add_argument("--warmup", type=int, default=WARMUP, help="steps before the throughput window")
    for q in (b, f):
        q.add_argument("--out", required=True, help="the benchmark's folder")
        q.add_argument("--rows", type=int, default=2000, help="pairs to write")
        q.add_argument("--steps", type=int, default=STEPS, help="optimizer steps per variant")
        q.add_argument("--timeout", type=int, default=900, help="seconds before a variant is stopped")
        q.add_argument("--json", default="", help="also write the comparison to this file")
    b.add_argument(
        "--variants", default=",".join(ALL), help=f"which variants, hand and ours first ({','.join(ALL)})"
    )
    args = p.parse_args()
    out = Path(args.out)
    if args.cmd == "pairs":
        write_pairs(out, args.rows)
        print(json.dumps(prepare_pairs(out, args.size)))
        return
    scale = {"size": args.size, "finetuning": args.finetuning, "warmup": args.warmup}
    if args.cmd == "run":
        print(json.dumps(run_variant(args.name, out, args.steps, args.timeout, **scale), indent=2))
    elif args.cmd == "fit":
        write_pairs(out, args.rows, cutoff=args.cutoff)
        pairs = prepare_pairs(out, args.size, args.cutoff)
        results, search = fit(out, args)
        result = {**compare(results, pairs, args.warmup), "cutoff": args.cutoff, "search": search}
        for side in search["planner"]:
            print(
                f"planner, ours at micro-batch {side['micro_batch']}: "
                + (
                    f"{side['planned_peak_gib']} GiB of {side['usable_gib']}"
                    if "planned_peak_gib" in side
                    else f"refused: {side['refused']}"
                )
            )
        for r in search["hand"]:
            print(
                f"hand at micro-batch {r['micro_batch']}: {r['status']}"
                + (" (out of memory)" if r.get("out_of_memory") else "")
            )
        for name, r in results.items():
            print(
                f"{name} at {r.get('plan', {}).get('micro_batch')} pairs x "
                f"{r.get('plan', {}).get('gradient_accumulation')}: "
                f"planned peak {r.get('predicted_peak_gib')} GiB, measured "
                f"{r.get('peak_vram_allocated_gib')} GiB "
                f"(measured / planned {r.get('measured_over_planned')})"
            )
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    else:
        write_pairs(out, args.rows)
        pairs = prepare_pairs(out, args.size)
        names = args.variants.split(",")
        results = {n: run_variant(n, out, args.steps, args.timeout, **scale) for n in names}
        result = compare(results, pairs, args.warmup)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
