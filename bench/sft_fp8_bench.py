"""FP8 benchmark report: the FP8 variants of bench/sft_bench.py, run by bench/sft_fp8_gpu.sh on
one H200, against bf16 and the hand-tuned runs, each comparison from runs of one device call.

    python bench/sft_fp8_bench.py report OUT --json RESULT.json   # ratios, TFLOP/s, MFU, accuracy

Throughput ratios are tokens/s per GPU (steady state, sft_bench.summarise) of one run over another,
printed with their formula. Achieved TFLOP/s = tokens/s per GPU x training FLOPs per token
(llmft.core.flops, the count the run page uses) / 1e12. MFU is counted against the GPU's bf16 dense
peak (989 TFLOP/s on an H200) whatever precision the matmuls ran in, so FP8 runs compare with bf16
runs on one scale. Accuracy: the final training loss (mean of the last 10 logged steps) and the last
held-out loss of FP8 against bf16 after 300 steps, relative difference, pass within 1 %. Which layers
ran in float8 is read from each run's llmft_fp8.json (counted on the model that trained).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sft_bench as B  # noqa: E402

# (what, numerator run, denominator run, target ratio or None)
SPEED = [
    ("LoRA 1.24 B: llmft auto / hand-tuned LoRA bf16", "fp8_lora_auto_1b", "fp8_lora_hand_1b", 1.3),
    ("LoRA 1.24 B: llmft auto / LLaMA-Factory fp8: true", "fp8_lora_auto_1b", "fp8_lora_lf_1b", 1.3),
    ("LoRA 8 B: llmft auto / hand-tuned LoRA bf16", "fp8_lora_auto_8b", "fp8_lora_hand_8b", 1.3),
    (
        "LoRA 8 B, logging every 10 steps: llmft auto / hand-tuned LoRA bf16",
        "fp8_lora_auto_8b_log10",
        "fp8_lora_hand_8b_log10",
        1.3,
    ),
    ("LoRA 8 B: llmft auto / LLaMA-Factory fp8: true", "fp8_lora_auto_8b", "fp8_lora_lf_8b", 1.3),
    ("LoRA 8 B: FP8 / llmft's bf16 plan, both compiled", "fp8_lora_py_8b", "lora_compile_8b", None),
    ("LoRA 8 B: llmft auto / llmft's bf16 plan (fp8: false)", "fp8_lora_auto_8b", "fp8_lora_bf16_8b", None),
    ("LoRA 8 B: FP8 without DeepSpeed / FP8 with ZeRO-2 (pinned)", "fp8_lora_z0_8b", "fp8_lora_py_8b", None),
    ("LoRA 8 B: FP8 without DeepSpeed / hand-tuned bf16", "fp8_lora_z0_8b", "fp8_lora_hand_8b", None),
    ("LoRA 8 B: FP8 with ZeRO-2 (pinned) / hand-tuned LoRA bf16", "fp8_lora_py_8b", "fp8_lora_hand_8b", None),
    ("LoRA 8 B: FP8, frozen weights cast once / torchao's casts", "fp8_lora_py_8b", "fp8_lora_ao_8b", None),
    ("LoRA 8 B: llmft auto (cast once) / torchao's casts", "fp8_lora_auto_8b", "fp8_lora_ao_8b", None),
    (
        "LoRA 8 B: llmft auto, tokens counted on the host / read from the GPU",
        "fp8_lora_auto_8b",
        "fp8_lora_devcount_8b",
        None,
    ),
    ("LoRA 8 B: llmft auto, llmft's fused loss / Liger's", "fp8_lora_auto_8b", "fp8_lora_ligerce_8b", None),
    (
        "LoRA 1.24 B: llmft auto, llmft's fused loss / Liger's",
        "fp8_lora_auto_1b",
        "fp8_lora_ligerce_1b",
        None,
    ),
    ("LoRA 8 B: FP8, torchao's casts / hand-tuned LoRA bf16", "fp8_lora_ao_8b", "fp8_lora_hand_8b", None),
    ("LoRA 1.24 B: bf16 compiled, no DeepSpeed / ZeRO-2", "lora_compile0_1b", "lora_compile_1b", None),
    ("LoRA 1.24 B: FP8 / bf16, both without DeepSpeed", "fp8_lora_z0_1b", "lora_compile0_1b", None),
    ("LoRA 1.24 B: FP8 without DeepSpeed / hand-tuned bf16", "fp8_lora_z0_1b", "fp8_lora_hand_1b", None),
    ("LoRA 1.24 B: bf16 without DeepSpeed / hand-tuned bf16", "lora_compile0_1b", "fp8_lora_hand_1b", None),
    ("LoRA 1.24 B: bf16 with ZeRO-2 / hand-tuned LoRA bf16", "lora_compile_1b", "fp8_lora_hand_1b", None),
    ("full 1.24 B bf16 plan: llmft's fused loss / Liger's", "fp8_full_fusedce_1b", "fp8_full_bf16_1b", None),
    ("full 1.24 B: llmft auto / hand-tuned bf16", "fp8_full_auto_1b", "fp8_full_hand_1b", 1.6),
    ("full 1.24 B: llmft auto / llmft's own bf16 plan", "fp8_full_auto_1b", "fp8_full_bf16_1b", 1.2),
    ("full 1.24 B compiled: FP8 / bf16 plan", "fp8_full_compile_1b", "fp8_full_bf16_1b", 1.2),
    ("full 1.24 B: FP8 compiled / bf16 compiled", "fp8_full_compile_1b", "fp8_full_bf16c_1b", None),
    ("full 1.24 B, profiled: FP8 compiled / bf16 compiled", "fp8_full_prof_1b", "full_bf16c_prof_1b", None),
    (
        "full 1.24 B, one shape: FP8 compiled / llmft's bf16 plan",
        "fp8_full_static_1b",
        "fp8_full_bf16_1b",
        1.2,
    ),
    (
        "full 1.24 B, one shape: FP8 compiled / bf16 compiled",
        "fp8_full_static_1b",
        "full_bf16c_static_1b",
        None,
    ),
    (
        "full 1.24 B, one shape, kernels tuned: FP8 compiled / llmft's bf16 plan",
        "fp8_full_static_cdt_1b",
        "fp8_full_bf16_1b",
        1.2,
    ),
    ("full 1.24 B, 16k tokens a step: llmft auto / hand-tuned bf16", "full_auto_1b", "fp8_full_hand_1b", 1.6),
    (
        "full 1.24 B, 16k tokens a step: llmft auto / hand-tuned bf16 with Liger",
        "full_auto_1b",
        "full_handliger_1b",
        1.6,
    ),
    ("full 1.24 B, 16k tokens a step: llmft auto / bf16 plan", "full_auto_1b", "full_bf16_1b", 1.2),
    ("LoRA 1.24 B: one shape, tuned kernels / the auto plan", "lora_static_1b", "fp8_lora_auto_1b", None),
    ("LoRA 8 B: one shape, tuned kernels / the auto plan", "lora_static_8b", "fp8_lora_auto_8b", None),
]
ACCURACY = [
    ("full", "acc_full_fp8_1b", "acc_full_bf16_1b"),
    ("LoRA", "acc_lora_fp8_1b", "acc_lora_bf16_1b"),
    ("full, every key auto", "acc_full_auto_1b", "acc_full_bf16_1b"),
    ("LoRA, every key auto", "acc_lora_auto_1b", "acc_lora_bf16_1b"),
]
ACCURACY_TOL = 0.01
LAST_STEPS = 10


def fp8_layers(out: Path, name: str) -> str:
    """What the run's training entry counted in float8, or why there is no count."""
    path = out / name / "llmft_fp8.json"
    return json.loads(path.read_text())["summary"] if path.exists() else "no float8 layers (bf16)"


