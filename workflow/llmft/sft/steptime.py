"""How long one optimizer step of a candidate plan takes, estimated, so the planner can rank the plans
that fit by speed instead of by a fixed preference order.

A step is `accumulation` micro-steps plus the optimizer. Each part is a rate applied to a count:

- compute: model FLOPs per token (flops.py: 6 x matrix weights, 4 x for frozen weights that get no
  weight gradients, plus causal attention over the span each token sees) at an efficiency that grows with
  the tokens in a micro-batch (small GEMMs run below peak); gradient checkpointing adds the forward
  once more (2 x parameters + the attention forward per token);
- ZeRO collectives per micro-step (ZeRO-3 gathers the 16-bit weights for forward and backward and
  reduce-scatters gradients; ZeRO-2 reduce-scatters gradients and gathers the updated weights once per
  step), at the fabric's bus bandwidth, half hidden behind compute;
- CPU offload (ZeRO-3 + offload): each GPU's weight shard crosses PCIe for forward and backward and
  its gradients come back, every micro-step; DeepSpeed's CPU Adam steps the fp32 states on the host,
  at a rate per core capped by host memory bandwidth.

The constants are stated next to each and were fitted to runs on H200s (bench/results/); the point
is the ranking, which moves only when a part changes by a large factor (CPU offload of a 70 B model
costs tens of seconds a step, recompute a third more compute).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from llmft.core import flops

# Best model-FLOPs utilisation of a large micro-batch, and the micro-batch size (tokens) at which half
# of it is reached. Fitted to the 1.24 B and 4.5 B ZeRO-2 steps measured on one H200
# (bench/results/steptime_check_h200x1.md).
MFU_MAX = 0.55
TOKENS_AT_HALF = 1024
# Host <-> GPU copy rate per GPU that DeepSpeed's offload reaches (pinned buffers, PCIe Gen4/5 x16),
# and DeepSpeed CPU Adam's rate per core: fitted together to one H200's 1.24 B ZeRO-3 + offload
# step (same file).
PCIE_GBS = 30.0
CPU_ADAM_PARAMS_PER_S_PER_CORE = 1.5e8
HOST_MEMORY_GBS = 200.0
CPU_ADAM_BYTES_PER_PARAM = 28.0
# Share of collective time that overlap_comm / prefetching hides behind compute.
COMM_HIDDEN = 0.5
# A CPU run has no peak table: a nominal rate keeps the ranking (times are not reported).
CPU_TFLOPS = 1.0
# Between nodes: one 400 Gb/s RDMA NIC per GPU gives ~45 GB/s bus bandwidth.
INTERNODE_BUSBW_GBS = 45.0


@dataclass(frozen=True)
class StepTime:
    """Estimated seconds of one optimizer step, by part, and the tokens/s per GPU it implies."""

    compute_s: float
    comm_s: float
    offload_s: float
    tokens_per_step: int
    world: int

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.offload_s

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.world / self.total_s if self.total_s else 0.0

    def to_json(self) -> dict:
        out = {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}
        out.update(total_s=round(self.total_s, 4), tokens_per_s_per_gpu=round(self.tokens_per_s_per_gpu, 1))
        return out


def efficiency(tokens: float) -> float:
    """MFU a micro-batch of `tokens` reaches, saturating at MFU_MAX."""
    return MFU_MAX * tokens / (tokens + TOKENS_AT_HALF)


def bus_bandwidth_gbs(platform) -> float:
    """Healthy bus bandwidth for the run's collectives: between nodes the network, inside one the fabric.

    verify_env's floors (hardware.py) sit at about half of healthy values: twice the floor.
    """
    spec = platform.spec
    if platform.nodes > 1:
        return INTERNODE_BUSBW_GBS
    if spec is None or platform.processes_per_node < 2:
        return 0.0
    if spec.fabric_topology == "mesh":
        return 2 * spec.min_busbw_gbs * (platform.processes_per_node - 1)
    return 2 * spec.min_busbw_gbs


def cpu_adam_params_per_s(platform) -> float:
    cores = platform.host_cpus or 32
    return min(cores * CPU_ADAM_PARAMS_PER_S_PER_CORE, HOST_MEMORY_GBS * 1e9 / CPU_ADAM_BYTES_PER_PARAM)


def fp8_flops_equivalent(shape, per_token: float, tuning: flops.Tuning) -> float:
    """bf16-equivalent FLOPs per token with FP8 decoder layers: the output head (forward, input
    gradient, and its weight gradient when it trains) stays bf16; the rest runs at the whole step's
    measured FP8 ratio at the model's size (llmft.core.fp8.pipeline_ratio), not the
    decoder layer's alone (MEASURED_SPEEDUP), which the casts around it do not reach."""
    from llmft.core import fp8

    head = float(shape.vocab * shape.hidden) * (6.0 if tuning.kind == "full" else 4.0)
    speedup, _ = fp8.pipeline_ratio(tuning.kind, shape.hidden)
    return head + (per_token - head) / speedup


