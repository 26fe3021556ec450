"""What one node is: torch build, GPUs and archs, node tools, imports, DeepSpeed ops, attention.

Run as a child process of verify_env (`python -m llmft.env.nodefacts --out F`), because typical ROCm
failures kill processes (illegal instruction, hipErrorNoBinaryForGpu): the facts are saved after
every step, so a crash leaves what was learned plus the step that crashed, and becomes a named
finding (env.rules) instead of a lost report. Steps run from safe to risky.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import socket
import subprocess
import sys
import time

from llmft.core import hardware
from llmft.core.io import write_json
from llmft.core.platform import host_memory_gib
from llmft.env import stack

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
    "liger_kernel",
    "bitsandbytes",
    "torchao",  # FP8 training (llmft.core.fp8); peft imports it too whenever it is installed
]
# What `import X` must load to prove X works: llamafactory's top level is lazy, and its training
# entry point is where a broken dependency (torchaudio beside the wrong torch) shows.
IMPORT_MODULE = {"llamafactory": "llamafactory.train.tuner"}


def _version(pkg: str) -> str | None:
    dist = {"flash_attn": "flash-attn", "liger_kernel": "liger-kernel"}.get(pkg, pkg)
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


def _importable(pkg: str) -> tuple[bool, str]:
    try:
        importlib.import_module(IMPORT_MODULE.get(pkg, pkg))
        return True, ""
    except Exception as exc:  # an import that raises is exactly what we report
        return False, _err(exc)


def _run_tool(cmd: list[str], timeout: float = 20) -> tuple[str, str]:
    """(stdout, error) of a node tool such as rocminfo; ("", reason) when absent or failing."""
    if not shutil.which(cmd[0]):
        return "", f"{cmd[0]} not on PATH"
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        return "", _err(exc)
    if out.returncode != 0:
        return out.stdout, f"{cmd[0]} exited {out.returncode}: {out.stderr.strip()[-300:]}"
    return out.stdout, ""


def parse_rocminfo(text: str) -> list[dict]:
    """GPU agents from `rocminfo` output: [{"name": "gfx942", "marketing_name": ..., "compute_units"}].

    rocminfo sees the GPUs without torch, so it names the real architecture even when torch is a
    CUDA or CPU build, or cannot open the devices.
    """
    gpus = []
    for block in text.split("*******")[1:]:
        fields: dict[str, str] = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() and key.strip() not in fields:
                fields[key.strip()] = value.strip()
        if fields.get("Device Type") == "GPU":
            gpus.append(
                {
                    "name": fields.get("Name", ""),
                    "marketing_name": fields.get("Marketing Name", ""),
                    "compute_units": int(fields.get("Compute Unit", "0").split()[0] or 0),
                }
            )
    return gpus


NVIDIA_QUERY = "index,name,compute_cap,memory.total,driver_version,vbios_version"


def parse_nvidia_smi(text: str) -> list[dict]:
    """GPUs from `nvidia-smi --query-gpu=NVIDIA_QUERY --format=csv,noheader` (its first four
    columns alone too): name, arch, memory, driver and VBIOS (the fingerprint's firmware)."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3:
            continue
        major, _, minor = parts[2].partition(".")
        gpus.append(
            {
                "name": parts[1],
                "arch": hardware.cuda_arch_name(int(major), int(minor or 0)) if major.isdigit() else "",
                "memory": parts[3] if len(parts) > 3 else "",
                "driver": parts[4] if len(parts) > 4 else None,
                "firmware": parts[5] if len(parts) > 5 else None,
            }
        )
    return gpus


def _smi_facts() -> dict:
    if shutil.which("rocminfo"):
        text, err = _run_tool(["rocminfo"])
        return {"tool": "rocminfo", "gpus": parse_rocminfo(text), "error": err}
    if shutil.which("nvidia-smi"):
        text, err = _run_tool(["nvidia-smi", f"--query-gpu={NVIDIA_QUERY}", "--format=csv,noheader"])
        return {"tool": "nvidia-smi", "gpus": parse_nvidia_smi(text), "error": err}
    return {"tool": None, "gpus": [], "error": "neither rocminfo nor nvidia-smi on PATH"}


def _deepspeed_ops(load_cpu_adam: bool) -> dict:
    """Whether DeepSpeed's accelerator loads, which ops are compatible, and (offload) CPU Adam loads."""
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
    except Exception as exc:
        return {"ok": False, "error": _err(exc)}
    acc = get_accelerator()
    out = {
        "ok": True,
        "accelerator": acc.device_name(),
        "fused_adam_compatible": bool(FusedAdamBuilder().is_compatible(verbose=False)),
        "cpu_adam_compatible": bool(CPUAdamBuilder().is_compatible(verbose=False)),
    }
    if load_cpu_adam:
        # ZeRO-3 offload needs DeepSpeedCPUAdam: JIT-built on first use (cached afterwards).
        t = time.monotonic()
        try:
            CPUAdamBuilder().load(verbose=False)
            out["cpu_adam_load"] = {"ok": True, "seconds": round(time.monotonic() - t, 1)}
        except Exception as exc:
            out["cpu_adam_load"] = {"ok": False, "error": _err(exc)}
    return out


def _attention(torch, gpu: bool) -> dict:
    """flash-attn: import + one tiny causal kernel checked against SDPA; else the SDPA fallback."""
    import torch.nn.functional as F

    out: dict = {"flash_attn_version": _version("flash_attn"), "sdpa_ok": False}
    device = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, 128, 4, 64, device=device, dtype=dtype, generator=g) for _ in range(3))
    try:  # (batch, seq, heads, dim) -> SDPA's (batch, heads, seq, dim)
        ref = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        ).transpose(1, 2)
        out["sdpa_ok"] = bool(torch.isfinite(ref).all().item())
    except Exception as exc:
        out["sdpa_error"] = _err(exc)
        ref = None
    out.update(_varlen(torch, q, k, v) if gpu else {})
    if out["flash_attn_version"] is None:
        out["attention"] = "sdpa"
        return out
    try:
        from flash_attn import flash_attn_func
    except Exception as exc:
        out.update(import_ok=False, error=_err(exc), attention="sdpa")
        return out
    out["import_ok"] = True
    if not gpu:
        out.update(kernel_ok=None, attention="sdpa")  # flash-attn has no CPU kernel
        return out
    try:
        o = flash_attn_func(q, k, v, causal=True)
        torch.cuda.synchronize()
        diff = float((o.float() - ref.float()).abs().max().item()) if ref is not None else None
        ok = bool(torch.isfinite(o).all().item()) and (diff is None or diff < 5e-2)
        out.update(kernel_ok=ok, max_abs_diff_vs_sdpa=diff)
    except Exception as exc:
        out.update(kernel_ok=False, error=_err(exc))
    out["attention"] = "fa2" if out["kernel_ok"] else "sdpa"
    return out


