"""Environment verification: gather facts about this node, judge them, write a JSON report.

`gather_facts` reads the machine; `judge` is a pure function of those facts and the config, so
every failure rule is tested with recorded facts (an MI300X node's, an H200 node's) rather than by
pretending to have the hardware.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from . import hardware
from .config import layout
from .io import read_json, write_json

PACKAGES = [
    "torch",
    "transformers",
    "llamafactory",
    "deepspeed",
    "flash_attn",
    "accelerate",
    "datasets",
    "peft",
    "trl",
]


@dataclass
class Finding:
    check: str
    ok: bool
    message: str
    fix: str = ""


def _version(pkg: str) -> str | None:
    dist = {"flash_attn": "flash-attn"}.get(pkg, pkg)
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _importable(pkg: str) -> tuple[bool, str]:
    try:
        importlib.import_module(pkg)
        return True, ""
    except Exception as exc:  # an import that crashes is exactly what we report
        return False, f"{type(exc).__name__}: {exc}"[:300]


def gather_facts() -> dict:
    """What this node is: torch build, devices, archs, package versions and imports."""
    import torch

    facts: dict = {
        "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch_version": torch.__version__,
        "hip_version": getattr(torch.version, "hip", None),
        "cuda_version": torch.version.cuda,
        "env": {
            k: os.environ.get(k)
            for k in (
                "PYTORCH_ROCM_ARCH",
                "HIP_VISIBLE_DEVICES",
                "CUDA_VISIBLE_DEVICES",
                "ROCR_VISIBLE_DEVICES",
            )
        },
        "packages": {p: _version(p) for p in PACKAGES},
        "imports": {},
        "devices": [],
        "arch_list": [],
    }
    facts["build"] = "rocm" if facts["hip_version"] else ("cuda" if facts["cuda_version"] else "cpu")
    for pkg in PACKAGES:
        if facts["packages"][pkg] is not None:
            ok, err = _importable(pkg)
            facts["imports"][pkg] = {"ok": ok, "error": err}
    if torch.cuda.is_available():
        facts["arch_list"] = list(torch.cuda.get_arch_list())
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            arch = getattr(p, "gcnArchName", "") or hardware.cuda_arch_name(p.major, p.minor)
            facts["devices"].append(
                {
                    "index": i,
                    "name": p.name,
                    "arch": arch,
                    "total_gib": round(total / 2**30, 1),
                    "free_gib": round(free / 2**30, 1),
                }
            )
    facts["deepspeed_ops"] = _deepspeed_ops()
    return facts


def _deepspeed_ops() -> dict:
    """Whether DeepSpeed's accelerator loads and which op builders are compatible here."""
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    acc = get_accelerator()
    return {
        "ok": True,
        "accelerator": acc.device_name(),
        "fused_adam_compatible": bool(FusedAdamBuilder().is_compatible(verbose=False)),
        "cpu_adam_compatible": bool(CPUAdamBuilder().is_compatible(verbose=False)),
    }