def step_time(
    shape,
    platform,
    *,
    stage: int,
    offload: bool,
    micro_batch: int,
    seq_len: int,
    accumulation: int,
    gradient_checkpointing: bool,
    trainable: float,
    precision: str = "bf16",
    tuning: flops.Tuning = flops.FULL,
    fp8: bool = False,
    reference: str = "none",
) -> StepTime:
    """The estimate for one candidate plan (see the module docstring). `reference` (preference
    stages): "forward" = a reference forward pass over every token on the policy's weights (LoRA with
    its adapter disabled), "copy" = the same on a frozen copy, which ZeRO-3 also gathers; "cached" =
    none (read from the reference step)."""
    world = platform.world_size
    tokens = micro_batch * seq_len
    # flops.py's model FLOPs, the rows of a pack spanning half of it on average; checkpointing
    # recomputes the forward pass
    count = flops.per_token(shape, seq_len / 2, tuning)
    per_token = count.total + (count.forward if gradient_checkpointing else 0.0)
    if reference not in ("none", "cached"):  # cached: read from the reference step, no forward
        per_token += flops.per_token(shape, seq_len / 2).forward  # no adapter: the frozen model's forward
    spec = platform.spec
    peak = (spec.peak_bf16_tflops if spec else CPU_TFLOPS) * 1e12 if platform.on_gpu else CPU_TFLOPS * 1e12
    if fp8:
        per_token = fp8_flops_equivalent(shape, per_token, tuning)
    micro_s = tokens * per_token / (peak * efficiency(tokens))
    compute = accumulation * micro_s

    # ZeRO exchanges weights and gradients in the compute precision; DDP all-reduces fp32 gradients.
    unit = 4.0 if precision == "fp32" else 2.0
    weights, grads = unit * shape.params, unit * trainable
    comm = 0.0
    bw = bus_bandwidth_gbs(platform) * 1e9
    if world > 1 and bw:
        share = (world - 1) / world
        if stage == 3:
            # the reference copy is gathered once more for its forward pass
            gathers = 3 if reference == "copy" else 2
            comm = accumulation * (gathers * weights + grads) * share / bw
        elif stage in (1, 2):
            comm = (accumulation * grads + weights) * share / bw
        else:
            comm = 2 * 4.0 * trainable * share / bw  # one all-reduce per step (no_sync between)
        comm *= 1 - COMM_HIDDEN
    offloaded = 0.0
    if offload:
        shard = shape.params / world
        pcie = accumulation * (2 * unit * shard + unit * trainable / world) / (PCIE_GBS * 1e9)
        adam = (trainable / platform.nodes) / cpu_adam_params_per_s(platform)
        offloaded = pcie + adam
    return StepTime(compute, comm, offloaded, tokens * accumulation * world, world)


# Host bytes ZeRO-3 CPU offload needs per trainable parameter and per parameter. Counted: fp32 master
# weights, two AdamW moments and fp32 gradients (16 B) plus the 16-bit weight shards (2 B); DeepSpeed's
# pinned staging buffers and the 16-bit copy transformers loads the model into come on top: an
# offload run that the 18 B count allowed was killed for host memory in its first step
# (bench/results/steptime_check_h200x1.md); 24 + 4 B refuses it.
OFFLOAD_HOST_BYTES_TRAINABLE = 24.0
OFFLOAD_HOST_BYTES_PARAM = 4.0


def offload_host_gib(params: float, trainable: float, nodes: int) -> float:
    """Host memory per node that ZeRO-3 CPU offload holds (see the constants above)."""
    need = OFFLOAD_HOST_BYTES_TRAINABLE * trainable + OFFLOAD_HOST_BYTES_PARAM * params
    return need / max(1, nodes) / 2**30
