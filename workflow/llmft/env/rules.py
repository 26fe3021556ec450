"""verify_env's rules: pure functions from recorded facts to findings, each saying what to do.

`judge` applies the per-node rules (build, arch, PYTORCH_ROCM_ARCH, GPU count and memory,
flash-attn, DeepSpeed ops, a crashed probe); `judge_collectives` the rules of the collective check
(it ran, it summed right, bus bandwidth, transport, GEMM) against hardware.py's floors. No machine
access, so each rule is tested with recorded facts of an MI300X or H200 node.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmft.core import hardware
from llmft.core.platform import gpu_mismatch, node_attention, node_kernels
from llmft.core.settings import Config, Hardware, Sft, Verify


@dataclass
class Finding:
    check: str
    ok: bool
    message: str
    fix: str = ""


def _flash_attn_fix(vendor: str, error: str) -> str:
    e = error.lower()
    rebuild = (
        # not FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE: flash-attn's setup.py then skips the ROCm kernels too
        "GPU_ARCHS=gfx942 pip install flash-attn --no-build-isolation --no-cache-dir"
        if vendor == "rocm"
        else "pip install flash-attn --no-build-isolation"
    )
    # The ROCm build also names its extension flash_attn_2_cuda: only CUDA runtime libraries prove
    # a CUDA build.
    if vendor == "rocm" and any(lib in e for lib in ("libcudart", "libcuda.", "libcublas", "libnvrtc")):
        return (
            "flash-attn was built for CUDA, not ROCm/HIP: reinstall it through the HIP path on a "
            f"gfx942 node ({rebuild}), or set sft.flash_attn: sdpa"
        )
    if "no module named 'flash_attn_2_cuda'" in e:
        return (
            "flash-attn is installed without its compiled kernels (the build skipped them): rebuild "
            f"it on a GPU node of this kind ({rebuild}), or set sft.flash_attn: sdpa"
        )
    if "nobinaryforgpu" in e or "no kernel image" in e or "invalid device function" in e:
        arch = (
            "GPU_ARCHS=gfx942 (PYTORCH_ROCM_ARCH=gfx942)"
            if vendor == "rocm"
            else 'TORCH_CUDA_ARCH_LIST="9.0"'
        )
        return (
            f"flash-attn has no kernel for this GPU's architecture: rebuild it with {arch}, "
            "or set sft.flash_attn: sdpa"
        )
    if "undefined symbol" in e:
        return (
            "flash-attn was built against another torch: rebuild it against this torch (--no-build-isolation)"
        )
    return (
        f"reinstall flash-attn for this build ({rebuild}), "
        "or set sft.flash_attn: sdpa (auto picks flash-attn for neat packing where torch's varlen "
        "kernel does not run)"
    )


def _judge_attention(facts: dict, sft: Sft, vendor: str) -> list[Finding]:
    want = sft.flash_attn
    att = facts.get("attention")
    if att is None:  # facts recorded before this check existed: only the import is known
        fa = facts.get("imports", {}).get("flash_attn")
        att = {"flash_attn_version": facts.get("packages", {}).get("flash_attn")}
        if fa is not None:
            att.update(import_ok=fa["ok"], error=fa.get("error", ""), kernel_ok=fa["ok"] or None)
    installed = att.get("flash_attn_version")
    gpu = vendor != "cpu"
    broken = installed and (att.get("import_ok") is False or (gpu and att.get("kernel_ok") is False))
    if want == "fa2" and (not installed or broken or (gpu and not att.get("kernel_ok"))):
        what = (
            "is not installed"
            if not installed
            else f"{installed} does not work: {att.get('error') or 'kernel check failed'}"
        )
        return [
            Finding(
                "flash_attn",
                False,
                f"sft.flash_attn is fa2 but flash-attn {what}",
                _flash_attn_fix(vendor, att.get("error", ""))
                + " (or set sft.flash_attn: auto to fall back to SDPA)",
            )
        ]
    if want == "auto" and broken:
        return [
            Finding(
                "flash_attn",
                False,
                f"flash-attn {installed} is installed but does not work "
                f"({att.get('error') or 'wrong result'}); "
                "sft.flash_attn: auto would still pick it and training would crash",
                _flash_attn_fix(vendor, att.get("error", "")),
            )
        ]
    out = []
    # What sft will run on this node: the planner's own choice from the same facts. `auto` takes
    # the fastest kernel that runs here; an explicit varlen must run.
    chosen, why = node_attention(sft, facts, gpu)
    if want == "varlen" and gpu and "varlen" not in node_kernels(facts, gpu):
        out.append(
            Finding(
                "attention:varlen",
                False,
                f"sft.flash_attn is varlen (torch's varlen FlashAttention) but it fails here: "
                f"{att.get('varlen_error') or 'wrong result'}",
                "use a torch build with torch.nn.attention.varlen for this GPU (torch >= 2.10), or "
                "set sft.flash_attn: auto (flash-attn's kernel, else SDPA)",
            )
        )
    if gpu and att.get("sdpa_ok") is False:
        out.append(
            Finding(
                "attention",
                False,
                f"torch's SDPA fails on the GPU: {att.get('sdpa_error', 'non-finite output')}",
                "torch's GPU kernels do not run here: reinstall torch built for this GPU",
            )
        )
    if why:
        used = why.split(": ", 1)[1] if ": " in why else why
    elif want in ("sdpa", "disabled"):
        used = f"{want} (sft.flash_attn)"
    elif att.get("attention") == "fa2":
        used = f"flash-attn {installed}"
    else:
        used = "SDPA" + (" (flash-attn not installed)" if not installed else "")
    out.append(Finding("flash_attn", True, f"attention: {chosen if chosen != 'auto' else 'auto'}: {used}"))
    return out


def judge_canary(facts: dict) -> list[Finding]:
    """The numerics canary's verdict (llmft.env.canary), with the suspect its reruns named."""
    can = facts.get("canary")
    if not can:
        return []
    if can.get("ok") is None:
        return [Finding("canary", True, can.get("message", "not judged"))]
    took = f" in {can['seconds']:g} s" if can.get("seconds") is not None else ""
    if can["ok"]:
        leg = can.get("fp8")
        verdict = "passed" if leg and leg["ok"] else "failed, FP8 stays off"
        fp8 = f"; FP8 leg {verdict}: {leg['message']}" if leg else ""
        return [
            Finding("canary", True, f"training numerics match the golden curve{took}: {can['message']}{fp8}")
        ]
    fixes = {
        "attention": "set sft.flash_attn to another kernel (sdpa) and rebuild the failing one for this GPU "
        "(flash-attn with GPU_ARCHS=gfx942 on MI300X; a torch built for this arch)",
        "fused": "set sft.liger_kernel: false; update liger-kernel and Triton (pytorch-triton-rocm on ROCm)",
        "precision": "train in fp32 to confirm, then update the vendor BLAS / torch build (bf16 kernels)",
        "optimizer": "update torch (its fused AdamW) or set sft.extra: {optim: adamw_torch}",
        "learning_rate": "lower sft.learning_rate, check the scheduler and warm-up",
        "fp8": "set sft.fp8: auto (FP8 only where the canary's FP8 leg passes) or false; check torchao "
        "against the envs/ pin (verify_env's torchao finding)",
    }
    suspects = can.get("suspect") or []
    fix = (
        "; ".join(fixes[s] for s in suspects if s in fixes) or "compare the canary log with the golden curve"
    )
    return [
        Finding(
            "canary",
            False,
            f"training numerics are off on this node{took}: {can.get('message')}. "
            + (can.get("diagnosis") or ""),
            fix,
        )
    ]


