"""Environment verification: per-node facts, a collective check over all nodes, one JSON report.

`python -m llmft verify-env` runs once per node (under `srun --ntasks-per-node=1` on several nodes,
plainly on one), through the same launch path as sft (`launch.launch_env`, `slurm.current_allocation`):

1. `probe_node`: a child process (`python -m llmft.env.nodefacts`) records what this node is: torch build,
   devices and archs, rocminfo / nvidia-smi, package imports, DeepSpeed ops, a flash-attn kernel
   call (or the SDPA fallback). A child, because the typical ROCm failures crash processes (illegal
   instruction, hipErrorNoBinaryForGpu): a crash becomes a named finding, not a lost report. Then
   the numerics canary, in a child too. Both within `verify.probe_timeout_seconds`; a probe over it
   is reported as slow, naming the part and the step it was in.
2. `start_collectives`: `torchrun -m llmft.env.collectives` over nodes x processes_per_node (NCCL/RCCL on
   GPUs, gloo on CPU): bus bandwidth, GEMM TFLOP/s, the transport in use, every node's facts.
   The two never share a clock: the workers wait for their node's facts before they rendezvous, and
   the processes may take the slowest node's probe budget to meet; from the moment they have met,
   `verify.timeout_seconds` bounds the check, and a hang is reported with the step it hung in.
3. Node rank 0 judges (env.rules: pure functions of recorded facts, so every rule is tested
   without the hardware) and writes the report atomically, also on failure. Other
   nodes write nothing and exit 0: node 0's exit code carries the verdict, and a non-zero exit on
   another node would make `srun --kill-on-bad-exit` kill node 0 before it writes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from llmft.core import quarantine as stack_quarantine
from llmft.core import slurm
from llmft.core import stack as stack_fp
from llmft.core.io import read_json, write_json
from llmft.core.launch import dies_with_this_process, launch_env
from llmft.core.platform import Platform
from llmft.core.settings import Config, Hardware, Nightly, Verify
from llmft.env import collectives
from llmft.env.quarantine import node_quarantine
from llmft.env.rules import Finding, judge_run

# verify_env's torchrun listens this far below sft's port (slurm.rendezvous_port: 29500 + job id
# mod 2000), so the two ranges never overlap and both stay below Linux's ephemeral ports (32768+).
VERIFY_PORT_OFFSET = -2000
# What the workers may take to exit once they have logged "done" (their result is written); a
# loaded machine takes seconds to tear down the process group and end the processes.
TEARDOWN_S = 60.0
NCCL_DEBUG_ENV = {
    "NCCL_DEBUG": "INFO",
    # GRAPH: the path type between GPUs (NVL/XGMI vs PCIe); P2P/SHM/NET: the connections.
    "NCCL_DEBUG_SUBSYS": "INIT,GRAPH,P2P,SHM,NET,ENV",
}


# Test-only switch: the path of recorded node facts (a JSON file as nodefacts writes it) that
# replace this node's probe, for every node of the allocation, and skip the collective check (the
# recorded GPUs are not there to measure). It lets the Slurm tests plan for MI300X nodes on a
# machine without GPUs; verify.json then says the facts were injected, and the collective finding
# fails, so only verify.on_failure: warn lets such a run go on. Never set it on a real cluster.
TEST_FACTS_ENV = "LLMFT_TEST_NODE_FACTS"


def injected_facts(alloc: slurm.Allocation) -> list[dict] | None:
    """The test-only recorded facts, one copy per node of the allocation (named as its hosts)."""
    path = os.environ.get(TEST_FACTS_ENV)
    if not path:
        return None
    facts = read_json(path)
    return [{**facts, "host": host, "injected_from": path} for host in alloc.nodes]


def local_vendor(hw: Hardware) -> str:
    """The vendor verify_env checks on this node: the config's, else what this node's torch was built for."""
    if hw.on_cpu:
        return "cpu"
    if hw.vendor != "auto":
        return hw.vendor
    import torch

    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


def probe_node(env: dict, scratch: Path, budget_s: float, cfg: Config) -> dict:
    """Run the probe child, then the canary; its facts, plus `probe_error` when it crashed, failed
    or outlasted `budget_s` (verify.probe_timeout_seconds, for both parts together)."""
    t0 = time.monotonic()
    out = scratch / "probe.json"
    # Import what the config needs: the required packages, DeepSpeed unless ZeRO is off ("auto"
    # may pick it); with offload, DeepSpeed's CPU Adam must build ("auto": decided later, not built).
    imports = list(cfg.verify.required_packages)
    if cfg.sft.zero_stage != 0:
        imports.append("deepspeed")
    cmd = [sys.executable, "-m", "llmft.env.nodefacts", "--out", str(out), "--imports", ",".join(imports)]
    if cfg.sft.offload is True:
        cmd.append("--cpu-adam")
    bits = cfg.sft.quantization_bit
    if bits != "none":
        # QLoRA: bitsandbytes must import and run a quantized layer on this node's GPU.
        cmd += ["--bnb", str(bits)]
    err = None
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=budget_s)
        if proc.returncode != 0:
            rc = proc.returncode
            err = {"returncode": rc, "signal": _signal_name(rc), "stderr_tail": proc.stderr.strip()[-600:]}
    except subprocess.TimeoutExpired:
        err = _slow("node facts", budget_s, t0)
    facts = (
        read_json(out)
        if out.exists()
        else {"host": os.environ.get("SLURMD_NODENAME") or socket.gethostname()}
    )
    facts_s = round(time.monotonic() - t0, 1)
    facts["probe_seconds"] = {"node facts": facts_s}
    print(f"[verify_env] node facts probe in {facts_s} s", flush=True)
    if err is not None:
        err["last_step"] = facts.get("probe_step", "start")
        facts["probe_error"] = err
    elif cfg.verify.canary:
        canary = canary_node(env, scratch, facts, cfg, budget_s, t0)
        facts["probe_seconds"]["canary"] = round(time.monotonic() - t0 - facts_s, 1)
        if "probe_error" in canary:
            facts["probe_error"] = canary["probe_error"]
        else:
            facts["canary"] = canary
    if "probe_error" not in facts:  # the stack quarantine (nightly.on_stack_change), on this node
        quarantine = node_quarantine(env, scratch, facts, cfg, budget_s, t0)
        if quarantine is not None:
            facts["quarantine"] = quarantine
    return facts


def _slow(part: str, budget_s: float, t0: float) -> dict:
    """probe_error for a part killed when the probe's budget ran out (rules name it a slow probe)."""
    return {
        "timed_out": True,
        "part": part,
        "seconds": round(time.monotonic() - t0, 1),
        "timeout_s": budget_s,
        "key": "verify.probe_timeout_seconds",
    }


