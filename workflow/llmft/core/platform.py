"""The machines a run trains on, decided once: vendor, layout, GPU, torch build, kernels, host memory.

A `Platform` is built in one of two ways and then handed to everything that needs it (the planner,
the renderer, the node launcher, the report) instead of each re-deriving vendor or GPU from the
config:

- `Platform.from_facts(cfg, nodes)`: from what verify_env measured on the allocated nodes (its
  verify.json). This is what `render_sft_config` plans with, so a login node without GPUs renders
  the same YAML as the training node would: its own torch build never enters the plan.
- `Platform.declared(cfg)`: from what the config declares alone (`hardware.*`), for the check made
  when the workflow is parsed and for `python -m llmft plan` without facts. What the config leaves
  open is assumed generously (the largest known GPU, every kernel), so that early check refuses only
  a config that could fit on no node; the real plan comes later, from the facts.

Where the config declares a value (`hardware.vendor`, `hardware.gpu_model`) and the nodes disagree,
`from_facts` refuses with both named (verify_env reports the same finding).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from llmft.core import hardware
from llmft.core.config import ConfigError, Layout
from llmft.core.settings import Config, Hardware, Sft

# Attention kernels a node can run, fastest first for neat packing: torch's varlen FlashAttention
# (torch >= 2.10), the flash-attn package (CUDA, or its ROCm build), SDPA (always).
KERNELS = ("varlen", "fa2", "sdpa")


def host_memory_gib() -> float:
    """This host's MemTotal in GiB (0 when /proc/meminfo cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return 0.0