def _varlen(torch, q, k, v) -> dict:
    """torch's own FlashAttention varlen kernel (sft's attention for neat packing) on two packed
    samples, checked against per-sample causal SDPA."""
    try:
        from llmft.core import varlen
    except Exception as exc:
        return {"varlen_ok": False, "varlen_error": _err(exc)}
    if not varlen.available():
        return {"varlen_ok": False, "varlen_error": "this torch has no torch.nn.attention.varlen kernel"}
    try:
        qf, kf, vf = (x.reshape(-1, x.shape[2], x.shape[3]) for x in (q, k, v))
        cu = torch.tensor([0, 48, qf.shape[0]], dtype=torch.int32, device=qf.device)
        scale = qf.shape[-1] ** -0.5
        got = varlen._kernel(qf, kf, vf, cu, int(qf.shape[0] - 48), scale)
        want = varlen._reference(qf, kf, vf, cu, scale)
        diff = float((got.float() - want.float()).abs().max().item())
        return {"varlen_ok": diff < 5e-2, "varlen_max_abs_diff": diff}
    except Exception as exc:
        return {"varlen_ok": False, "varlen_error": _err(exc)}


def _bitsandbytes(torch, bits: int, gpu: bool) -> dict:
    """Quantize a small linear layer with bitsandbytes as LLaMA-Factory's QLoRA does (4 bit: NF4
    with double quantization; 8 bit: int8), on this node's first GPU (or the CPU), and run it
    forward and backward; its error against the unquantized layer shows the kernels compute."""
    out: dict = {"bits": bits, "ok": False}
    try:
        import bitsandbytes as bnb

        out["version"] = getattr(bnb, "__version__", None)
        device = "cuda:0" if gpu else "cpu"
        out["device"] = device
        torch.manual_seed(0)
        ref = torch.nn.Linear(256, 256, bias=False)
        x = torch.randn(8, 256)
        want = x @ ref.weight.T
        if bits == 4:
            layer = bnb.nn.Linear4bit(
                256, 256, bias=False, compute_dtype=torch.float32, quant_type="nf4", compress_statistics=True
            )
            layer.weight = bnb.nn.Params4bit(ref.weight.data.clone(), requires_grad=False, quant_type="nf4")
        else:
            layer = bnb.nn.Linear8bitLt(256, 256, bias=False, has_fp16_weights=False)
            layer.weight = bnb.nn.Int8Params(
                ref.weight.data.clone(), requires_grad=False, has_fp16_weights=False
            )
        layer = layer.to(device)  # quantizes the weight
        xin = x.to(device).requires_grad_(True)
        got = layer(xin)
        got.float().sum().backward()
        err = ((got.float().cpu() - want).norm() / want.norm()).item()
        out["relative_error"] = round(err, 4)
        if not (err == err and err < 0.2 and xin.grad is not None and bool(torch.isfinite(xin.grad).all())):
            out["error"] = (
                f"{bits}-bit layer output is off by {err:.3g} (relative) or its gradient is not finite"
            )
            return out
        out["ok"] = True
    except Exception as exc:  # what fails here is what we report
        out["error"] = _err(exc)
    return out


# The environment variables that decide which GPUs, arch and network a node's processes use.
ENV_KEYS = (
    "PYTORCH_ROCM_ARCH",
    "HIP_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HSA_OVERRIDE_GFX_VERSION",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_HCA",
    "NCCL_P2P_DISABLE",
)


