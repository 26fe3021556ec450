"""verify_env's collective check: one torchrun over every process of every node.

`python -m llmft verify-env` (env.verify.run_verify) starts `torchrun -m llmft.env.collectives` on each
node. Here each process measures what training will lean on: all-reduce and all-gather bus bandwidth
at a few message sizes (NCCL/RCCL on GPUs, gloo on CPU), a GEMM on its own GPU, and which transport
the library picked (from its NCCL_DEBUG=INFO log). Rank 0 gathers all of it, and every node's facts
(`all_gather_object`), into one JSON file for its node's launcher to judge and publish.

Progress goes to a file per rank, so a launcher that has to kill a hung run can say where it hung.
The pure parts (bus bandwidth, log parsing) are tested with recorded logs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import socket
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

from llmft.core import hardware
from llmft.core.io import write_json

MIB = 2**20
# Message sizes: small ones show latency, the largest one is judged (the size the H200 floors in
# hardware.py were measured at). CPU sizes stay small: CI has 2 cores shared by 2 processes.
GPU_SIZES = (1 * MIB, 16 * MIB, 256 * MIB, 1024 * MIB)
CPU_SIZES = (MIB // 4, 1 * MIB, 4 * MIB)
GEMM_N = {"gpu": 8192, "cpu": 256}  # 8192^3 bf16: the size hardware.py's GEMM floors were measured at
RESULT_FILE = "collectives.json"
FACTS_FILE = "node_facts.json"  # written by the node's launcher once its probe is done


def bus_bandwidth(op: str, nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algorithm, bus) bandwidth in GB/s, as nccl-tests defines them.

    `nbytes` is the all-reduce buffer, or the all-gather output (all ranks' parts together). Bus
    bandwidth scales the algorithm bandwidth by the share of data each link must carry, so it is
    comparable across world sizes and with the hardware's link speed.
    """
    algbw = nbytes / seconds / 1e9
    factor = {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1) / world}[op]
    return algbw, algbw * factor


_VIA = re.compile(r"via ((?:P2P|SHM|NET|CollNet|NVLS)[\w/.:-]*)")
_GRAPH = re.compile(
    r"Pattern (\d+), crossNic \d+, nChannels (\d+), (?:bw|speed) ([\d.]+)/([\d.]+), type (\w+)/(\w+)"
)
_NET = re.compile(r"NET/(IB|Socket|OFI|AWS Libfabric|\w+)")
_VERSION = re.compile(r"(NCCL|RCCL) version ([\w.+-]+)")


def parse_nccl_log(text: str, keep: int = 6) -> dict:
    """What one rank's NCCL/RCCL INFO log says about the transport it uses.

    - `via`: connection kinds with counts ("P2P/CUMEM/read", "P2P/IPC", "SHM/direct/direct",
      "NET/Socket/0", ...): P2P = GPU to GPU directly, SHM = through host memory, NET = network.
    - `paths`: the intra/inter path types of the topology search ("NVL/PIX", "XGMI/PIX",
      "PHB/PHB"), which say whether P2P runs over the fabric or over PCIe.
    - `evidence`: the first few lines that say so, for the report.
    """
    via: Counter = Counter()
    paths: Counter = Counter()
    nets: set[str] = set()
    evidence: list[str] = []
    version = ""
    for line in text.splitlines():
        m = _VERSION.search(line)
        if m and not version:
            version = f"{m.group(1)} {m.group(2)}"
        hit = False
        m = _GRAPH.search(line)
        if m:
            paths[f"{m.group(5)}/{m.group(6)}"] += 1
            hit = True
        m = _VIA.search(line)
        if m:
            kind = m.group(1)
            # Channel numbers and NIC indices vary; "NET/IB/0" and "NET/IB/1" are one kind.
            kind = re.sub(r"/\d+$", "", kind)
            via[kind] += 1
            n = _NET.match(kind)
            if n:
                nets.add(n.group(1))
            hit = True
        if hit and len(evidence) < keep:
            # Drop the "host:pid:tid [dev] NCCL INFO " prefix; keep what the library said.
            evidence.append(line.split(" INFO ", 1)[-1].strip()[:200])
    return {
        "version": version,
        "via": dict(via),
        "paths": dict(paths),
        "net": sorted(nets),
        "evidence": evidence,
    }


