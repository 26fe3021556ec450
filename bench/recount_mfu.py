"""The MFU of committed SFT bench results, counted again with llmft.core.flops (the one count the run
page and summary.json use): the output head once, the embedding lookup not counted. Results before 1059f24
counted 6 x every parameter (the embedding table included) + causal attention; the tokens/s, the
attention span and the model shape of each run are what the run recorded, so only the FLOPs per
token change (untied 8 B: -6 %, tied 1.24 B: unchanged).

    python bench/recount_mfu.py bench/results/sft_h200x2_1b_20261201T0218.json ... --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO))  # bench.* as a package, as tests import it

from llmft.core import flops  # noqa: E402
from llmft.core.shape import shape_from_config  # noqa: E402

from bench.sft_models import llama_config  # noqa: E402


def recount(result: dict) -> dict | None:
    """One run's MFU again, from its recorded tokens/s, span and size; None for a run that did not."""
    tps, span, size = (
        result.get("tokens_per_s_per_gpu"),
        result.get("attention_context_tokens"),
        result.get("size"),
    )
    peak = result.get("peak_tflops") or 989.0
    if not tps or span is None or not size:
        return None
    count = flops.per_token(shape_from_config(llama_config(size)), span)
    median = result.get("median_step_tokens_per_s_per_gpu")
    return {
        "tokens_per_s_per_gpu": tps,
        "flops_per_token": round(count.total),
        "mfu_recorded": result.get("mfu"),
        "mfu": round(flops.mfu(tps, count.total, peak), 4),
        "median_step_mfu": round(flops.mfu(median, count.total, peak), 4) if median else None,
    }


CEILING_KEYS = ("mfu_fwd_bwd_only", "mfu_ceiling_step", "gemm_only_mfu", "measured_median_step_mfu")


def recount_ceiling(doc: dict, size: str) -> dict:
    """A compute_ceiling.py result: each MFU times (the count now / the count then) at its span."""
    shape = shape_from_config(llama_config(size))
    span = doc["attention_context_tokens"]
    then = 6.0 * doc["params"] + 6.0 * shape.layers * shape.heads * shape.head_dim * span
    ratio = flops.per_token(shape, span).total / then
    return {k: round(doc[k] * ratio, 4) for k in CEILING_KEYS if doc.get(k)} | {"ratio": round(ratio, 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = {}
    print(f"{'file':42} {'run':16} {'tokens/s/GPU':>12} {'MFU then':>9} {'MFU now':>8} {'median':>7}")
    for path in args.results:
        doc = json.loads(path.read_text())
        if "mfu_ceiling_step" in doc:
            size = "8b" if doc["params"] > 4e9 else "1b"
            out[path.name] = new = recount_ceiling(doc, size)
            print(
                f"{path.name:42} ceiling x{new['ratio']}: "
                + ", ".join(f"{k} {doc[k]:.1%} -> {v:.1%}" for k, v in new.items() if k != "ratio")
            )
            continue
        for name, run in (doc.get("runs") or {}).items():
            new = recount({**run, "peak_tflops": doc.get("peak_tflops")})
            if new is None:
                continue
            out.setdefault(path.name, {})[name] = new
            median = f"{new['median_step_mfu']:.1%}" if new["median_step_mfu"] else ""
            print(
                f"{path.name:42} {name:16} {new['tokens_per_s_per_gpu']:>12,.1f} "
                f"{new['mfu_recorded']:>9.1%} {new['mfu']:>8.1%} {median:>7}"
            )
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "runs": out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
