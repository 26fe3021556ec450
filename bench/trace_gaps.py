"""Where the GPU waits: GPU busy and idle time in a torch.profiler timeline (llmft_trace_rank<R>.json.gz,
written by LLMFT_PROFILE_STEPS), and the host operators that ran while it waited.

    python bench/trace_gaps.py TRACE.json.gz [--min-ms 1]

busy = the union of the GPU activities' intervals (kernels, copies, memsets); idle = span - busy,
span = first GPU activity start to last end. A gap is an interval of the span with no GPU activity;
for each gap of at least --min-ms its longest overlapping host operators are listed (their name,
thread and the part of them inside the gap). Host operators that took at least --min-ms on the host
are summed by name.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

GPU = ("kernel", "gpu_memcpy", "gpu_memset")
HOST = ("cpu_op", "user_annotation", "cuda_runtime")


def load(path: Path) -> list[dict]:
    raw = path.read_bytes()
    data = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
    return [e for e in data["traceEvents"] if e.get("ph") == "X"]


def busy_and_gaps(events: list[dict]) -> tuple[float, float, list[tuple[float, float]]]:
    """(span, busy, gaps as (start, end)) of the GPU activities, in microseconds."""
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU)
    if not gpu:
        return 0.0, 0.0, []
    busy, gaps = 0.0, []
    start, end = gpu[0]
    for s, e in gpu[1:]:
        if s > end:
            busy += end - start
            gaps.append((end, s))
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return end - gpu[0][0], busy, gaps


def report(path: Path, min_ms: float) -> dict:
    events = load(path)
    span, busy, gaps = busy_and_gaps(events)
    host = [e for e in events if e.get("cat") in HOST]
    t0 = min((e["ts"] for e in events if e.get("cat") in GPU), default=0)
    long_gaps = sorted((g for g in gaps if g[1] - g[0] >= min_ms * 1e3), key=lambda g: g[0] - g[1])
    print(f"{path}: GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms ({busy / span:.1%}), "
          f"idle {(span - busy) / 1e3:.1f} ms in {len(gaps)} gaps; {len(long_gaps)} gaps >= {min_ms} ms "
          f"hold {sum(b - a for a, b in long_gaps) / 1e3:.1f} ms")  # fmt: skip
    for a, b in long_gaps[:20]:
        inside = [
            (min(e["ts"] + e["dur"], b) - max(e["ts"], a), e)
            for e in host
            if e["ts"] < b and e["ts"] + e["dur"] > a
        ]
        inside.sort(key=lambda x: -x[0])
        names = ", ".join(f"{e['name'][:48]} (tid {e.get('tid')}, {d / 1e3:.2f})" for d, e in inside[:3])
        print(f"  gap {(b - a) / 1e3:6.2f} ms at +{(a - t0) / 1e3:7.1f} ms: {names}")
    slow = collections.defaultdict(list)
    for e in host:
        if e.get("cat") == "cpu_op" and e["dur"] >= min_ms * 1e3:
            slow[e["name"]].append(e["dur"])
    print(f"host operators of >= {min_ms} ms (count, total ms):")
    for name, durs in sorted(slow.items(), key=lambda kv: -sum(kv[1]))[:12]:
        print(f"  {name[:70]}: {len(durs)}, {sum(durs) / 1e3:.1f}")
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
            "gaps": len(gaps), "long_gaps": len(long_gaps)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(prog="python bench/trace_gaps.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument(
        "--min-ms", type=float, default=1.0, help="list gaps and host operators at least this long"
    )
    args = ap.parse_args()
    report(args.trace, args.min_ms)


if __name__ == "__main__":
    main()