def _judge_gpu_model(facts: dict, hw: Hardware) -> list[Finding]:
    """A declared hardware.gpu_model must be what the node has: the plan budgets its memory."""
    declared = hw.gpu_model.lower()
    devices = facts.get("devices", [])
    if not declared or not devices:
        return []
    if hardware.gpu_key(devices) == declared:
        return [Finding("gpu_model", True, f"{devices[0].get('name')} (hardware.gpu_model: {declared})")]
    return [
        Finding(
            "gpu_model",
            False,
            gpu_mismatch(declared, devices[0].get("name", "?"), facts.get("host", "this node")),
            "the plan's memory budget and MFU assume the declared GPU: make the partition and "
            "hardware.gpu_model agree",
        )
    ]


def _judge_packages(facts: dict, verify: Verify, vendor: str) -> list[Finding]:
    """verify.required_packages: each installed and importable."""
    out = []
    for pkg in verify.required_packages:
        ver = facts.get("packages", {}).get(pkg)
        imp = facts.get("imports", {}).get(pkg, {})
        if ver is None:
            out.append(
                Finding(
                    f"package:{pkg}", False, f"{pkg} is not installed", f"install it from envs/{vendor}.txt"
                )
            )
        elif not imp.get("ok", False):
            why = imp.get("error") or "its import did not complete (see probe)"
            out.append(
                Finding(
                    f"package:{pkg}",
                    False,
                    f"{pkg} {ver} fails to import: {why}",
                    "reinstall it against this torch build",
                )
            )
        else:
            out.append(Finding(f"package:{pkg}", True, f"{pkg} {ver}"))
    return out


