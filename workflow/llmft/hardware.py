"""Vendor facts in one place: ROCm vs CUDA, architecture names, peak FLOP/s, collective presets.

Everything that differs between an MI300X node (ROCm, HIP torch build, RCCL over Infinity Fabric)
and an H100/H200 node (CUDA, NCCL over NVLink) lives here, so the rest of the code asks questions
("which collective library?", "what is this GPU's bf16 peak?") instead of branching on vendors.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GpuSpec:
    """What we know about one GPU model."""

    name: str
    vendor: str  # "rocm" or "cuda"
    arch: str  # gfx942 / sm_90
    peak_bf16_tflops: float  # dense, vendor datasheet
    memory_gib: float
    # Thresholds for verify_env: a healthy node reaches these; below them something is wrong
    # (PCIe instead of xGMI/NVLink, a throttled GPU, a wrong build). Bus bandwidth in GB/s at 1 GiB.
    min_gemm_tflops: float
    min_allreduce_busbw_gbs: float
    min_allgather_busbw_gbs: float


# Thresholds sit well under measured healthy values (H200: FACTS.md, 795 TFLOP/s bf16 GEMM,
# all-reduce 165 GB/s and all-gather 270 GB/s between two GPUs over NVLink) yet far above what a
# PCIe fallback delivers (~20-50 GB/s), so the check separates "healthy" from "wrong transport".
GPUS: dict[str, GpuSpec] = {
    "mi300x": GpuSpec("AMD Instinct MI300X", "rocm", "gfx942", 1307.4, 192, 500, 80, 120),
    "mi250x": GpuSpec("AMD Instinct MI250X", "rocm", "gfx90a", 383.0, 64, 150, 40, 60),
    "h200": GpuSpec("NVIDIA H200", "cuda", "sm_90", 989.0, 141, 450, 80, 120),
    "h100": GpuSpec("NVIDIA H100", "cuda", "sm_90", 989.0, 80, 450, 80, 120),
    "a100": GpuSpec("NVIDIA A100", "cuda", "sm_80", 312.0, 80, 150, 40, 60),
}


def identify_gpu(device_name: str, arch: str = "") -> GpuSpec | None:
    """Map a torch device name (and arch, e.g. gfx942) to a known spec, or None."""
    lowered = device_name.lower().replace(" ", "")
    for key, spec in GPUS.items():
        if key in lowered:
            return spec
    base_arch = arch.split(":")[0]
    for spec in GPUS.values():
        if base_arch and spec.arch == base_arch:
            return spec
    return None


def cuda_arch_name(major: int, minor: int) -> str:
    """Compute capability (9, 0) -> 'sm_90'."""
    return f"sm_{major}{minor}"


@dataclass(frozen=True)
class CollectivePreset:
    """Environment for the collective library on one vendor's nodes."""

    library: str  # "rccl" / "nccl" / "gloo"
    backend: str  # torch.distributed backend
    env: dict[str, str] = field(default_factory=dict)


def collective_preset(
    vendor: str, socket_ifname: str = "", ib_hca: str = "", rocm_arch: str = "gfx942"
) -> CollectivePreset:
    """The collective environment for a vendor ("rocm", "cuda" or "cpu").

    RCCL reads the NCCL_* names. Error handling is async so a dead peer fails the job instead of
    hanging it; NVLink SHARP / multicast stays off (it needs fabric manager support and, on shared
    hosts, can wedge the GPU).
    """
    common = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_NVLS_ENABLE": "0"}
    if socket_ifname:
        common["NCCL_SOCKET_IFNAME"] = socket_ifname
        common["GLOO_SOCKET_IFNAME"] = socket_ifname
    if ib_hca:
        common["NCCL_IB_HCA"] = ib_hca
    if vendor == "rocm":
        env = dict(common)
        env.update(
            {
                # Build and JIT kernels for MI300X only; a wrong value is the seed's
                # "illegal instruction" / hipErrorNoBinaryForGpu.
                "PYTORCH_ROCM_ARCH": rocm_arch,
                "HSA_FORCE_FINE_GRAIN_PCIE": "1",
                # MSCCL's alternative algorithms have hung multi-node jobs on some RCCL releases.
                "RCCL_MSCCL_ENABLE": "0",
            }
        )
        return CollectivePreset("rccl", "nccl", env)
    if vendor == "cuda":
        env = dict(common)
        env.update({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
        return CollectivePreset("nccl", "nccl", env)
    gloo = {k: v for k, v in common.items() if k.startswith("GLOO")}
    return CollectivePreset("gloo", "gloo", gloo)


def mfu(tokens_per_s_per_gpu: float, n_params: float, peak_tflops: float, attn_flops_per_token=0.0):
    """Model FLOPs utilisation: (6N + attention FLOPs) per token, against the dense bf16 peak."""
    if peak_tflops <= 0:
        return 0.0
    return tokens_per_s_per_gpu * (6.0 * n_params + attn_flops_per_token) / (peak_tflops * 1e12)