def judge(facts: dict, cfg: dict, vendor: str) -> list[Finding]:
    """Every rule, applied to recorded facts. Pure: no machine access."""
    out: list[Finding] = []
    required = cfg["verify"]["required_packages"]
    for pkg in required:
        ver = facts["packages"].get(pkg)
        imp = facts["imports"].get(pkg, {})
        if ver is None:
            out.append(
                Finding(
                    f"package:{pkg}",
                    False,
                    f"{pkg} is not installed",
                    f"install it from envs/{vendor if vendor != 'cpu' else 'cpu'}.txt",
                )
            )
        elif not imp.get("ok", False):
            out.append(
                Finding(
                    f"package:{pkg}",
                    False,
                    f"{pkg} {ver} fails to import: {imp.get('error', '')}",
                    "reinstall it against this torch build",
                )
            )
        else:
            out.append(Finding(f"package:{pkg}", True, f"{pkg} {ver}"))
    build = facts["build"]
    if vendor == "cpu":
        out.append(Finding("build", True, f"torch {facts['torch_version']} ({build} build), CPU run"))
        return out
    if build != vendor:
        fix = (
            "install the ROCm wheel (envs/rocm.txt)"
            if vendor == "rocm"
            else "install the CUDA wheel (envs/cuda.txt)"
        )
        out.append(
            Finding(
                "build",
                False,
                f"the config asks for {vendor} but torch {facts['torch_version']} is a {build} build",
                fix,
            )
        )
        return out
    out.append(
        Finding(
            "build",
            True,
            f"torch {facts['torch_version']} ({build} {facts['hip_version'] or facts['cuda_version']})",
        )
    )
    devices = facts["devices"]
    want = cfg["hardware"]["gpus_per_node"]
    if len(devices) < want:
        out.append(
            Finding(
                "gpu_count",
                False,
                f"{len(devices)} GPU(s) visible, config asks for {want} per node",
                "check the job's --gres and *_VISIBLE_DEVICES",
            )
        )
    else:
        out.append(Finding("gpu_count", True, f"{len(devices)} GPU(s)"))
    archs = sorted({d["arch"].split(":")[0] for d in devices})
    built = {a.split(":")[0] for a in facts["arch_list"]}
    for arch in archs:
        if vendor == "rocm":
            ok = arch in built
            fix = (
                f"torch was built for {sorted(built)}: install a ROCm wheel built for {arch} "
                f"(PYTORCH_ROCM_ARCH={arch}) or rebuild from source"
            )
        else:
            # CUDA wheels carry PTX for forward compatibility: an older sm_ still runs via JIT.
            cc = int(arch.split("_")[1])
            ok = any(int(b.split("_")[1]) <= cc for b in built if b.startswith(("sm_", "compute_")))
            fix = f"torch was built for {sorted(built)}: install a CUDA wheel that includes {arch}"
        out.append(
            Finding(
                f"arch:{arch}",
                ok,
                f"GPU arch {arch} {'is' if ok else 'is NOT'} in the torch build",
                "" if ok else fix,
            )
        )
    if vendor == "rocm":
        env_arch = facts["env"].get("PYTORCH_ROCM_ARCH")
        if env_arch and not set(env_arch.replace(",", ";").split(";")) & set(archs):
            out.append(
                Finding(
                    "PYTORCH_ROCM_ARCH",
                    False,
                    f"PYTORCH_ROCM_ARCH={env_arch} but the GPUs are {archs}",
                    f"export PYTORCH_ROCM_ARCH={archs[0]} and rebuild flash-attn and "
                    "DeepSpeed ops (FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE pip install "
                    "flash-attn --no-build-isolation)",
                )
            )
    fa = facts["imports"].get("flash_attn")
    if cfg["sft"]["flash_attn"] == "fa2" and not (fa and fa["ok"]):
        out.append(
            Finding(
                "flash_attn",
                False,
                "sft.flash_attn is fa2 but flash-attn does not "
                f"import ({(fa or {}).get('error', 'not installed')})",
                "install flash-attn for this build (ROCm: FLASH_ATTENTION_SKIP_CUDA_BUILD"
                "=TRUE), or set sft.flash_attn: auto to fall back to SDPA",
            )
        )
    ds = facts.get("deepspeed_ops", {})
    if cfg["sft"]["zero_stage"] > 0 and not ds.get("ok"):
        out.append(
            Finding(
                "deepspeed_ops",
                False,
                f"DeepSpeed does not load: {ds.get('error')}",
                "reinstall deepspeed against this torch build",
            )
        )
    return out


def run_verify(cfg: dict, out_path: str) -> int:
    """Gather, judge, write the report; exit non-zero when a check failed and on_failure=fail."""
    from .sft import resolve_vendor

    vendor = resolve_vendor(cfg)
    facts = gather_facts()
    findings = judge(facts, cfg, vendor)
    ok = all(f.ok for f in findings)
    report = {
        "ok": ok,
        "vendor": vendor,
        "world_size": layout(cfg).world_size,
        "nodes": [facts],
        "findings": [asdict(f) for f in findings],
    }
    for f in findings:
        mark = "ok  " if f.ok else "FAIL"
        print(f"[verify_env] {mark} {f.check}: {f.message}" + (f"\n    fix: {f.fix}" if f.fix else ""))
    write_json(out_path, report)
    if not ok and cfg["verify"]["on_failure"] == "fail":
        # Keep the report where a failed job's outputs are not deleted.
        failed = Path(out_path).with_name("verify.failed.json")
        write_json(failed, report)
        print(f"[verify_env] environment check failed; report: {failed}", file=sys.stderr)
        return 1
    return 0


def gate(cfg: dict, verify_path: str) -> None:
    """Refuse to train when verification failed (unless verify.on_failure is warn)."""
    report = read_json(verify_path)
    if report["ok"] or cfg["verify"]["on_failure"] == "warn":
        return
    bad = [f"{f['check']}: {f['message']}" for f in report["findings"] if not f["ok"]]
    raise SystemExit("sft refused: environment verification failed:\n  " + "\n  ".join(bad))