def _judge_build(facts: dict, vendor: str) -> Finding:
    """torch's build (cpu, cuda, rocm) against the vendor the config asks for."""
    build = facts["build"]
    if vendor == "cpu":
        return Finding("build", True, f"torch {facts['torch_version']} ({build} build), CPU run")
    if build == vendor:
        return Finding(
            "build",
            True,
            f"torch {facts['torch_version']} ({build} {facts['hip_version'] or facts['cuda_version']})",
        )
    smi = facts.get("smi") or {}
    smi_gpus = smi.get("gpus", [])
    seen = ""
    if smi_gpus:
        archs = sorted({g.get("name") or g.get("arch", "") for g in smi_gpus})
        seen = f"; {smi.get('tool')} lists {len(smi_gpus)} GPU(s) ({', '.join(archs)})"
    fix = (
        "install torch's ROCm wheel (envs/rocm.txt) built for gfx942"
        if vendor == "rocm"
        else "install torch's CUDA wheel (envs/cuda.txt)"
    )
    return Finding(
        "build",
        False,
        f"the config asks for {vendor} but torch {facts['torch_version']} is a {build} build{seen}",
        fix,
    )


def _judge_gpu_count(facts: dict, hw: Hardware) -> list[Finding]:
    """torch sees at least hardware.gpus_per_node GPUs."""
    devices = facts.get("devices", [])
    smi = facts.get("smi") or {}
    smi_gpus = smi.get("gpus", [])
    want = hw.gpus_per_node
    if len(devices) >= want:
        return [Finding("gpu_count", True, f"{len(devices)} GPU(s)")]
    extra = ""
    if len(smi_gpus) > len(devices):
        extra = (
            f"; {smi.get('tool')} lists {len(smi_gpus)}: torch cannot open the rest "
            "(HIP_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES, permissions on /dev/kfd)"
        )
    env = {k: v for k, v in facts.get("env", {}).items() if k.endswith("VISIBLE_DEVICES") and v is not None}
    return [
        Finding(
            "gpu_count",
            False,
            f"{len(devices)} GPU(s) visible to torch, config asks for {want} per node{extra}"
            + (f" ({env})" if env else ""),
            "request all GPUs of the node (--gres=gpu:N, the profile's gres) or set "
            "hardware.gpus_per_node to what the node has",
        )
    ]


def _gpu_archs(facts: dict) -> list[str]:
    """The node's GPU architectures: torch's devices, else what the vendor tool lists."""
    smi_gpus = (facts.get("smi") or {}).get("gpus", [])
    return sorted({d["arch"].split(":")[0] for d in facts.get("devices", [])}) or sorted(
        {(g.get("name") or g.get("arch", "")).split(":")[0] for g in smi_gpus} - {""}
    )