@dataclass(frozen=True)
class Platform:
    """Where one run trains. Every field is a fact of the nodes, or (source says so) the config's word."""

    vendor: str
    """cpu, cuda or rocm."""
    nodes: int
    gpus_per_node: int
    processes_per_node: int
    gpu: str
    """hardware.GPUS key (mi300x, h200, ...), the device's own name when unknown, or cpu."""
    device_memory_gib: float
    """Memory per training process: one GPU's, or on CPU the host's share per process."""
    arch: str
    """gfx942, sm_90, ... ("" on CPU or when not known)."""
    torch: str
    """torch version on the nodes ("" when not measured)."""
    attention: tuple[str, ...]
    """Attention kernels that ran correctly on every node (subset of KERNELS)."""
    liger: bool
    """liger-kernel and Triton import on every node."""
    host_memory_gib: float
    """Host memory per node in GiB (0 = not known: CPU offload is then not checked against it)."""
    source: str
    """Where these facts come from, one line for the rendered YAML's header."""
    hosts: tuple[str, ...] = ()
    collective_env: dict = field(default_factory=dict)
    """The collective library's environment (RCCL/NCCL/Gloo preset) for these nodes."""
    host_cpus: int = 0
    """CPU cores a training job gets per node (0 = not known); DeepSpeed's CPU Adam runs on them."""
    fp8_canary: bool = False
    """The numerics canary's FP8 leg passed on every node (llmft.env.canary); sft.fp8: auto needs it."""

    @property
    def on_gpu(self) -> bool:
        return self.vendor != "cpu"

    @property
    def layout(self) -> Layout:
        return Layout(self.nodes, self.gpus_per_node, self.processes_per_node)

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def spec(self) -> hardware.GpuSpec | None:
        return hardware.GPUS.get(self.gpu)

    def describe(self) -> str:
        kernels = ", ".join(self.attention) or "none"
        if self.on_gpu:
            what = (
                f"{self.nodes} node(s) x {self.gpus_per_node} {self.spec.name if self.spec else self.gpu} "
                f"({self.device_memory_gib:g} GiB, {self.arch or 'arch unknown'}), {self.vendor}"
            )
        else:
            what = (
                f"{self.nodes} node(s) x {self.processes_per_node} CPU process(es) "
                f"({self.device_memory_gib:g} GiB each)"
            )
        host = (
            f"{self.host_memory_gib:g} GiB host memory per node"
            if self.host_memory_gib
            else "host memory not known"
        )
        torch = f"torch {self.torch}" if self.torch else "torch not measured"
        return f"{what}; {torch}; attention kernels {kernels}; liger {'yes' if self.liger else 'no'}; {host}"

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(attention=list(self.attention), hosts=list(self.hosts))
        return out

    @classmethod
    def from_json(cls, data: dict) -> Platform:
        data = dict(data)
        data["attention"] = tuple(data.get("attention", ()))
        data["hosts"] = tuple(data.get("hosts", ()))
        return cls(**data)

    @classmethod
    def from_facts(cls, cfg: Config, nodes: list[dict], where: str = "verify_env") -> Platform:
        """The platform the nodes reported (verify.json's `nodes`); refuses facts contradicting the config."""
        if not nodes:
            raise ConfigError(f"{where} recorded no node facts: rerun verify_env")
        hw = cfg.hardware
        lay = hw.layout
        hosts = tuple(str(f.get("host", "?")) for f in nodes)
        builds = {f.get("build") for f in nodes}
        if None in builds:
            broken = [h for h, f in zip(hosts, nodes, strict=True) if not f.get("build")]
            raise ConfigError(
                f"{where}: the probe on {', '.join(broken)} "
                "did not get as far as loading torch; see its verify_env findings"
            )
        if len(builds) > 1:
            raise ConfigError(
                f"{where}: the nodes run different torch builds ({sorted(builds)}); one stack for all"
            )
        build = builds.pop()
        vendor = "cpu" if hw.gpus_per_node == 0 else build
        if hw.vendor not in ("auto", vendor):
            raise ConfigError(
                f"config key hardware.vendor: {hw.vendor!r} but torch on {hosts[0]} is a {build} build "
                f"(torch {nodes[0].get('torch_version')}); install the {hw.vendor} stack "
                "or set vendor: auto"
            )
        if vendor == "cpu" and hw.gpus_per_node:
            raise ConfigError(
                f"config key hardware.gpus_per_node: {hw.gpus_per_node} but torch on {hosts[0]} "
                "is a CPU build"
            )
        kernels = tuple(k for k in KERNELS if all(kernel_ok(f, k, vendor != "cpu") for f in nodes))
        liger = all(
            (f.get("modules") or {}).get("liger_kernel") and (f.get("modules") or {}).get("triton")
            for f in nodes
        )
        host_mem = min((float(f.get("host_memory_gib") or 0) for f in nodes), default=0.0)
        cpus = min((int(f.get("host_cpus") or 0) for f in nodes), default=0)
        torch = nodes[0].get("torch_version", "")
        source = f"measured by {where} on {', '.join(hosts)}"
        if vendor == "cpu":
            mem = (host_mem or host_memory_gib()) / max(1, lay.processes_per_node)
            return cls._of(
                hw, "cpu", "cpu", round(mem, 2), "", torch, kernels, liger, host_mem, source, hosts, cpus
            )
        devices = [d for f in nodes for d in f.get("devices", [])]
        if not devices:
            raise ConfigError(f"{where}: torch sees no GPU on {', '.join(hosts)}; see the gpu_count finding")
        first = devices[0]
        key = hardware.gpu_key(devices) or first.get("name", "gpu")
        declared = hw.gpu_model.lower()
        if declared and declared != key:
            raise ConfigError(gpu_mismatch(declared, first.get("name", key), hosts[0]))
        arch = first.get("arch", "").split(":")[0]
        mem = min(float(d.get("total_gib") or 0) for d in devices)
        fp8_ok = all(((f.get("canary") or {}).get("fp8") or {}).get("ok") is True for f in nodes)
        plat = cls._of(hw, vendor, key, mem, arch, torch, kernels, liger, host_mem, source, hosts, cpus)
        return dataclasses.replace(plat, fp8_canary=fp8_ok)

    @classmethod
    def declared(cls, cfg: Config, vendor: str = "") -> Platform:
        """What the config says, with generous assumptions for what it leaves open (see the module doc).

        `vendor` overrides `hardware.vendor: auto` where the caller knows it (verify_env on its node).
        """
        hw = cfg.hardware
        vendor = vendor or ("cpu" if hw.on_cpu else hw.vendor)
        if vendor == "cpu":
            host = host_memory_gib()
            mem = (host or 16.0) / max(1, hw.layout.processes_per_node)
            source = "this host (CPU run, not yet measured)"
            return cls._of(hw, "cpu", "cpu", round(mem, 2), "", "", KERNELS, False, host, source)
        key = hw.gpu_model.lower()
        if key and key not in hardware.GPUS:
            raise ConfigError(
                f"config key hardware.gpu_model: unknown GPU {key!r}; "
                f"known: {', '.join(sorted(hardware.GPUS))}"
            )
        if key:
            spec = hardware.GPUS[key]
            source = f"declared by the config (hardware.gpu_model: {key}), not yet measured"
        else:
            pool = [(k, s) for k, s in hardware.GPUS.items() if vendor in ("auto", s.vendor)]
            key, spec = max(pool, key=lambda ks: ks[1].memory_gib)
            source = (
                f"not measured and hardware.gpu_model not set: assumed the largest known GPU ({key}) "
                "for this check only"
            )
        vendor = spec.vendor if vendor == "auto" else vendor
        return cls._of(hw, vendor, key, spec.memory_gib, spec.arch, "", KERNELS, True, 0.0, source)

    @classmethod
    def _of(
        cls,
        hw: Hardware,
        vendor,
        gpu,
        memory,
        arch,
        torch,
        kernels,
        liger,
        host_mem,
        source,
        hosts=(),
        cpus=0,
    ) -> Platform:
        """The hardware section's layout and the collective preset for `vendor`, with the given facts."""
        lay = hw.layout
        gpus = 0 if vendor == "cpu" else lay.gpus_per_node
        env = _collective_env(hw, vendor, arch)
        return cls(vendor, lay.nodes, gpus, lay.processes_per_node, gpu, memory, arch, torch, kernels,
                   liger, host_mem, source, hosts, env, cpus)  # fmt: skip


