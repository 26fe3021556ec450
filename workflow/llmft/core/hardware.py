"""Vendor facts in one place: ROCm vs CUDA, architecture names, peak FLOP/s, collective presets.

Everything that differs between an MI300X node (ROCm, HIP torch build, RCCL over Infinity Fabric)
and an H100/H200 node (CUDA, NCCL over NVLink) lives here, so the rest of the code asks questions
("which collective library?", "what is this GPU's bf16 peak?") instead of branching on vendors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmft.core.settings import Verify


@dataclass(frozen=True)
class GpuSpec:
    """What we know about one GPU model, and what verify_env expects of a healthy one."""

    name: str
    vendor: str  # "rocm" or "cuda"
    arch: str  # gfx942 / sm_90
    peak_bf16_tflops: float  # dense, vendor datasheet, per torch device
    memory_gib: float
    fabric: str  # the GPU-to-GPU link inside a node: "xGMI", "NVLink"
    # "switch": every GPU reaches every other at its full link rate (NVSwitch), so bus bandwidth
    # does not depend on the GPU count. "mesh": one dedicated link per GPU pair (MI300X xGMI), so
    # bus bandwidth grows with the number of peers a collective can use.
    fabric_topology: str
    # Floors for verify_env: a healthy node reaches these; below them something is wrong (PCIe
    # instead of the fabric, a throttled GPU, a slow build). bf16 GEMM TFLOP/s per GPU at 8192^3;
    # bus bandwidth in GB/s (nccl-tests definition) at the largest message, per GPU for "switch",
    # per peer link for "mesh".
    min_gemm_tflops: float
    min_busbw_gbs: float


# Floors sit at about half of healthy values yet above what a PCIe fallback delivers (PCIe Gen5 x16
# carries at most ~50 GB/s a direction), so the check separates "healthy" from "wrong transport".
#  - H200: from what 2 x H200 measured over NVLink, as nccl-tests' bus bandwidth
#    (bench/results/verify_env_h200x2.md, which also says why another tool's all-reduce figure of
#    half that is the same measurement).
#  - MI300X: xGMI links of 64 GB/s a direction, 48 GB/s after protocol overhead (RCCL's own model,
#    ROCm/rccl#1210), one per GPU pair; 8 GPUs give 7 links per GPU. GEMM floor well under the
#    ~600+ TFLOP/s hipBLASLt reaches on 8192^3 (datasheet dense peak 1307).
#  - MI250X: one torch device is one GCD (half the package): 191.5 TFLOP/s bf16 peak.
GPUS: dict[str, GpuSpec] = {
    "mi300x": GpuSpec("AMD Instinct MI300X", "rocm", "gfx942", 1307.4, 192, "xGMI", "mesh", 400, 24),
    "mi250x": GpuSpec("AMD Instinct MI250X", "rocm", "gfx90a", 191.5, 64, "xGMI", "mesh", 100, 15),
    "h200": GpuSpec("NVIDIA H200", "cuda", "sm_90", 989.0, 141, "NVLink", "switch", 500, 120),
    "h100": GpuSpec("NVIDIA H100", "cuda", "sm_90", 989.0, 80, "NVLink", "switch", 500, 120),
    "a100": GpuSpec("NVIDIA A100", "cuda", "sm_80", 312.0, 80, "NVLink", "switch", 200, 80),
}

# Between nodes the network sets the pace: one 400 Gb/s RDMA NIC per GPU gives ~45 GB/s bus
# bandwidth; NCCL/RCCL falling back to TCP sockets (NET/Socket) gives well under 12.
MIN_INTERNODE_BUSBW_GBS = 20.0


@dataclass(frozen=True)
class Thresholds:
    """What verify_env demands of one allocation; 0 means "not judged" (CPU runs)."""

    gemm_tflops: float
    allreduce_busbw_gbs: float
    allgather_busbw_gbs: float
    basis: str  # one line saying where the numbers come from


def collective_thresholds(
    spec: GpuSpec | None, gpus_per_node: int, nnodes: int, overrides: Verify | None = None
) -> Thresholds:
    """Floors for GEMM and bus bandwidth given the GPU model and the layout.

    `overrides`: the config's verify section, whose non-zero verify.min_* keys win over the table.
    """
    if spec is None:
        gemm = busbw = 0.0
        basis = "no GPU model known: measured, not judged"
    else:
        gemm = spec.min_gemm_tflops
        if gpus_per_node < 2:
            busbw, where = 0.0, "one GPU per node: no intra-node link to judge"
        elif spec.fabric_topology == "mesh":
            busbw = spec.min_busbw_gbs * (gpus_per_node - 1)
            where = f"{spec.fabric} mesh, {gpus_per_node - 1} peer link(s) x {spec.min_busbw_gbs:g} GB/s"
        else:
            busbw, where = spec.min_busbw_gbs, f"{spec.fabric} switch"
        if nnodes > 1:
            busbw = min(busbw, MIN_INTERNODE_BUSBW_GBS) if busbw else MIN_INTERNODE_BUSBW_GBS
            where += f"; {nnodes} nodes: the network floor {MIN_INTERNODE_BUSBW_GBS:g} GB/s"
        basis = f"{spec.name}: {where}"
    over = overrides or Verify()  # the schema's defaults: no override
    allreduce = over.min_allreduce_busbw_gbs or busbw
    allgather = over.min_allgather_busbw_gbs or busbw
    if over.min_gemm_tflops or over.min_allreduce_busbw_gbs or over.min_allgather_busbw_gbs:
        basis += " (config overrides)"
    gemm = over.min_gemm_tflops or gemm
    return Thresholds(float(gemm), float(allreduce), float(allgather), basis)


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


def gpu_key(devices: list[dict]) -> str:
    """The table key of the nodes' GPU ("mi300x", "h200", ...) from the first device torch reported
    (name, arch); "" when the table does not know it. The platform, verify_env's gpu_model rule and
    its thresholds all ask this one question."""
    first = devices[0] if devices else {}
    spec = identify_gpu(first.get("name", ""), first.get("arch", ""))
    return next((key for key, known in GPUS.items() if known is spec), "")


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
                # Build and JIT kernels for MI300X only; a wrong value gives
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


# How NCCL/RCCL name the path between two GPUs in their topology search ("type NVL/PIX" in the
# NCCL_DEBUG_SUBSYS=GRAPH line). RCCL prints XGMI where NCCL prints NVL. The PCIe kinds are the
# slow fallback: traffic through a PCIe switch (PIX/PXB), the CPU's root complex (PHB) or across
# CPU sockets (SYS), instead of the fabric.
FABRIC_PATHS = {"NVL": "NVLink", "NVB": "NVLink (via a GPU)", "XGMI": "xGMI", "C2C": "chip-to-chip"}
PCIE_PATHS = {
    "PIX": "PCIe (one switch)",
    "PXB": "PCIe (several switches)",
    "PXN": "PCIe (through a peer GPU)",
    "P2C": "PCIe (via the CPU)",
    "PHB": "PCIe (through the CPU root complex)",
    "SYS": "PCIe + CPU interconnect (across sockets)",
}
