"""bench/trace_gaps.py: GPU busy time is the union of overlapping GPU intervals, idle the rest of the
span, and the committed FP8 profile timeline gives the figures bench/README.md states."""

import gzip
import json

from bench import trace_gaps as tg
from tests.conftest import REPO


def test_busy_is_the_union_of_gpu_intervals(tmp_path):
    events = [
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 5, "dur": 10},  # overlaps a: counted once
        {"ph": "X", "cat": "gpu_memcpy", "name": "c", "ts": 40, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 14, "dur": 30},  # the host, not the GPU
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 20},  # not a complete event
    ]
    span, busy, gaps = tg.busy_and_gaps([e for e in events if e["ph"] == "X"])
    assert (span, busy, gaps) == (50, 25, [(15, 40)])
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    out = tg.report(path, min_ms=0.02)
    assert out["idle_ms"] == 0.025 and out["long_gaps"] == 1


def test_the_committed_fp8_timeline_matches_the_readme():
    out = tg.report(REPO / "bench/results/sft_fp8_h200x1_proffp8_trace.json.gz", min_ms=1.0)
    assert round(out["span_ms"], 1) == 808.3 and round(out["busy_ms"], 1) == 688.9
    assert out["long_gaps"] == 29
    assert "busy for 688.9 ms (85.2 %) and idle for 119.4 ms" in (REPO / "bench/README.md").read_text()


def test_the_timeline_without_the_loss_read_matches_the_readme():
    """The 8 B step of 856be52 with llmft's fused loss: the figures bench/README.md and README.md state."""
    out = tg.report(REPO / "bench/results/sft_fp8_h200x1_ce1b_prof_trace.json.gz", min_ms=1.0)
    assert round(out["span_ms"], 1) == 789.8 and round(out["busy_ms"], 1) == 717.3
    assert round(100 * out["busy_ms"] / out["span_ms"], 1) == 90.8 and out["long_gaps"] == 16
    for doc in ("docs/fp8.md", "bench/README.md"):
        assert "90.8 %" in (REPO / doc).read_text()