def losses(out: Path, name: str) -> tuple[float | None, float | None]:
    """(mean training loss of the last LAST_STEPS logged steps, last held-out loss)."""
    log = B._read_jsonl(out / name / "trainer_log.jsonl")
    train = [e["loss"] for e in log if "loss" in e][-LAST_STEPS:]
    held = [e["eval_loss"] for e in log if e.get("eval_loss") is not None]
    return (sum(train) / len(train) if train else None), (held[-1] if held else None)


def _rel(a, b):
    return None if a is None or b in (None, 0) else abs(a - b) / abs(b)


def report(out: Path, json_path: Path | None) -> dict:
    lengths = json.loads((B.WORK / "lengths.json").read_text())
    names = {n for _, a, b, _ in SPEED for n in (a, b)} | {n for _, a, b in ACCURACY for n in (a, b)}
    runs = {n: B.summarise(out, n, lengths) for n in sorted(names) if (out / n).exists()}
    for name, r in runs.items():
        r["fp8_layers"] = fp8_layers(out, name)
        if r.get("tokens_per_s_per_gpu"):
            r["achieved_tflops"] = round(r["tokens_per_s_per_gpu"] * r["flops_per_token"] / 1e12, 1)
    lines = ["| run | tokens/s/GPU | achieved TFLOP/s | MFU (bf16 dense peak) | peak GiB | float8 layers |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in runs.items():
        lines.append(
            f"| {name} | {r.get('tokens_per_s_per_gpu', r.get('status'))} | {r.get('achieved_tflops')} | "
            f"{r.get('mfu')} | {r.get('peak_vram_allocated_gib')} | {r['fp8_layers']} |"
        )
    speed = []
    for what, a, b, target in SPEED:
        ta, tb = (runs.get(n, {}).get("tokens_per_s_per_gpu") for n in (a, b))
        ratio = round(ta / tb, 3) if ta and tb else None
        met = None if ratio is None or target is None else ratio >= target
        speed.append({"what": what, "formula": f"{a} / {b} = {ta} / {tb}", "ratio": ratio, "target": target,
                      "met": met})  # fmt: skip
        lines.append(f"{what}: {a} / {b} = {ta} / {tb} = {ratio}x (target >= {target}x: {met})")
    accuracy = []
    for kind, f, b in ACCURACY:
        (tf, hf), (tb, hb) = losses(out, f), losses(out, b)
        dt, dh = _rel(tf, tb), _rel(hf, hb)
        ok = None if None in (dt, dh) else dt <= ACCURACY_TOL and dh <= ACCURACY_TOL
        accuracy.append({"kind": kind, "fp8": f, "bf16": b, "train_loss": [tf, tb], "heldout_loss": [hf, hb],
                         "train_rel": dt, "heldout_rel": dh, "within_1_percent": ok})  # fmt: skip
        lines.append(
            f"accuracy {kind} (300 steps): final train loss |{tf} - {tb}| / {tb} = {dt}, held-out "
            f"|{hf} - {hb}| / {hb} = {dh} (within {ACCURACY_TOL:.0%}: {ok})"
        )
    print("\n".join(lines))
    result = {"runs": runs, "speed": speed, "accuracy": accuracy, "table": lines,
              "mfu_note": "MFU against the bf16 dense peak (hardware.py), FP8 runs included"}  # fmt: skip
    if json_path:
        json_path.write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(prog="python bench/sft_fp8_bench.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("report", help="ratios, TFLOP/s, MFU and the accuracy check of the FP8 runs in OUT")
    p.add_argument("out", type=Path, help="the bench output folder (bench/sft_gpu.sh's BENCH_OUT)")
    p.add_argument("--json", type=Path, help="write the result here")
    args = ap.parse_args()
    report(args.out, args.json)


if __name__ == "__main__":
    main()