def canary_node(env: dict, scratch: Path, facts: dict, cfg: Config, budget_s: float, t0: float) -> dict:
    """The numerics canary (llmft.env.canary) in its own child, through this node's planned kernels,
    in what the probe's budget (`budget_s` from `t0`) leaves; `probe_error` when that ran out."""
    t = time.monotonic()
    left_s = max(budget_s - (t - t0), 0.1)
    facts_path, out = scratch / "canary_facts.json", scratch / "canary.json"
    progress = scratch / "canary.steps"
    write_json(facts_path, facts)
    cmd = [sys.executable, "-m", "llmft.env.canary", "--facts", str(facts_path), "--out", str(out)]
    cmd += ["--progress", str(progress), "--config-json", json.dumps(cfg.to_dict())]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left_s)
    except subprocess.TimeoutExpired:
        err = _slow("numerics canary", budget_s, t0)
        steps = progress.read_text().split("\n") if progress.exists() else []
        err["last_step"] = next((x for x in reversed(steps) if x), "start")
        return {"probe_error": err}
    if proc.returncode != 0 or not out.exists():
        why = _signal_name(proc.returncode) or f"exit {proc.returncode}"
        return {"ok": False, "message": f"the canary crashed ({why}): {proc.stderr.strip()[-500:]}"}
    result = read_json(out)
    result["seconds"] = round(time.monotonic() - t, 1)
    print(f"[verify_env] canary in {result['seconds']} s: {result.get('message')}", flush=True)
    return result


def _signal_name(returncode: int) -> str | None:
    """SIGILL for -4: a child killed by a signal has a negative exit code."""
    try:
        return signal.Signals(-returncode).name if returncode < 0 else None
    except ValueError:
        return f"signal {-returncode}"


def _kill_group(proc: subprocess.Popen) -> None:
    """End torchrun and its workers (they share its process group), politely first."""
    for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _progress(scratch: Path) -> dict[str, str]:
    """Each local rank's last step, from the progress files the workers append to."""
    last = {}
    for p in sorted(scratch.glob("progress.*")):
        lines = p.read_text().strip().splitlines()
        if lines:
            last[f"rank {p.suffix[1:]}"] = lines[-1].strip().split(" ", 1)[-1]
    return last


def _all_reached(scratch: Path, nprocs: int, step: str) -> bool:
    """Every local worker has logged `step` ("connected": the timed part began; "done": it ended)."""
    files = list(scratch.glob("progress.*"))
    return len(files) == nprocs and all(f" {step}\n" in p.read_text() for p in files)