def _judge_arch(facts: dict, vendor: str) -> list[Finding]:
    """Each GPU arch is in torch's build; on ROCm PYTORCH_ROCM_ARCH names it."""
    out = []
    archs = _gpu_archs(facts)
    built = {a.split(":")[0] for a in facts.get("arch_list", [])}
    for arch in archs:
        if vendor == "rocm":
            ok = arch in built
            fix = (
                f"torch was built for {sorted(built)}: install a ROCm wheel built for {arch} "
                f"(PYTORCH_ROCM_ARCH={arch}) or rebuild from source"
            )
        else:
            # CUDA wheels carry PTX for forward compatibility: an older sm_ still runs via JIT.
            cc = int(arch.split("_")[1]) if arch.startswith("sm_") else 0
            ok = any(int(b.split("_")[1]) <= cc for b in built if b.startswith(("sm_", "compute_")) and cc)
            fix = f"torch was built for {sorted(built)}: install a CUDA wheel that includes {arch}"
        out.append(
            Finding(
                f"arch:{arch}",
                ok,
                f"GPU arch {arch} {'is' if ok else 'is NOT'} in the torch build"
                + ("" if ok else " (kernels fail with hipErrorNoBinaryForGpu / illegal instruction)"),
                "" if ok else fix,
            )
        )
    if vendor != "rocm":
        return out
    env_arch = facts.get("env", {}).get("PYTORCH_ROCM_ARCH")
    if env_arch and not set(env_arch.replace(",", ";").split(";")) & set(archs):
        out.append(
            Finding(
                "PYTORCH_ROCM_ARCH",
                False,
                f"PYTORCH_ROCM_ARCH={env_arch} but the GPUs are {archs}: JIT-built ops "
                "(DeepSpeed, flash-attn) would target the wrong GPU",
                f"export PYTORCH_ROCM_ARCH={archs[0] if archs else 'gfx942'} and rebuild flash-attn and "
                "DeepSpeed ops (GPU_ARCHS=gfx942 pip install flash-attn --no-build-isolation "
                "--no-cache-dir)",
            )
        )
    elif env_arch:
        out.append(Finding("PYTORCH_ROCM_ARCH", True, f"PYTORCH_ROCM_ARCH={env_arch}"))
    return out


def _judge_gpu_memory(facts: dict) -> list[Finding]:
    """No other process holds a GPU's memory."""
    devices = facts.get("devices", [])
    busy = [d for d in devices if d.get("total_gib") and d["free_gib"] < 0.8 * d["total_gib"]]
    if busy:
        listed = ", ".join(f"GPU {d['index']}: {d['free_gib']} of {d['total_gib']} GiB free" for d in busy)
        return [
            Finding(
                "gpu_memory",
                False,
                f"another process holds GPU memory ({listed})",
                "find it with rocm-smi --showpids / nvidia-smi and stop it, or ask Slurm for exclusive nodes",
            )
        ]
    if devices:
        return [Finding("gpu_memory", True, f"{min(d['free_gib'] for d in devices)} GiB free per GPU")]
    return []


def judge(facts: dict, cfg: Config, vendor: str) -> list[Finding]:
    """Every per-node rule, applied to recorded facts. Pure: no machine access."""
    out: list[Finding] = []
    probe_error = facts.get("probe_error")
    if probe_error:
        out.append(_probe_finding(probe_error, vendor))
    out.extend(_judge_packages(facts, cfg.verify, vendor))
    out.extend(judge_bitsandbytes(facts, cfg.sft, vendor))
    out.extend(judge_torchao(facts, cfg.sft, vendor))
    if "build" not in facts:
        return out  # the probe died before torch loaded: the probe finding says why
    build = _judge_build(facts, vendor)
    out.append(build)
    if not build.ok:
        return out  # the GPU rules would only repeat the wrong build
    if vendor != "cpu":
        out.extend(_judge_gpu_count(facts, cfg.hardware))
        out.extend(_judge_gpu_model(facts, cfg.hardware))
        out.extend(_judge_arch(facts, vendor))
        out.extend(_judge_gpu_memory(facts))
    out.extend(_judge_attention(facts, cfg.sft, vendor))
    out.extend(_judge_ds(facts, cfg.sft, vendor))
    return out


def judge_torchao(facts: dict, sft: Sft, vendor: str) -> list[Finding]:
    """torchao against peft and torch (llmft.core.fp8.package_conflicts), and installed when sft.fp8
    is true. Without torchao, sft.fp8: auto stays off (the canary's FP8 leg cannot run)."""
    from llmft.core import fp8

    versions = facts.get("packages", {})
    out = [Finding("torchao", False, what, fix) for what, fix in fp8.package_conflicts(versions)]
    if versions.get("torchao") is None and sft.fp8 is True:
        pin = fp8._torchao_for(versions.get("torch") or "")
        out.append(
            Finding(
                "torchao",
                False,
                f"{fp8.SETTING_KEY}: true converts the model with torchao float8, which is not installed",
                f"pip install torchao=={pin} (envs/{vendor}.txt), or set {fp8.SETTING_KEY}: auto",
            )
        )
    return out


