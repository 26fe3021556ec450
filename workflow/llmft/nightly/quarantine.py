"""The nightly's side of the stack quarantine (nightly.on_stack_change): what it hands the night's
verify_env, and what it does with the verdict verify_env wrote.

Before snakemake: the stacks that already passed a quarantine against the promoted run's recorded
stack (results/nightly/state.json `quarantine_passes`) go into the night's config
(nightly.quarantine_passed), so verify_env does not quarantine them again. After it: verify_env's
`quarantine` (verify.json, or verify.failed.json when it stopped the night) is the night's `stack`
entry; a pass is recorded in the state, a failure or refusal refuses the night naming the check, the
numbers and the stack difference, and results/current is left as it was.
"""

from __future__ import annotations

from pathlib import Path

from llmft.core import quarantine as decisions
from llmft.core.io import read_json


def passed_stacks(results: Path, state: dict, promoted: str | None) -> list[str]:
    """nightly.quarantine_passed for tonight: the stacks that passed against the promoted run's."""
    if not promoted:
        return []
    recorded = decisions.promoted_stack(results / promoted)
    return decisions.passes(state, recorded.get("hash") if recorded else None)


def verdict(results: Path, run: str, since: float) -> dict | None:
    """The night's quarantine verdict from verify_env's report: verify.json, or the verify.failed.json
    it kept when it stopped the night (written since `since`, not an earlier attempt's); None when
    the night's verify_env wrote none (no promoted run, or it did not get that far)."""
    env = results / run / "env"
    for path in (env / "verify.json", env / "verify.failed.json"):
        try:
            if path.stat().st_mtime < since and path.name == "verify.failed.json":
                continue
            report = read_json(path)
        except (OSError, ValueError):
            continue
        if isinstance(report, dict) and isinstance(report.get("quarantine"), dict):
            return report["quarantine"]
    return None


def take(state: dict, night: dict, found: dict | None, at: str) -> bool:
    """Put the verdict in the night's record (`stack`) and a pass in the state; True when it refuses
    the night (a failed quarantine, or nightly.on_stack_change: refuse on a changed stack)."""
    if found is None:
        return False
    night["stack"] = {"status": found.get("status"), "message": found.get("message")}
    added = decisions.record_pass(state, found, night["run"], at)
    if added:
        night["stack"]["recorded_pass"] = [entry["stack"] for entry in added]
    if found.get("status") in decisions.FAILED:
        night.update(status="refused", reason=f"quarantine: {found.get('message')}")
        return True
    return False