def summarize_transport(per_rank: list[dict], library: str) -> dict:
    """One transport verdict for the whole run from every rank's parsed log.

    `intra` names the link between GPUs of a node (the fabric, PCIe, or host memory when P2P is
    off); `inter` names the network between nodes (IB/RoCE, or TCP sockets).
    """
    if library == "gloo":
        return {"library": "gloo", "intra": "TCP (gloo)", "inter": "TCP (gloo)", "reported": False}
    via: Counter = Counter()
    paths: Counter = Counter()
    nets: set[str] = set()
    evidence: list[str] = []
    version = ""
    for r in per_rank:
        via.update(r.get("via", {}))
        paths.update(r.get("paths", {}))
        nets.update(r.get("net", []))
        version = version or r.get("version", "")
        for line in r.get("evidence", []):
            if line not in evidence and len(evidence) < 8:
                evidence.append(line)
    intra_types = {p.split("/")[0] for p in paths}
    names = []
    for t in sorted(intra_types):
        if t in hardware.FABRIC_PATHS:
            names.append(hardware.FABRIC_PATHS[t])
        elif t in hardware.PCIE_PATHS:
            names.append(hardware.PCIE_PATHS[t])
    p2p = any(k.startswith("P2P") for k in via)
    shm = any(k.startswith("SHM") for k in via)
    if names:
        intra = " + ".join(names)
    elif p2p:
        intra = "P2P (link type not reported)"
    else:
        intra = ""
    if shm:
        intra = (intra + " + " if intra else "") + "host memory (SHM: P2P off between some GPUs)"
    inter = "/".join(sorted(nets)) if nets else ""
    return {
        "library": library,
        "version": version,
        "intra": intra or "not reported",
        "inter": inter,
        "intra_path_types": sorted(intra_types),
        "via": dict(via),
        "paths": dict(paths),
        "evidence": evidence,
        "reported": bool(via or paths),
    }


class Progress:
    """Append-only step log per rank: a launcher that kills a hung run reads where it stopped."""

    def __init__(self, path: Path):
        self.path = path
        self.t0 = time.monotonic()

    def __call__(self, step: str) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(f"{time.monotonic() - self.t0:7.2f}s {step}\n")


def _wait_for_facts(path: Path, wait_s: float) -> dict:
    """The launcher's node facts. On CPU its probe runs while torchrun starts: every worker waits
    here, with no process group yet, so no collective's timeout runs while the probe does."""
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"this node's launcher wrote no node facts ({path.name}) within {wait_s:g} s")
        time.sleep(0.1)
    return json.loads(path.read_text())