def _meet_failure(
    probe_s: float, timeout_s: float, progress: dict[str, str], alloc: slurm.Allocation, port: int
) -> dict:
    """Killed before every process had met: on one node within `timeout_s` of its probe's end; on
    several, once every node's probe could have ended too (`probe_s` from the start)."""
    where = "; ".join(f"{k}: {v}" for k, v in progress.items()) or "no worker started on this node"
    if any(s.startswith("waiting for node facts") for s in progress.values()):
        fix = (
            "this node's launcher never delivered its probe's facts to its workers: read the "
            "verify_env log above for the probe's own error"
        )
    else:
        fix = (
            f"the processes never all met: every one of the {alloc.nnodes} node(s) must run "
            "`python -m llmft verify-env` (srun --nodes=N --ntasks-per-node=1), and "
            f"{alloc.master_addr}:{port} must be reachable from all of them (firewall; "
            "hardware.socket_ifname for the right interface)"
        )
    if alloc.nnodes > 1:
        within = (
            f"within {probe_s + timeout_s:g} s of the start (every node's probe may take "
            f"verify.probe_timeout_seconds, {probe_s:g} s, plus verify.timeout_seconds, {timeout_s:g} s)"
        )
    else:
        within = f"within verify.timeout_seconds ({timeout_s:g} s) of the node probe's end"
    return {
        "check": "collectives:rendezvous",
        "message": f"the collective check's processes did not all meet {within} and were killed ({where})",
        "fix": fix,
    }


def _timeout_failure(timeout_s: float, progress: dict[str, str]) -> dict:
    steps = {s for s in progress.values()}
    where = "; ".join(f"{k}: {v}" for k, v in progress.items())
    if any(s.startswith(("all_reduce", "all_gather", "connected")) for s in steps):
        fix = (
            "a collective hung: GPU traffic on a path that stalls (PCIe P2P across root complexes, "
            "the wrong NCCL_SOCKET_IFNAME, a dead IB port); rerun with NCCL_DEBUG=INFO and check "
            "rocm-smi --showtopotype / nvidia-smi topo -m. Raise verify.timeout_seconds only if "
            "the node is merely slow"
        )
    elif any(s.startswith("gather") for s in steps):
        fix = "another node did not deliver its results: read that node's verify_env log"
    else:
        fix = "a GPU stopped responding (GEMM): check dmesg and rocm-smi / nvidia-smi for GPU resets"
    return {
        "check": "collectives:timeout",
        "message": (
            f"the collective check did not finish within verify.timeout_seconds ({timeout_s:g} s) "
            f"of its processes meeting and was killed ({where})"
        ),
        "fix": fix,
    }


def start_collectives(
    platform: Platform, alloc: slurm.Allocation, env: dict, scratch: Path, timeout_s: float, wait_s: float
) -> tuple[subprocess.Popen, int]:
    """Start `torchrun -m llmft.env.collectives` for this node; (process, rendezvous port).

    Its workers wait up to `wait_s` for this node's facts and for the other nodes, then have
    `timeout_s` for the check."""
    vendor = platform.vendor
    port = alloc.master_port + VERIFY_PORT_OFFSET
    env = dict(env)
    env["MASTER_PORT"] = str(port)
    if vendor != "cpu":
        env.update(NCCL_DEBUG_ENV)
        env["NCCL_DEBUG_FILE"] = str(scratch / "nccl.%h.%p.log")
    if alloc.nnodes == 1:
        # One node: a free port picked by torchrun itself, so concurrent runs on one host never clash.
        where = ["--standalone"]
    else:
        where = [
            f"--nnodes={alloc.nnodes}",
            f"--node_rank={alloc.node_rank}",
            f"--master_addr={alloc.master_addr}",
            f"--master_port={port}",
            # torchrun's own rendezvous waits for the slowest node's probe too (its default: 600 s)
            f"--rdzv_conf=timeout={int(wait_s + timeout_s) + 1}",
        ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *where,
        f"--nproc_per_node={platform.processes_per_node}",
        "--monitor_interval=0.1",
        "-m",
        "llmft.env.collectives",
        f"--scratch={scratch}",
        f"--backend={'gloo' if vendor == 'cpu' else 'nccl'}",
        f"--timeout={timeout_s}",
        f"--wait={wait_s}",
    ]
    print(f"[verify_env] {' '.join(cmd)}", flush=True)
    # Its own process group: on a timeout the launcher ends torchrun and every worker together; and
    # torchrun ends them itself if this launcher is killed.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=dies_with_this_process())
    return proc, port