# Oldest bitsandbytes LLaMA-Factory accepts: 8 bit; 4 bit; 4 bit under ZeRO-3 (or auto, which may pick it).
BNB_MIN = {8: "0.37.0", 4: "0.39.0", "zero3": "0.43.0"}


def judge_bitsandbytes(facts: dict, sft: Sft, vendor: str) -> list[Finding]:
    """sft.quantization_bit (QLoRA): bitsandbytes installed, new enough, and its quantized layer ran
    on the node (nodefacts._bitsandbytes). Nothing to judge without quantization."""
    bits = sft.quantization_bit
    if bits == "none":
        return []
    check = "bitsandbytes"
    ver = facts.get("packages", {}).get("bitsandbytes")
    off = "or set sft.quantization_bit: none (plain LoRA, the base model in 16 bit)"
    if ver is None:
        return [
            Finding(
                check,
                False,
                f"sft.quantization_bit: {bits} loads the base model through bitsandbytes, which is not "
                "installed on this node",
                f"pip install bitsandbytes (a build for this torch: {vendor}; see envs/{vendor}.txt) {off}",
            )
        ]
    need = BNB_MIN["zero3"] if bits == 4 and sft.zero_stage in (3, "auto") else BNB_MIN[bits]
    if _version_tuple(ver) < _version_tuple(need):
        return [
            Finding(
                check,
                False,
                f"bitsandbytes {ver} is older than {need}, which LLaMA-Factory needs for {bits}-bit training"
                + (" under ZeRO-3" if need == BNB_MIN["zero3"] else ""),
                f"pip install 'bitsandbytes>={need}' {off}",
            )
        ]
    run = facts.get("bitsandbytes")
    if run is None:
        why = f"bitsandbytes {ver}: its {bits}-bit layer was not run (the probe stopped first)"
        return [Finding(check, False, why, "read the probe finding above")]
    if not run.get("ok"):
        return [
            Finding(
                check,
                False,
                f"bitsandbytes {ver} does not run a {bits}-bit layer on {run.get('device', 'this node')}: "
                f"{run.get('error')}",
                "install a bitsandbytes build that matches this torch and GPU (on ROCm its ROCm build; "
                f"python -m bitsandbytes prints what it found) {off}",
            )
        ]
    return [
        Finding(
            check,
            True,
            f"bitsandbytes {ver}: a {bits}-bit layer ran on {run.get('device')} "
            f"(relative error {run.get('relative_error')})",
        )
    ]


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in str(text).split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) or "0"
        parts.append(int(digits))
        if not piece.isdigit():
            break
    return tuple(parts)


def _judge_ds(facts: dict, sft: Sft, vendor: str) -> list[Finding]:
    ds = facts.get("deepspeed_ops") or {}
    if sft.zero_stage == 0:  # "auto" may still pick ZeRO: DeepSpeed must load
        return []
    if not ds.get("ok"):
        return [
            Finding(
                "deepspeed_ops",
                False,
                f"DeepSpeed does not load: {ds.get('error', 'not installed')}",
                "reinstall deepspeed against this torch build (envs/); on ROCm use the ROCm torch "
                "wheel first, then DeepSpeed",
            )
        ]
    out = []
    if vendor != "cpu" and ds.get("accelerator") not in ("cuda",):
        out.append(
            Finding(
                "deepspeed_ops",
                False,
                f"DeepSpeed chose the {ds.get('accelerator')!r} accelerator on a {vendor} node",
                "unset DS_ACCELERATOR (or set it to cuda, which also covers ROCm) and check that "
                "torch sees the GPUs",
            )
        )
    load = ds.get("cpu_adam_load")
    if sft.offload is True and load is not None and not load.get("ok"):
        out.append(
            Finding(
                "deepspeed_ops:cpu_adam",
                False,
                f"sft.offload needs DeepSpeed's CPU Adam, which does not build/load: {load.get('error')}",
                "install a C++ compiler and Python headers (build-essential, python3-dev) on the nodes, "
                "or set sft.offload: false",
            )
        )
    if not out:
        out.append(Finding("deepspeed_ops", True, f"DeepSpeed loads (accelerator {ds.get('accelerator')})"))
    return out