def gpu_mismatch(declared: str, seen: str, host: str) -> str:
    spec = hardware.GPUS.get(declared)
    return (
        f"config key hardware.gpu_model: {declared} ({spec.name if spec else declared}) "
        f"but {host} has {seen}; "
        f"submit to the {declared} partition (the profile's slurm_partition / gres) or set "
        "hardware.gpu_model to what the node has (empty = take it from the node)"
    )


def node_kernels(facts: dict, gpu: bool) -> tuple[str, ...]:
    """The attention kernels that ran correctly on the node these facts describe (a subset of KERNELS)."""
    return tuple(k for k in KERNELS if kernel_ok(facts, k, gpu))


def node_attention(sft: Sft, facts: dict, gpu: bool) -> tuple[str, str]:
    """The attention sft's planner picks on the node these facts describe, and why (choose_attention
    over the node's kernels, sft.packing resolved for the node)."""
    kernels = node_kernels(facts, gpu)
    torch = facts.get("torch_version", "")
    return choose_attention(sft.flash_attn, sft.packing_on(gpu), kernels, gpu, torch, sft.precision)


def kernel_ok(facts: dict, kernel: str, gpu: bool) -> bool:
    att = facts.get("attention") or {}
    if kernel == "sdpa":
        return att.get("sdpa_ok", True) is not False
    if not gpu:
        return False  # varlen and flash-attn are GPU kernels; on CPU llmft.core.varlen loops over SDPA
    if kernel == "varlen":
        return bool(att.get("varlen_ok"))
    return bool(att.get("import_ok") and att.get("kernel_ok"))


def _collective_env(hw: Hardware, vendor: str, arch: str) -> dict:
    rocm_arch = arch if arch.startswith("gfx") else "gfx942"
    return dict(hardware.collective_preset(vendor, hw.socket_ifname, hw.ib_hca, rocm_arch).env)


def read_platform(cfg: Config, verify_path: str | Path) -> Platform:
    """The platform verify_env measured, from its report (or from one node's facts, as
    `python -m llmft.env.nodefacts --out` writes them, for every node of the config's layout)."""
    from llmft.core.io import read_json

    report = read_json(verify_path)
    nodes = report.get("nodes")
    if nodes is None and "build" in report:
        nodes = [report] * cfg.hardware.nodes
    return Platform.from_facts(cfg, nodes or [], where=f"verify_env ({verify_path})")


# The FlashAttention kernels (torch's varlen, flash-attn) compute in fp16/bf16 only: under
# sft.precision fp32 they fail at the first step ("FlashAttention only support fp16 and bf16").
FLASH_KERNELS = ("varlen", "fa2")


def choose_attention(
    setting: str,
    packing: str,
    kernels: tuple[str, ...],
    on_gpu: bool,
    torch: str = "",
    precision: str = "bf16",
) -> tuple[str, str]:
    """The attention sft runs, and why: for `auto` the fastest kernel that ran on every node.

    Neat packing keeps packed samples apart: torch's varlen kernel or flash-attn's varlen path do it
    over each sample's own triangle; SDPA needs LLaMA-Factory's 4-D mask (the planner counts its
    memory). Other packing leaves `auto` to LLaMA-Factory, which sets nothing: transformers then takes SDPA.
    Under sft.precision fp32 on a GPU no FlashAttention kernel runs: `auto` takes SDPA and an
    explicit one is a config error naming both keys. verify_env's attention finding reports the
    same choice from the same facts.
    """
    if on_gpu and precision == "fp32" and setting in FLASH_KERNELS:
        raise ConfigError(
            f"config key sft.flash_attn: {setting} is a FlashAttention kernel, which computes in "
            "fp16/bf16 only, and sft.precision is fp32: set sft.precision: bf16 (the GPU setting) "
            "or sft.flash_attn: auto (SDPA under fp32)"
        )
    if setting != "auto" or packing != "neat" or not on_gpu:
        return setting, ""
    if precision == "fp32":
        return "sdpa", (
            "attention sdpa with neat packing's 4-D mask: sft.precision is fp32 and the "
            "FlashAttention kernels (varlen, flash-attn) compute in fp16/bf16 only"
        )
    if "varlen" in kernels:
        return "varlen", "attention varlen: torch's FlashAttention kernel over each packed sample"
    if "fa2" in kernels:
        return "fa2", (
            "attention fa2: flash-attn's varlen kernel over each packed sample "
            f"(torch {torch or '?'} has no working torch.nn.attention.varlen)"
        )
    return (
        "sdpa",
        "attention sdpa with neat packing's 4-D mask: neither varlen nor flash-attn runs on the nodes",
    )