def finish_collectives(
    proc: subprocess.Popen,
    alloc: slurm.Allocation,
    port: int,
    scratch: Path,
    nprocs: int,
    meet_by: float,
    probe_s: float,
    timeout_s: float,
) -> dict:
    """Wait for the collective check; its result, or a `failure` saying what went wrong.

    Every node's probe runs first, on its own budget: the processes must all have met by `meet_by`
    (monotonic). From the moment they have met, `timeout_s` bounds the check.
    """
    met_at = done_at = None
    while (rc := proc.poll()) is None:
        now = time.monotonic()
        if met_at is None and _all_reached(scratch, nprocs, "connected"):
            met_at = now
        if met_at is not None and done_at is None and _all_reached(scratch, nprocs, "done"):
            done_at = now
        if met_at is None and now > meet_by:
            _kill_group(proc)
            return {"failure": _meet_failure(probe_s, timeout_s, _progress(scratch), alloc, port)}
        if done_at is None and met_at is not None and now > met_at + timeout_s:
            _kill_group(proc)
            return {"failure": _timeout_failure(timeout_s, _progress(scratch))}
        if done_at is not None and now > done_at + TEARDOWN_S:
            # Measured and written: a process group that hangs in its teardown is not a failed check.
            _kill_group(proc)
            break
        time.sleep(0.1)
    rc = proc.returncode
    result = scratch / collectives.RESULT_FILE
    if result.exists():
        return read_json(result)
    if alloc.node_rank != 0 and rc == 0:
        return {}
    errors = "; ".join(
        f"rank {p.suffix[1:]}: {p.read_text().strip()}" for p in sorted(scratch.glob("error.*"))
    )
    return {
        "failure": {
            "check": "collectives",
            "message": f"the collective check failed (torchrun exit {rc}): {errors or 'see the log above'}",
            "fix": "read the worker traceback in the verify_env log; for NCCL/RCCL errors rerun with "
            "NCCL_DEBUG=INFO; check hardware.socket_ifname and that every node runs verify-env",
        }
    }


def run_verify(cfg: Config, out_path: str) -> int:
    """This node's part of verify_env; node rank 0 writes the report. Non-zero: failed and on_failure=fail."""
    t0 = time.monotonic()
    alloc = slurm.current_allocation()
    injected = injected_facts(alloc)
    vendor = (
        injected[0].get("build", "cpu")
        if injected and cfg.hardware.gpus_per_node
        else local_vendor(cfg.hardware)
    )
    # What this node runs the check with (vendor, layout, collective preset); the facts come next.
    platform = Platform.declared(cfg, vendor=vendor)
    env = launch_env(platform, alloc)
    timeout_s = float(cfg.verify.timeout_seconds)
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(f"[verify_env] node {host} rank {alloc.node_rank}/{alloc.nnodes}, vendor {vendor}", flush=True)
    if injected:
        print(
            f"[verify_env] TEST ONLY: node facts from {os.environ[TEST_FACTS_ENV]}, no collective check",
            flush=True,
        )
        coll = {
            "failure": {
                "check": "collectives",
                "message": f"not measured: recorded node facts were injected ({TEST_FACTS_ENV}, test only)",
                "fix": f"unset {TEST_FACTS_ENV}",
            }
        }
        return _report(cfg, out_path, alloc, vendor, injected, coll, t0, timeout_s)
    # LLMFT_VERIFY_SCRATCH=DIR keeps the raw NCCL logs and progress files, in a fresh folder
    # under DIR per run (a reused one would hand a failed run the last run's results).
    keep = os.environ.get("LLMFT_VERIFY_SCRATCH")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llmft-verify-") as tmp:
        scratch = Path(tempfile.mkdtemp(prefix="verify-", dir=keep)) if keep else Path(tmp)
        print(f"[verify_env] scratch {scratch}", flush=True)
        probe_s = float(cfg.verify.probe_timeout_seconds)
        # The workers wait for this node's facts, then for every other node (whose probe may
        # take its whole budget), before anything is timed.
        wait_s = probe_s + timeout_s
        if vendor == "cpu":
            # CPU: torchrun and its workers' imports overlap the probe (~10 s of imports).
            proc, port = start_collectives(platform, alloc, env, scratch, timeout_s, wait_s)
            facts = probe_node(env, scratch, probe_s, cfg)
        else:
            # GPUs: one after the other, so the probe's kernels never share a GPU with the timings.
            facts = probe_node(env, scratch, probe_s, cfg)
        write_json(scratch / collectives.FACTS_FILE, facts)
        facts_at = time.monotonic()
        print(f"[verify_env] node facts in {facts_at - t0:.1f} s", flush=True)
        if vendor != "cpu":
            proc, port = start_collectives(platform, alloc, env, scratch, timeout_s, wait_s)
        # Nodes start together (srun); another node's probe may run to its budget's end.
        meet_by = (max(facts_at, t0 + probe_s) if alloc.nnodes > 1 else facts_at) + timeout_s
        nprocs = platform.processes_per_node
        coll = finish_collectives(proc, alloc, port, scratch, nprocs, meet_by, probe_s, timeout_s)
    if alloc.node_rank != 0:
        print(f"[verify_env] node rank {alloc.node_rank} done; node rank 0 writes the report", flush=True)
        return 0
    return _report(cfg, out_path, alloc, vendor, coll.get("nodes") or [facts], coll, t0, timeout_s)