def _probe_finding(err: dict, vendor: str) -> Finding:
    where = err.get("last_step", "?")
    sig = err.get("signal")
    if err.get("timed_out"):
        return _slow_probe_finding(err, where)
    if sig:
        msg = f"the node probe was killed by {sig} in '{where}'"
        if sig == "SIGILL":
            arch = "gfx942 (PYTORCH_ROCM_ARCH=gfx942)" if vendor == "rocm" else "this GPU and CPU"
            fix = f"illegal instruction: a binary built for another architecture; rebuild it for {arch}"
        else:
            fix = "a native library crashed on import: reinstall it against this torch build"
    else:
        msg = (
            f"the node probe failed in '{where}' (exit {err.get('returncode')}): {err.get('stderr_tail', '')}"
        )
        fix = "see the verify_env log for the traceback"
    return Finding("probe", False, msg, fix)


def _slow_probe_finding(err: dict, where: str) -> Finding:
    """A probe part killed when the probe's own budget ran out: slow (or hung), not a broken collective."""
    part = err.get("part", "node facts")
    key = err.get("key", "verify.probe_timeout_seconds")
    took = f"after {err['seconds']:g} s" if "seconds" in err else "when it ran out"
    msg = (
        f"the node probe was too slow: its {part} part was still in '{where}' {took}, over the "
        f"probe's budget of {err.get('timeout_s'):g} s ({key}), and was killed; the collective check "
        "has a clock of its own"
    )
    fix = (
        "if the node is merely slow (a loaded machine, a cold compile cache, a first DeepSpeed op "
        f"build, the canary's FP8 leg), raise {key}"
    )
    if part == "numerics canary":
        fix += "; verify.canary: false skips the canary"
    else:
        fix += "; if it hangs, run `python -m llmft.env.nodefacts --out /tmp/f.json` on the node to see where"
    if "deepspeed" in where:
        fix += "; a stale DeepSpeed/torch extension build lock (~/.cache/torch_extensions) hangs it"
    return Finding("probe:timeout", False, msg, fix)


def _largest(rows: list[dict]) -> dict | None:
    return max(rows, key=lambda r: r["bytes"]) if rows else None


def _judge_collective_result(coll: dict, hw: Hardware) -> list[Finding]:
    """The collective ran over every process the config expects, and summed right."""
    out = []
    lay = hw.layout
    if coll["world_size"] != lay.world_size:
        out.append(
            Finding(
                "world_size",
                False,
                f"the collective ran over {coll['world_size']} processes, the config expects "
                f"{lay.world_size} ({lay.nodes} node(s) x {lay.processes_per_node})",
                "make the job's nodes match hardware.nodes",
            )
        )
    if not coll.get("sum_ok", False):
        out.append(
            Finding(
                "all_reduce:result",
                False,
                "an all-reduce returned a wrong sum: the transport corrupts data",
                "check the GPU fabric (rocm-smi / nvidia-smi for link errors) and the NCCL/RCCL version",
            )
        )
    return out


def _transport_where(coll: dict) -> str:
    """The transport in words: within a node, and between nodes on several."""
    tr = coll.get("transport", {})
    where = tr.get("intra", "")
    if coll.get("nnodes", 1) > 1 and tr.get("inter"):
        where += f"; between nodes {tr['inter']}"
    return where


