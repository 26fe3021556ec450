"""A run's recorded software stack, edited: what a promoted run made on another stack looks like to the
next night's stack quarantine (tests/workflow/test_quarantine.py, tests/slurm/test_nightly.py)."""

from __future__ import annotations

import json
from pathlib import Path

from llmft.core import stack as stack_fp


def record_another_stack(run_dir: Path, **components) -> dict:
    """Make `run_dir`'s recorded stack (its report/summary.json and env/verify.json `stack`) the one it
    recorded with `components` (e.g. torch="2.12.0+cpu") on every node; the edited stack."""
    summary = json.loads((run_dir / "report/summary.json").read_text())
    fp = {**summary["stack"]["fingerprint"], **components}
    recorded = stack_fp.run_fingerprint({h: fp for h in summary["stack"]["nodes"]})
    (run_dir / "report/summary.json").write_text(json.dumps({**summary, "stack": recorded}))
    verify = json.loads((run_dir / "env/verify.json").read_text())
    (run_dir / "env/verify.json").write_text(json.dumps({**verify, "stack": recorded}))
    return recorded