def _report(cfg: Config, out_path, alloc, vendor, nodes, coll, t0, timeout_s) -> int:
    """Judge every node's facts and the collective check; write verify.json (node rank 0)."""
    if alloc.node_rank != 0:
        return 0
    findings, thresholds = judge_run(nodes, coll, cfg, vendor, alloc.nnodes)
    quarantine = _quarantine(cfg.nightly, nodes)
    if quarantine is not None:
        fix = "" if quarantine["ok"] else QUARANTINE_FIX
        findings.append(Finding("quarantine", quarantine["ok"], quarantine["message"], fix))
    ok = all(f.ok for f in findings)
    for facts in nodes:  # each node's stack fingerprint, then the run's (llmft.core.stack)
        facts["stack_fingerprint"] = stack_fp.fingerprint(facts)
    report = {
        "ok": ok,
        "vendor": vendor,
        "world_size": cfg.hardware.layout.world_size,
        "nnodes": alloc.nnodes,
        "elapsed_s": round(time.monotonic() - t0, 1),
        "timeout_s": timeout_s,
        "thresholds": asdict(thresholds),
        "nodes": nodes,
        "stack": stack_fp.of_nodes(nodes),
        "collectives": {k: v for k, v in coll.items() if k != "nodes"},
        "findings": [asdict(f) for f in findings],
    }
    if quarantine is not None:
        report["quarantine"] = quarantine
    for f in findings:
        mark = "ok  " if f.ok else "FAIL"
        print(f"[verify_env] {mark} {f.check}: {f.message}" + (f"\n    fix: {f.fix}" if f.fix else ""))
    st = report["stack"]
    differs = f", nodes differ in {', '.join(st['differs'])}" if st["differs"] else ""
    print(f"[verify_env] stack {st['hash']}{differs}")
    print(f"[verify_env] {'passed' if ok else 'FAILED'} in {report['elapsed_s']} s", flush=True)
    write_json(out_path, report)
    # A failed quarantine stops the night whatever verify.on_failure says (nightly.on_stack_change).
    if not ok and (cfg.verify.on_failure == "fail" or not (quarantine or {"ok": True})["ok"]):
        # Keep the report where a failed job's outputs are not deleted.
        failed = Path(out_path).with_name("verify.failed.json")
        write_json(failed, report)
        print(f"[verify_env] environment check failed; report: {failed}", file=sys.stderr)
        return 1
    return 0


QUARANTINE_FIX = (
    "the night's software stack differs from the promoted run's (verify.json's quarantine has every "
    "check's numbers): fix the component the failed check points at, or return to the promoted run's "
    "stack; nightly.on_stack_change: allow trains on a changed stack unchecked"
)


def _quarantine(night: Nightly, nodes: list[dict]) -> dict | None:
    """verify.json's `quarantine` from every node's (llmft.core.quarantine.summarize); None when the
    night asked for none (no nightly.compare_with) or no node reported one (injected facts)."""
    per_node = {
        str(facts.get("host") or f"node{i}"): facts["quarantine"]
        for i, facts in enumerate(nodes)
        if isinstance(facts.get("quarantine"), dict)
    }
    if not night.compare_with or not per_node:
        return None
    promoted = Path(night.compare_with).name
    return stack_quarantine.summarize(per_node, night.on_stack_change, promoted)


def gate(verify: Verify, verify_path: str) -> None:
    """Refuse to train when verification failed (unless verify.on_failure is warn)."""
    report = read_json(verify_path)
    if report["ok"] or verify.on_failure == "warn":
        return
    bad = [f"{f['check']}: {f['message']}" for f in report["findings"] if not f["ok"]]
    raise SystemExit("sft refused: environment verification failed:\n  " + "\n  ".join(bad))