def _judge_bandwidth(
    coll: dict,
    vendor: str,
    thresholds: hardware.Thresholds,
    spec: hardware.GpuSpec | None,
    env: dict | None,
) -> list[Finding]:
    """Bus bandwidth of the largest all-reduce and all-gather against hardware.py's floors."""
    out = []
    multi = coll.get("nnodes", 1) > 1
    where = _transport_where(coll)
    for op, floor in (
        ("all_reduce", thresholds.allreduce_busbw_gbs),
        ("all_gather", thresholds.allgather_busbw_gbs),
    ):
        big = _largest(coll["bandwidth"].get(op, []))
        if big is None:
            continue
        got = f"{op} bus bandwidth {big['busbw_gbs']:g} GB/s at {big['bytes'] / 2**20:g} MiB"
        if not floor:
            out.append(Finding(f"bandwidth:{op}", True, f"{got} ({thresholds.basis})"))
        elif big["busbw_gbs"] < floor:
            out.append(
                Finding(
                    f"bandwidth:{op}",
                    False,
                    f"{got}, below the {floor:g} GB/s a healthy node reaches ({thresholds.basis}); "
                    f"transport: {where or 'not reported'}",
                    _bandwidth_fix(vendor, spec, multi, env),
                )
            )
        else:
            out.append(Finding(f"bandwidth:{op}", True, f"{got} >= {floor:g} GB/s (transport: {where})"))
    return out


def _judge_transport(
    coll: dict, hw: Hardware, vendor: str, spec: hardware.GpuSpec | None, env: dict | None
) -> list[Finding]:
    """The links the library picked: the GPU fabric within a node, RDMA between nodes."""
    if vendor == "cpu":
        return []
    tr = coll.get("transport", {})
    if not tr.get("reported"):
        return [Finding("transport", True, f"{tr.get('library')}: transport not reported by the library")]
    multi = coll.get("nnodes", 1) > 1
    gpus = hw.gpus_per_node
    pcie = [t for t in tr.get("intra_path_types", []) if t in hardware.PCIE_PATHS]
    if gpus >= 2 and spec is not None and pcie:
        return [
            Finding(
                "transport",
                False,
                f"GPU-to-GPU traffic takes {', '.join(hardware.PCIE_PATHS[t] for t in pcie)} "
                f"(library path type {'/'.join(pcie)}), not {spec.fabric}",
                _bandwidth_fix(vendor, spec, False, env),
            )
        ]
    if gpus >= 2 and any(k.startswith("SHM") for k in tr.get("via", {})):
        return [
            Finding(
                "transport",
                False,
                "GPUs exchange data through host memory (SHM): peer-to-peer is off",
                "unset NCCL_P2P_DISABLE / NCCL_P2P_LEVEL; on ROCm check that the GPUs share an "
                "xGMI hive (rocm-smi --showtopotype); on NVIDIA check nvidia-smi topo -m",
            )
        ]
    if multi and "Socket" in tr.get("inter", ""):
        return [
            Finding(
                "transport",
                False,
                "nodes talk over TCP sockets (NET/Socket), not RDMA (InfiniBand/RoCE)",
                "set hardware.ib_hca (NCCL_IB_HCA) to the nodes' RDMA devices and check "
                "the RDMA driver (ibv_devinfo); hardware.socket_ifname for the bootstrap",
            )
        ]
    where = _transport_where(coll)
    return [Finding("transport", True, f"{tr.get('library')} {tr.get('version', '')}: {where}")]


def _judge_gemm(
    coll: dict, vendor: str, thresholds: hardware.Thresholds, spec: hardware.GpuSpec | None
) -> list[Finding]:
    """The slowest rank's GEMM against the GPU's floor: a throttled or shared GPU shows here."""
    ranks = coll.get("ranks", [])
    if not ranks:
        return []
    slow = min(ranks, key=lambda r: r["gemm_tflops"])
    got = (
        f"GEMM {slow['gemm_n']}^3 {slow['gemm_dtype']}: slowest {slow['gemm_tflops']:g} TFLOP/s "
        f"(rank {slow['rank']}, {slow['host']} {slow['device']})"
    )
    floor = thresholds.gemm_tflops
    if floor and slow["gemm_tflops"] < floor:
        tool = "rocm-smi" if vendor == "rocm" else "nvidia-smi -q -d PERFORMANCE"
        return [
            Finding(
                "gemm",
                False,
                f"{got}, below {floor:g} ({spec.name if spec else 'the table'})",
                f"the GPU is throttled or shared: check clocks, power and temperature ({tool}), "
                "other processes, and that torch uses the vendor BLAS (hipBLASLt / cuBLAS)",
            )
        ]
    return [Finding("gemm", True, got + (f" >= {floor:g}" if floor else " (not judged on CPU)"))]