def _iters(nbytes: int, gpu: bool) -> int:
    if not gpu:
        return 10
    # ~8 GiB moved per size keeps the large sizes short and the small ones out of launch noise.
    return max(5, min(50, (8 * 1024 * MIB) // nbytes))


def _pick_device(torch, gpu: bool, local_rank: int):
    """(device, synchronize) for this process."""
    if not gpu:
        return torch.device("cpu"), lambda: None
    ndev = torch.cuda.device_count()
    if ndev == 0:
        raise RuntimeError("backend nccl but torch sees no GPU on this node")
    # More processes than GPUs is a gpu_count finding; share GPUs so the check still runs.
    device = torch.device("cuda", local_rank % ndev)
    torch.cuda.set_device(device)
    return device, torch.cuda.synchronize


def _time_op(torch, dist, fn, iters: int, sync, device) -> float:
    """Seconds per call of `fn` on the slowest rank, after two warm-up calls."""
    for _ in range(2):
        fn()
    sync()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    dt = torch.tensor([(time.perf_counter() - t) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return float(dt.item())


def _measure_bandwidth(
    torch, dist, step, device, dtype, gpu: bool, world: int, sync
) -> dict[str, list[dict]]:
    """All-reduce and all-gather at each message size: bytes, iterations, time, bandwidths."""
    elem = torch.finfo(dtype).bits // 8
    # torch 2.13 renames all_gather_into_tensor (and warns); the device image's 2.11 has only the old name.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    bandwidth: dict[str, list[dict]] = {"all_reduce": [], "all_gather": []}
    for size in GPU_SIZES if gpu else CPU_SIZES:
        n = max(world, size // elem // world * world)
        nbytes = n * elem
        # Zeros: repeated sums of zeros stay finite (ones would overflow to inf over many iterations).
        buf = torch.zeros(n, dtype=dtype, device=device)
        part = torch.zeros(n // world, dtype=dtype, device=device)
        ops = {
            "all_reduce": lambda buf=buf: dist.all_reduce(buf),
            "all_gather": lambda buf=buf, part=part: all_gather(buf, part),
        }
        for op, fn in ops.items():
            step(f"{op} {nbytes / MIB:g} MiB")
            iters = _iters(nbytes, gpu)
            seconds = _time_op(torch, dist, fn, iters, sync, device)
            algbw, busbw = bus_bandwidth(op, nbytes, seconds, world)
            bandwidth[op].append(
                {
                    "bytes": nbytes,
                    "iters": iters,
                    "time_ms": round(seconds * 1e3, 4),
                    "algbw_gbs": round(algbw, 2),
                    "busbw_gbs": round(busbw, 2),
                }
            )
        del buf, part
    return bandwidth


def _measure_gemm(torch, dist, device, dtype, gpu: bool, sync) -> tuple[int, float]:
    """(n, TFLOP/s) of an n^3 matmul on this process's device."""
    n = GEMM_N["gpu" if gpu else "cpu"]
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    dist.barrier()  # all GPUs at once, as in training (shared power and cooling)
    for _ in range(3):
        a @ b
    sync()
    iters = 20 if gpu else 5
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync()
    gemm_tflops = 2 * n**3 * iters / (time.perf_counter() - t) / 1e12
    del a, b
    return n, gemm_tflops


def _rank_nccl_log(scratch: Path, gpu: bool) -> dict:
    """This process's parsed NCCL/RCCL INFO log ({} on gloo or when there is none)."""
    if gpu:
        logs = glob.glob(str(scratch / f"nccl.*.{os.getpid()}.log"))
        if logs:
            return parse_nccl_log(Path(logs[0]).read_text(errors="replace"))
    return {}


def _write_result(
    torch, scratch: Path, backend: str, gpu: bool, world: int, dtype, ranks, nodes, bandwidth, phases
):
    """Rank 0: everything gathered, with one transport verdict, into RESULT_FILE."""
    library = ("rccl" if getattr(torch.version, "hip", None) else "nccl") if gpu else "gloo"
    version = ".".join(map(str, torch.cuda.nccl.version())) if gpu else ""
    transport = summarize_transport([r.pop("nccl_log") for r in ranks], library)
    transport["version"] = transport.get("version") or version
    result = {
        "backend": backend,
        "world_size": world,
        "nnodes": len([f for f in nodes if f is not None]),
        "dtype": str(dtype).replace("torch.", ""),
        "sum_ok": all(r["sum_ok"] for r in ranks),
        "bandwidth": bandwidth,
        "ranks": ranks,
        "transport": transport,
        "phases": phases,
        "nodes": [f for f in nodes if f is not None],
    }
    write_json(scratch / RESULT_FILE, result)


def run(scratch: Path, backend: str, timeout_s: float, wait_s: float) -> None:
    """This process's part. The launcher times the check from the moment every process has met and
    kills it after `timeout_s`; `wait_s` bounds the waits before (this node's probe, the others')."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    step = Progress(scratch / f"progress.{rank}")
    gpu = backend == "nccl"
    device, sync = _pick_device(torch, gpu, local_rank)

    step("waiting for node facts")
    t_start = time.monotonic()
    node_facts = _wait_for_facts(scratch / FACTS_FILE, wait_s)
    phases = {"facts_wait_s": round(time.monotonic() - t_start, 2)}
    step("rendezvous")
    t_start = time.monotonic()
    # device_id makes NCCL connect now, so a broken transport fails here, not mid-benchmark. The
    # timeout covers waiting for the slowest node's probe; the launcher enforces timeout_s.
    timeout = timedelta(seconds=wait_s + timeout_s)
    dist.init_process_group(backend, timeout=timeout, device_id=device if gpu else None)
    step("connected")
    phases["rendezvous_s"] = round(time.monotonic() - t_start, 2)

    # Correctness first: a transport that moves bytes wrongly must not pass on speed.
    probe = torch.full((4,), float(rank), device=device, dtype=torch.float32)
    dist.all_reduce(probe)
    want = world * (world - 1) / 2
    sum_ok = bool(torch.all(probe == want).item())

    dtype = torch.bfloat16 if gpu else torch.float32
    t0 = time.monotonic()
    bandwidth = _measure_bandwidth(torch, dist, step, device, dtype, gpu, world, sync)
    phases["bandwidth_s"] = round(time.monotonic() - t0, 2)

    step("gemm")
    t0 = time.monotonic()
    n, gemm_tflops = _measure_gemm(torch, dist, device, dtype, gpu, sync)
    phases["gemm_s"] = round(time.monotonic() - t0, 2)

    step("gather")
    me = {
        "rank": rank,
        "local_rank": local_rank,
        "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if gpu else "cpu",
        "gemm_tflops": round(gemm_tflops, 3),
        "gemm_n": n,
        "gemm_dtype": str(dtype).replace("torch.", ""),
        "sum_ok": sum_ok,
        "nccl_log": _rank_nccl_log(scratch, gpu),
    }
    ranks: list = [None] * world
    nodes: list = [None] * world
    dist.all_gather_object(ranks, me)
    dist.all_gather_object(nodes, node_facts if local_rank == 0 else None)
    if rank == 0:
        _write_result(torch, scratch, backend, gpu, world, dtype, ranks, nodes, bandwidth, phases)
    step("done")
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmft.env.collectives", description=__doc__)
    parser.add_argument("--scratch", required=True, help="node-local folder shared with the launcher")
    parser.add_argument("--backend", required=True, choices=["nccl", "gloo"])
    parser.add_argument("--timeout", type=float, default=120.0, help="verify.timeout_seconds")
    parser.add_argument(
        "--wait", type=float, default=600.0, help="seconds to wait for the node facts and the other nodes"
    )
    args = parser.parse_args(argv)
    scratch = Path(args.scratch)
    try:
        run(scratch, args.backend, args.timeout, args.wait)
    except BaseException as exc:
        rank = os.environ.get("RANK", "x")
        (scratch / f"error.{rank}").write_text(f"{type(exc).__name__}: {exc}"[:2000])
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
