"""Render every performance and accuracy figure that README.md, docs/ and config/README.md quote, from
the result files in bench/results, so that no figure is typed by hand or quoted two ways.

A rendered table sits between `<!-- table:NAME -->` and `<!-- /table -->`; this script replaces what is
between them with what TABLES[NAME] makes from its files. tests/unit/repo/test_rendered_tables.py fails
when a committed copy differs from a fresh rendering.

    python bench/render_tables.py           # rewrite every marked table in place
    python bench/render_tables.py --check   # exit 1 naming each stale table, change nothing

How each figure is computed (one way each):
- tokens/s per GPU: the run's `tokens_per_s_per_gpu` in its result file, the bench's count over its
  measured steps (tokens fed ÷ seconds of those steps ÷ GPUs);
- MFU: the run's `mfu` (tokens/s per GPU × training FLOPs per token ÷ the GPU's dense bf16 peak,
  `workflow/llmft/core/flops.py`, `core/hardware.py`); for the 2 × H200 runs the recount in
  `mfu_recount_cpu2_20261201.json` (the same formula, applied after the runs);
- a ratio: llmft's figure ÷ the baseline's figure from the same file (the same device call);
- minutes: seconds ÷ 60, to one decimal.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
# The files whose marked tables this script owns.
DOCS = ("README.md", "config/README.md", "docs/*.md")
MARK = re.compile(r"<!-- table:([a-z0-9-]+) -->\n(.*?)<!-- /table -->", re.S)

# The result files each table reads (paths under bench/results).
SFT_2X_1B = "sft_h200x2_1b_20261201T0218.json"
SFT_2X_8B = "sft_h200x2_8b_20261201T0218.json"
MFU_RECOUNT = "mfu_recount_cpu2_20261201.json"
FP8_FULL_AUTO = "sft_fp8_h200x1_full1b_auto_20261207.json"
FP8_ACC_AUTO = "sft_fp8_h200x1_acc_auto_20261207.json"
FP8_LORA = "sft_fp8_h200x1_lora8b.json"
FP8_ACC_FULL = "sft_fp8_h200x1_acc_full.json"
FP8_ACC_LORA = "sft_fp8_h200x1_acc_lora.json"
DPO_1B = "dpo_h200x1_1b_padfree.json"
DPO_1B_CACHED = "dpo_h100x1_1b_warm_20261207.json"
DPO_8B_LORA = "dpo_h100x1_8b_lora_20261207.json"
BENCH_BACKEND = ("benchmarks_h200x1_float32.json", "benchmarks_h200x1_bfloat16.json")
CONTINUE_CPU = (
    "continue_cpu2_20261205_cosine_lr5e4_guard_seed1.json",
    "continue_cpu2_20261205_cosine_lr5e4_guard_seed2.json",
)
FUSEDCE_TRACE = "sft_fp8_h200x1_ce1b_prof_trace.json.gz"
SUITE = "suite_timings.json"
DEMO = "demo_timings.json"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def num(x: float, digits: int = 0) -> str:
    """12345.6 -> '12 346' (a space between thousands, as the docs write numbers)."""
    return f"{x:,.{digits}f}".replace(",", " ")


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×"


def signed(x: float) -> str:
    """+0.0012, −0.0012; never −0.0000."""
    s = f"{x:+.4f}"
    return "+0.0000" if s == "-0.0000" else s.replace("-", "−")


def src(*names: str) -> str:
    return ", ".join(f"`{n}`" for n in names)


def row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def sft_cell(run: dict, mfu: float | None = None) -> str:
    mfu = run.get("mfu") if mfu is None else mfu
    return (
        f"{num(run['tokens_per_s_per_gpu'])} ({pct(mfu)} MFU)"
        if mfu is not None
        else num(run["tokens_per_s_per_gpu"])
    )


def performance() -> str:
    """README's performance table: llmft's plan against the plain tool, each pair from one device call."""
    recount = load(MFU_RECOUNT)["runs"]
    lines = [
        row("what (tokens/s per GPU, MFU)", "llmft's plan", "baseline, same call", "ratio", "file"),
        "|---|---|---|---|---|",
    ]
    for name, size, label in ((SFT_2X_1B, "1b", "1.24 B"), (SFT_2X_8B, "8b", "8 B")):
        runs, mfu = load(name)["runs"], recount[name]
        ours, hand = runs[f"ours_{size}"], runs[f"hand_{size}"]
        lines.append(
            row(
                f"full SFT {label}, 2 × H200, every key `auto`",
                sft_cell(ours, mfu[f"ours_{size}"]["mfu"]),
                f"best hand-tuned LLaMA-Factory: {sft_cell(hand, mfu[f'hand_{size}']['mfu'])}",
                ratio(ours["tokens_per_s_per_gpu"], hand["tokens_per_s_per_gpu"]),
                src(name, MFU_RECOUNT),
            )
        )
    runs = load(FP8_FULL_AUTO)["runs"]
    auto = runs["full_auto_1b"]
    for key, label in (
        ("full_handliger_1b", "best hand-tuned LLaMA-Factory (Liger's kernels)"),
        ("full_bf16_1b", "llmft's bf16 plan"),
    ):
        base = runs[key]
        lines.append(
            row(
                "full SFT 1.24 B, 1 × H200, every key `auto` (FP8)",
                sft_cell(auto),
                f"{label}: {sft_cell(base)}",
                ratio(auto["tokens_per_s_per_gpu"], base["tokens_per_s_per_gpu"]),
                src(FP8_FULL_AUTO),
            )
        )
    runs = load(FP8_LORA)["runs"]
    for size, label in (("1b", "1.24 B"), ("8b", "8 B")):
        ours, hand = runs[f"fp8_lora_auto_{size}"], runs[f"fp8_lora_hand_{size}"]
        lines.append(
            row(
                f"LoRA {label}, 1 × H200, FP8",
                sft_cell(ours),
                f"hand-tuned bf16 LoRA on LLaMA-Factory's kernels: {sft_cell(hand)}",
                ratio(ours["tokens_per_s_per_gpu"], hand["tokens_per_s_per_gpu"]),
                src(FP8_LORA),
            )
        )
    for name, what in (
        (DPO_1B, "DPO 1.24 B, 1 × H200 (peak memory)"),
        (DPO_1B_CACHED, "DPO 1.24 B, 1 × H100, reference log-probabilities cached (peak memory)"),
        (DPO_8B_LORA, "LoRA DPO 8 B, 1 × H100, reference log-probabilities cached (peak memory)"),
    ):
        dpo = load(name)["variants"]
        ours, hand = dpo["ours"], dpo["hand"]
        lines.append(
            row(
                what,
                f"{num(ours['tokens_per_s_per_gpu'])} ({ours['peak_vram_allocated_gib']:.1f} GiB)",
                f"hand-tuned LLaMA-Factory DPO: {num(hand['tokens_per_s_per_gpu'])} "
                f"({hand['peak_vram_allocated_gib']:.1f} GiB)",
                ratio(ours["tokens_per_s_per_gpu"], hand["tokens_per_s_per_gpu"]),
                src(name),
            )
        )
    return "\n".join(lines)


def fp8_speed() -> str:
    """docs/fp8.md: FP8 against bf16, full and LoRA, one H200."""
    full = load(FP8_FULL_AUTO)["runs"]
    lora = load(FP8_LORA)["runs"]
    lines = [
        row("run (one H200)", "tokens/s per GPU", "MFU (bf16 peak)", "float8 layers", "file"),
        "|---|---|---|---|---|",
    ]
    named = (
        (
            full,
            "full_auto_1b",
            "full 1.24 B, every key `auto` (FP8: compiled, one shape, tuned kernels)",
            FP8_FULL_AUTO,
        ),
        (full, "full_bf16_1b", "full 1.24 B, llmft's bf16 plan", FP8_FULL_AUTO),
        (full, "full_handliger_1b", "full 1.24 B, hand-tuned bf16 with Liger's kernels", FP8_FULL_AUTO),
        (full, "fp8_full_hand_1b", "full 1.24 B, hand-tuned bf16 without Liger", FP8_FULL_AUTO),
        (lora, "fp8_lora_auto_1b", "LoRA 1.24 B, every key `auto` (FP8)", FP8_LORA),
        (lora, "fp8_lora_lf_1b", "LoRA 1.24 B, LLaMA-Factory's `fp8: true` (runs bf16)", FP8_LORA),
        (lora, "fp8_lora_hand_1b", "LoRA 1.24 B, hand-tuned bf16", FP8_LORA),
        (lora, "fp8_lora_auto_8b", "LoRA 8 B, every key `auto` (FP8)", FP8_LORA),
        (lora, "fp8_lora_lf_8b", "LoRA 8 B, LLaMA-Factory's `fp8: true` (runs bf16)", FP8_LORA),
        (lora, "fp8_lora_hand_8b", "LoRA 8 B, hand-tuned bf16", FP8_LORA),
    )
    for runs, key, label, name in named:
        r = runs[key]
        lines.append(row(label, num(r["tokens_per_s_per_gpu"]), pct(r["mfu"]), r["fp8_layers"], src(name)))
    return "\n".join(lines)


def fp8_accuracy() -> str:
    """docs/fp8.md: FP8 against bf16 from the same seed, final losses."""
    lines = [
        row(
            "training (1.24 B, 300 steps, one H200)",
            "train loss FP8 / bf16",
            "held-out loss FP8 / bf16",
            "relative difference (train; held-out)",
            "file",
        ),
        "|---|---|---|---|---|",
    ]
    accuracy = ((FP8_ACC_FULL, "full"), (FP8_ACC_LORA, "LoRA"), (FP8_ACC_AUTO, "full, every key auto"))
    for name, kind in accuracy:
        acc = next(a for a in load(name)["accuracy"] if a["kind"] == kind)
        lines.append(
            row(
                kind.replace("every key auto", "every key `auto`"),
                " / ".join(f"{x:.4f}" for x in acc["train_loss"]),
                " / ".join(f"{x:.4f}" for x in acc["heldout_loss"]),
                f"{100 * acc['train_rel']:.3f} %; {100 * acc['heldout_rel']:.3f} %",
                src(name),
            )
        )
    return "\n".join(lines)


def continue_cpu() -> str:
    """docs/nightly.md: a continued night against a retrain, on the CPU, the config the docs recommend."""
    lines = [
        row(
            "seed",
            "variant",
            "exact match: night1 / retrain / continued",
            "retrain − continued (one-sided 95 % upper bound)",
            "fewer tokens than the retrain",
            "file",
        ),
        "|---|---|---|---|---|---|",
    ]
    for name in CONTINUE_CPU:
        d = load(name)
        for variant, label in (("default", "replay 0.25"), ("r9e4", "replay 0.9, 4 epochs")):
            s = d["summary"][variant]
            em = s["mean_exact_match"]
            cont = next(v for k, v in em.items() if k.startswith("continue"))
            paired = s["paired"]
            lines.append(
                row(
                    str(d["seeds"][0]),
                    label,
                    f"{em['night1']:.4f} / {em['retrain']:.4f} / {cont:.4f}",
                    f"{signed(paired['gap'])} ({signed(paired['high_95'])})",
                    f"{s['token_ratio']['mean']:.2f}×",
                    src(name),
                )
            )
    return "\n".join(lines)


def bench_backend() -> str:
    """docs/benchmarks.md: llmft's lm-eval backend against lm-eval's `hf`, one H200, 1.24 B."""
    lines = [
        row(
            "dtype",
            "multiple choice (1 000): llmft / hf s",
            "generation (200 × 128 tokens): llmft / hf s",
            "speed-up (mc; gen)",
            "same outputs (mc; gen)",
            "peak GiB llmft / hf",
            "file",
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for name in BENCH_BACKEND:
        d = load(name)
        s = d["seconds"]
        mc, gen = s["hf"]["bench_mc"] / s["llmft"]["bench_mc"], s["hf"]["bench_gen"] / s["llmft"]["bench_gen"]
        lines.append(
            row(
                d["dtype"],
                f"{s['llmft']['bench_mc']:.2f} / {s['hf']['bench_mc']:.2f}",
                f"{s['llmft']['bench_gen']:.2f} / {s['hf']['bench_gen']:.2f}",
                f"{mc:.2f}×; {gen:.2f}×",
                f"{d['mc_same_choice']}; {d['gen_identical']}",
                f"{d['peak_gib']['llmft']:.2f} / {d['peak_gib']['hf']:.2f}",
                src(name),
            )
        )
    return "\n".join(lines)


def gpu_busy() -> str:
    """docs/fp8.md: how busy the GPU was over one profiled step (bench/trace_gaps.py's count)."""
    sys.path.insert(0, str(REPO / "bench"))
    import trace_gaps

    with contextlib.redirect_stdout(io.StringIO()):  # report() prints its findings too
        out = trace_gaps.report(RESULTS / FUSEDCE_TRACE, min_ms=1.0)
    busy = 100 * out["busy_ms"] / out["span_ms"]
    return (
        f"On a profiled 1.24 B LoRA step with llmft's own fused loss the GPU was busy {busy:.1f} % of the "
        f"step ({out['busy_ms']:.1f} of {out['span_ms']:.1f} ms: `python bench/trace_gaps.py "
        f"bench/results/{FUSEDCE_TRACE}`)."
    )


def suite_time() -> str:
    """The `make test` line: the latest clean-clone run, and the range over the recorded ones."""
    runs = [r for r in load(SUITE)["runs"] if r["machine"] == "cpu2"]
    latest = max(runs, key=lambda r: r["commit_date"])
    calm = [r["seconds"] for r in runs if r["load"] in ("idle", "light")]
    secs, passed = latest["seconds"], latest["passed"]
    return (
        "`make test` on a clean clone (`/usr/bin/time -v .ci/run` on a fresh `git clone`, a 2-core, "
        f"24 GiB machine): **{secs / 60:.1f} min** ({num(secs)} s, {num(passed)} passed, "
        + (f"{latest['failed']} failed, " if latest.get("failed") else "")
        + f"{latest['skipped']} skipped) at {latest['commit']} ({latest['commit_date'][:10]}, "
        f"{latest['load']}); {min(calm) / 60:.1f}–{max(calm) / 60:.1f} min over the {len(calm)} "
        f"recorded runs on that machine with nothing heavy beside them (`bench/results/{SUITE}`)."
    )


def demo_time() -> str:
    """The `make demo` line: the latest recorded figure."""
    latest = max(load(DEMO)["runs"], key=lambda r: r["commit_date"])
    approx = "~" if latest.get("approximate") else ""
    pipeline, setup = num(latest["pipeline_seconds"]), num(latest["setup_seconds"])
    return (
        f"`make demo` prints its own time. The latest recorded: {approx}{pipeline} s for the pipeline "
        f"once `.venv` is set up ({approx}{setup} s of set-up before it), at {latest['commit']} "
        f"({latest['commit_date'][:10]}, {latest['machine_words']}; `bench/results/{DEMO}`)."
    )


TABLES: dict[str, Callable[[], str]] = {
    "performance": performance,
    "fp8-speed": fp8_speed,
    "fp8-accuracy": fp8_accuracy,
    "continue-cpu": continue_cpu,
    "bench-backend": bench_backend,
    "gpu-busy": gpu_busy,
    "suite-time": suite_time,
    "demo-time": demo_time,
}


def doc_files() -> list[Path]:
    files: list[Path] = []
    for pattern in DOCS:
        files.extend(sorted(REPO.glob(pattern)))
    return files


def render(text: str) -> str:
    """The text with every marked table rendered afresh; an unknown table name is an error."""

    def fresh(m: re.Match) -> str:
        name = m.group(1)
        if name not in TABLES:
            raise KeyError(f"unknown table {name!r} (known: {', '.join(TABLES)})")
        return f"<!-- table:{name} -->\n{TABLES[name]()}\n<!-- /table -->"

    return MARK.sub(fresh, text)


def stale() -> list[str]:
    """'file: table' for each marked table whose committed copy differs from a fresh rendering."""
    out = []
    for path in doc_files():
        text = path.read_text()
        for m in MARK.finditer(text):
            if render(m.group(0)) != m.group(0):
                out.append(f"{path.relative_to(REPO)}: {m.group(1)}")
    return out


def main(argv: list[str]) -> int:
    if "--check" in argv:
        bad = stale()
        for line in bad:
            print(f"stale: {line} (python bench/render_tables.py)")
        return 1 if bad else 0
    for path in doc_files():
        text = path.read_text()
        new = render(text)
        if new != text:
            path.write_text(new)
            print(f"rendered {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