def judge_collectives(
    coll: dict,
    hw: Hardware,
    vendor: str,
    thresholds: hardware.Thresholds,
    spec: hardware.GpuSpec | None,
    env: dict | None = None,
) -> list[Finding]:
    """Rules for the collective check against the config's hardware section: it ran, it summed right,
    bandwidth, transport, GEMM. Pure.

    `env`: the collective variables the nodes' launchers saw (facts["env"]), to name a cause.
    """
    if coll.get("failure"):
        f = coll["failure"]
        return [Finding(f["check"], False, f["message"], f["fix"])]
    return (
        _judge_collective_result(coll, hw)
        + _judge_bandwidth(coll, vendor, thresholds, spec, env)
        + _judge_transport(coll, hw, vendor, spec, env)
        + _judge_gemm(coll, vendor, thresholds, spec)
    )


def _bandwidth_fix(vendor: str, spec: hardware.GpuSpec | None, multi: bool, env: dict | None = None) -> str:
    p2p_off = (env or {}).get("NCCL_P2P_DISABLE")
    if p2p_off and p2p_off not in ("0", ""):
        # The commonest cause, left over from debugging a hang: say it first.
        return (
            f"NCCL_P2P_DISABLE={p2p_off} is set on the node: it forces GPU traffic through host "
            "memory; unset it (job script, module file, ~/.bashrc) and rerun"
        )
    if multi:
        return (
            "between nodes: set hardware.ib_hca (NCCL_IB_HCA) and hardware.socket_ifname to the "
            "fabric NICs, check RDMA (ibv_devinfo); rerun with NCCL_DEBUG=INFO to see NET/IB vs NET/Socket"
        )
    if vendor == "rocm":
        return (
            "GPU traffic is going over PCIe instead of xGMI (a cause of RCCL timeouts): check "
            "`rocm-smi --showtopotype` shows XGMI between every GPU pair, keep the job's GPUs in one "
            "xGMI hive / under one PCIe root complex, unset NCCL_P2P_DISABLE, keep "
            "HSA_FORCE_FINE_GRAIN_PCIE=1; set hardware.socket_ifname to the fabric NIC"
        )
    fabric = spec.fabric if spec else "NVLink"
    return (
        f"GPU traffic is not using {fabric}: check `nvidia-smi topo -m` (NV# between GPUs), "
        "that nvidia-fabricmanager runs on NVSwitch systems, and that NCCL_P2P_DISABLE is unset"
    )


def gpu_spec(hw: Hardware, nodes: list[dict]) -> hardware.GpuSpec | None:
    """The GPU verify_env's thresholds are for: the declared hardware.gpu_model, else the nodes' own."""
    devices = [d for facts in nodes for d in facts.get("devices", [])]
    return hardware.GPUS.get(hw.gpu_model.lower() or hardware.gpu_key(devices))


def judge_run(
    nodes: list[dict], coll: dict, cfg: Config, vendor: str, alloc_nodes: int
) -> tuple[list[Finding], hardware.Thresholds]:
    """All rules over every node's facts and the collective check."""
    findings: list[Finding] = []
    hw = cfg.hardware
    if alloc_nodes != hw.nodes:
        findings.append(
            Finding(
                "allocation",
                False,
                f"the job has {alloc_nodes} node(s) but hardware.nodes is {hw.nodes}",
                "make the Slurm resources (nodes) and hardware.nodes agree",
            )
        )
    for facts in nodes:
        for f in judge(facts, cfg, vendor) + judge_canary(facts):
            if len(nodes) > 1:
                f.check = f"{f.check}@{facts.get('host', '?')}"
            findings.append(f)
    spec = gpu_spec(hw, nodes) if vendor != "cpu" else None
    thresholds = hardware.collective_thresholds(
        spec, hw.gpus_per_node, max(alloc_nodes, len(nodes)), cfg.verify
    )
    env = {k: v for facts in nodes for k, v in facts.get("env", {}).items() if v}
    findings.extend(judge_collectives(coll, hw, vendor, thresholds, spec, env))
    return findings, thresholds