def _host_facts() -> dict:
    """What is known before torch loads: host, environment, package versions, host resources."""
    return {
        "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
        "packages": {p: _version(p) for p in PACKAGES},
        # What the planner may choose on this node: Liger needs its package and Triton (a
        # separate distribution on ROCm, pytorch-triton-rocm), found without importing them.
        "modules": {m: importlib.util.find_spec(m) is not None for m in ("liger_kernel", "triton")},
        "host_memory_gib": host_memory_gib(),
        "host_cpus": len(os.sched_getaffinity(0)),
        "imports": {},
        "devices": [],
        "arch_list": [],
    }


def _torch_devices(torch, hip: bool) -> list[dict]:
    """Each GPU torch sees: name, arch, memory, multiprocessors."""
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        # gcnArchName only on ROCm: CUDA builds have the field too and put the device name in it.
        arch = p.gcnArchName if hip else hardware.cuda_arch_name(p.major, p.minor)
        devices.append(
            {
                "index": i,
                "name": p.name,
                "arch": arch,
                "total_gib": round(total / 2**30, 1),
                "free_gib": round(free / 2**30, 1),
                "multiprocessors": p.multi_processor_count,
            }
        )
    return devices


def _import_packages(facts: dict, imports: list[str] | None, step) -> None:
    """Import each installed package (but torch and flash-attn, checked on their own), timed."""
    for pkg in PACKAGES if imports is None else [p for p in PACKAGES if p in imports]:
        # torchao: its version is judged (rules.judge_torchao); the canary's FP8 leg imports it where
        # FP8 may run, so no node pays its import (seconds) for nothing
        if pkg not in ("torch", "flash_attn", "torchao") and facts["packages"][pkg] is not None:
            step(f"import {IMPORT_MODULE.get(pkg, pkg)}")
            t = time.monotonic()
            ok, err = _importable(pkg)
            facts["imports"][pkg] = {"ok": ok, "error": err, "seconds": round(time.monotonic() - t, 2)}


def gather_facts(
    load_cpu_adam: bool = False, save=None, imports: list[str] | None = None, bnb_bits: int = 0
) -> dict:
    """What this node is. `save(facts, step)` is called after every step (the probe's checkpoint).

    `imports`: the packages to import (None = every installed one); versions are read for all.
    `bnb_bits` (4 or 8): also run a bitsandbytes-quantized layer (sft.quantization_bit).
    """

    def step(name: str) -> None:
        if save:
            save(facts, name)

    facts: dict = _host_facts()
    step("import torch")
    import torch

    facts["torch_version"] = torch.__version__
    facts["hip_version"] = getattr(torch.version, "hip", None)
    facts["cuda_version"] = torch.version.cuda
    facts["build"] = "rocm" if facts["hip_version"] else ("cuda" if facts["cuda_version"] else "cpu")
    facts["imports"]["torch"] = {"ok": True, "error": ""}
    step("rocminfo / nvidia-smi")
    facts["smi"] = _smi_facts()
    step("stack versions")  # llmft.env.stack: cheap reads, each bounded; what fails is None
    facts["stack"] = stack.gather(torch, facts["build"], facts["smi"], _run_tool)
    step("torch devices")
    if torch.cuda.is_available():
        facts["arch_list"] = list(torch.cuda.get_arch_list())
        facts["devices"].extend(_torch_devices(torch, bool(facts["hip_version"])))
    _import_packages(facts, imports, step)
    if "deepspeed" in facts["imports"]:
        step("deepspeed ops")
        facts["deepspeed_ops"] = _deepspeed_ops(load_cpu_adam)
    if bnb_bits:
        step(f"bitsandbytes {bnb_bits}-bit layer")
        facts["bitsandbytes"] = _bitsandbytes(torch, bnb_bits, bool(facts["devices"]))
    # Last: a flash-attn built for the wrong GPU can kill the process; everything above is saved.
    step("flash-attn kernel / SDPA")
    facts["attention"] = _attention(torch, bool(facts["devices"]))
    fa = facts["attention"]
    if fa.get("flash_attn_version"):
        facts["imports"]["flash_attn"] = {"ok": bool(fa.get("import_ok")), "error": fa.get("error", "")}
    step("done")
    return facts


def main(argv: list[str] | None = None) -> int:
    """`python -m llmft.env.nodefacts --out F`: prints each step before it runs, saves after it."""
    parser = argparse.ArgumentParser(prog="python -m llmft.env.nodefacts")
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu-adam", action="store_true", help="also build/load DeepSpeed CPU Adam")
    parser.add_argument("--imports", default="", help="comma-separated packages to import (default: all)")
    parser.add_argument("--bnb", type=int, default=0, help="also run a bitsandbytes layer of 4 or 8 bits")
    args = parser.parse_args(argv)

    def save(facts: dict, step: str) -> None:
        facts["probe_step"] = step
        write_json(args.out, facts)
        print(f"probe: {step}", flush=True)

    gather_facts(args.cpu_adam, save, args.imports.split(",") if args.imports else None, args.bnb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
