"""How far honest and wrong kernels move the canary's loss curve, in one precision on this machine.

    python bench/canary_spread.py [--precision bf16] [--device cpu]

Prints, for each variant of the canary's default path (SDPA, transformers' RMSNorm, AdamW), the
distances llmft.env.canary can gate on against the default path's curve: the mean relative distance of
the loss curves (what the gate uses), the worst single step, the last ten steps, and the final
gradient norm. The honest variants are the plain references (math attention in fp32, a plain
RMSNorm, a for-loop AdamW, fp32); the wrong ones are the test-only perturbations (a 3 % wrong
attention output, a 1.5x RMSNorm input gradient).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from llmft.env.canary import CanaryPath, deviation, train  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    base = CanaryPath("sdpa", False, False, args.precision, "foreach" if args.device == "cpu" else "fused")
    ref = train(base, args.device)
    variants = {
        "honest: math attention (fp32)": (base.reference("attention"), ""),
        "honest: plain RMSNorm": (base.reference("fused"), ""),
        "honest: for-loop AdamW": (base.reference("optimizer"), ""),
        "honest: fp32": (base.reference("precision"), ""),
        "wrong: attention output +3 %": (base, "attention"),
        "wrong: RMSNorm input gradient x1.5": (base, "rmsnorm_grad"),
    }
    rows = {}
    for name, (path, perturb) in variants.items():
        r = train(path, args.device, perturb)
        a, b = r["losses"], ref["losses"]
        rows[name] = {
            "mean_rel": round(deviation(a, b), 4),
            "worst_step_rel": round(max(abs(x - y) / y for x, y in zip(a, b, strict=False)), 4),
            "last10_rel": round(abs(sum(a[-10:]) - sum(b[-10:])) / sum(b[-10:]), 4),
            "grad_norm_rel": round(abs(r["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"], 4),
        }
        print(f"{name:40s} {rows[name]}")
    print(json.dumps({"precision": args.precision, "device": args.device, "rows": rows}))


if __name__ == "__main__":
    main()
