"""FP8 training applied by llmft itself: torchao float8 on the decoder's linear layers.

LLaMA-Factory's own `fp8: true` goes through Accelerate, which on our stack falls back to bf16 without
an error ("Accelerate FP8 status - enabled: False"; LLaMA-Factory issue 9500): llmft refuses that flag
in sft.extra and converts the model itself, in its training entry (llmft.sft.train), right after
LLaMA-Factory loads it (adapters attached) and before DeepSpeed / DDP wrap it and torch.compile traces
its layers. Embeddings, the output head and LoRA's adapters stay in bf16.

`sft.fp8` decides where it runs: `true` (refused on a node that cannot), `false`, or `auto`: on only
where every node's GPU has FP8 matmuls (below) and the numerics canary's FP8 leg passed on every node
(llmft.env.canary). What ran is counted on the model that trains and written to FP8_FILE; the run
page and summary.json read that, never the setting.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from llmft.core.config import ConfigError
from llmft.core.settings import Sft

if TYPE_CHECKING:
    from llmft.core.settings import Sft

# Scaling recipes, measured on one H200 (four Llama-3-8B-shaped decoder layers, batch 4 x
# 2048, forward + backward under torch.compile): a decoder layer's bf16 step time over its float8 step
# time, with trainable weights (full fine-tuning) and frozen ones (LoRA's base weights). Accuracy
# against bf16 is checked by the canary's FP8 leg on every node and by bench/sft_fp8_bench.py (>= 300
# steps at 1.24 B: final and held-out loss within 1 %). llmft's own probe of trained layers
# (bench/results/fp8_trainable_probe_h200x1_20261204.json) ranks them the same: tensorwise 1.38x /
# rowwise 1.13x at 8 B shapes, 1.20x / 0.96x at 1.24 B shapes.
MEASURED_SPEEDUP = {
    "tensorwise": {"trainable": 1.43, "frozen": 1.39},
    "rowwise": {"trainable": 1.14, "frozen": 1.24},
}


def choose_recipe(measured: dict) -> str:
    """The recipe whose slower case (trainable or frozen weights) is fastest: one recipe serves full
    fine-tuning and LoRA, so neither may pay for the other."""
    return max(measured, key=lambda name: min(measured[name].values()))


RECIPE = choose_recipe(MEASURED_SPEEDUP)
RECIPE_WHY = (
    f"{RECIPE} scaling, the fastest measured speed-up of a decoder layer over bf16 on an H200: "
    + ", ".join(
        f"{n} {v['trainable']}x trainable / {v['frozen']}x frozen" for n, v in MEASURED_SPEEDUP.items()
    )
)
# The whole training step, measured: llmft's FP8 run's tokens/s over bf16's on one H200, by kind
# (full and freeze train their float8 layers' weights, LoRA's are frozen) and by the model's hidden
# size, since float8 saves a share of each GEMM that grows with its size while the casts and scales
# around it do not:
# - full, hidden 2048 (the 1.24 B Llama of bench/): bench/results/sft_fp8_h200x1_cdt1b.json, FP8 as
#   an FP8 full plan runs it (compiled decoder layers, every micro-batch one shape, Inductor's kernel
#   tuning: llmft.sft.plan._static_shapes, _compile_tuning) over llmft's own bf16 plan (eager), the
#   bf16 run from the call before on the same held machine (sft_fp8_h200x1_static1b.json; the second
#   call's deadline skipped its own). Against bf16 compiled to one shape (same first call): 1.12x.
#   Eager, full FP8 ran at 0.49x (sft_fp8_h200x1_full1b.json); compiled with the rows' own lengths
#   (dynamic-shape graphs), 0.98x (sft_fp8_h200x1_full1b_compile.json). Not measured below hidden
#   2048, where float8's GEMMs save less: there `auto` leaves full fine-tuning in bf16.
# - LoRA, hidden 2048: bench/results/sft_fp8_h200x1_zero1b.json, llmft's LoRA plan (no DeepSpeed,
#   compiled decoder layers) with FP8 (frozen weights cast once) over the same plan in bf16, in one
#   call. (Under ZeRO-2 with torchao's per-step weight casts it was 0.91x the hand-tuned bf16 LoRA:
#   sft_fp8_h200x1_lora1b.json.)
# - LoRA, hidden 4096 (the 8 B Llama): bench/results/sft_fp8_h200x1_auto8b.json, llmft's plan with
#   every key auto (FP8 on by itself, no DeepSpeed, frozen weights cast once) over the same plan with
#   sft.fp8: false, in one call. (Under ZeRO-2 with torchao's weight casts it was 1.15x:
#   sft_fp8_h200x1_levers8b.json.)
# `auto` turns FP8 on only where a run was measured faster; the planner uses these ratios. A model
# uses the measurement at the largest measured hidden size not above its own (below the smallest,
# the smallest): a larger model's GEMMs gain at least as much.
PIPELINE_RATIO = {"full": {2048: 1.2001}, "frozen": {2048: 1.0598, 4096: 1.2049}}
MEASURED_ON = "one H200"
# float8 GEMMs need both matrix dimensions divisible by 16 (torch._scaled_mm).
DIM_MULTIPLE = 16
# Test only: convert nothing, silently, as an FP8 setting that has no effect would (the canary and
# the training entry must notice).
SKIP_ENV = "LLMFT_TEST_FP8_SILENT_SKIP"
FP8_FILE = "llmft_fp8.json"
SETTING_KEY = "sft.fp8"
OFF_REASON = f"{SETTING_KEY}: false"  # decide's reason when the config turns FP8 off

# FP8 matmul hardware, by arch. NVIDIA: compute capability 8.9 (Ada) and newer (Hopper sm_90,
# Blackwell sm_100 / sm_120). AMD, hand-written from AMD's ROCm documentation ("Data types and
# precision support"; never run here): gfx942 (MI300X / MI325X) has the FNUZ FP8 formats, which
# torchao picks on MI300; gfx950 (MI350X / MI355X) the OCP formats. Older Instinct (gfx90a) has none.
ROCM_FP8_ARCHS = {"gfx942": "MI300X/MI325X, FP8 E4M3/E5M2 FNUZ", "gfx950": "MI350X/MI355X, OCP FP8"}
CUDA_MIN_SM = 89


def arch_has_fp8(vendor: str, arch: str) -> tuple[bool, str]:
    """(FP8 matmuls on this GPU arch, why) from the node's facts."""
    if vendor == "cpu" or not vendor:
        return False, "CPU processes have no FP8 matmul units"
    if vendor == "rocm":
        base = arch.split(":")[0]
        if base in ROCM_FP8_ARCHS:
            return True, f"{base} ({ROCM_FP8_ARCHS[base]})"
        return False, f"{base or 'an unknown arch'} has no FP8 matmuls (gfx942 and gfx950 do)"
    m = re.fullmatch(r"sm_(\d+)[a-z]?", arch or "")
    if not m:
        return False, f"the GPU arch is not known ({arch or 'not measured'})"
    sm = int(m.group(1))
    if sm >= CUDA_MIN_SM:
        return True, f"sm_{sm} (FP8 tensor cores from sm_89)"
    return False, f"sm_{sm} has no FP8 tensor cores (sm_89 and newer do)"


def decide(sft: Sft, platform, hidden: int | None = None) -> tuple[bool, str]:
    """(FP8 on, why) for sft.fp8 on this platform and a model of this hidden size (pipeline_ratio);
    ConfigError for `true` where it cannot run."""
    setting = sft.fp8
    if setting is False:
        return False, OFF_REASON
    capable, why = arch_has_fp8(platform.vendor, platform.arch)
    blocker = sft.fp8_blocker or (None if capable else why)
    if setting is True:
        if blocker:
            raise ConfigError(
                f"config key {SETTING_KEY}: true but {blocker}; set {SETTING_KEY}: auto or false"
            )
        return True, f"{SETTING_KEY}: true on {why}; {RECIPE_WHY}"
    if blocker:
        return False, f"{SETTING_KEY}: auto -> off: {blocker}"
    ratio, measured_at = pipeline_ratio(sft.finetuning_type, hidden)
    kind = "LoRA" if _frozen(sft.finetuning_type) else sft.finetuning_type
    if not _frozen(sft.finetuning_type) and hidden is not None and hidden < measured_at:
        return False, (
            f"{SETTING_KEY}: auto -> off: {why} has FP8, but {kind} fine-tuning was measured faster in "
            f"FP8 at hidden {measured_at} and up only (this model: {hidden}; float8 saves less on smaller "
            f"GEMMs); {SETTING_KEY}: true turns it on"
        )
    measured = (
        f"llmft's float8 path measured {ratio:.2f}x bf16 end to end ({kind}, hidden {measured_at}, "
        f"{MEASURED_ON})"
    )
    if ratio <= 1.0:
        turn_on = f"{SETTING_KEY}: true turns it on"
        return False, f"{SETTING_KEY}: auto -> off: {why} has FP8, but {measured}; {turn_on}"
    if not platform.fp8_canary:
        if not platform.hosts:  # declared by the config: no node measured, no canary run
            return False, (
                f"{SETTING_KEY}: auto -> off: {why} has FP8, but no node is measured yet (verify_env runs "
                "the canary's FP8 leg on each)"
            )
        return False, (
            f"{SETTING_KEY}: auto -> off: {why} has FP8, but the numerics canary's FP8 leg did not pass on "
            "every node (verify_env's canary finding says why)"
        )
    return True, (
        f"{SETTING_KEY}: auto -> on: {why}, {measured}, the canary's FP8 leg passed on every node; "
        + RECIPE_WHY
    )


def _frozen(finetuning_type: str) -> bool:
    return finetuning_type in ("lora", "qlora")


def pipeline_ratio(finetuning_type: str, hidden: int | None = None) -> tuple[float, int]:
    """(FP8 over bf16 tokens/s of a whole training step as measured (PIPELINE_RATIO) for this kind of
    fine-tuning, the hidden size it was measured at): the largest measured hidden size not above
    `hidden` (None or below every measurement: the smallest)."""
    by_size = PIPELINE_RATIO["frozen" if _frozen(finetuning_type) else "full"]
    sizes = sorted(by_size)
    size = max([h for h in sizes if hidden is not None and h <= hidden], default=sizes[0])
    return by_size[size], size


def canary_wants_fp8(sft: Sft, vendor: str, arch: str) -> bool:
    """Whether the canary runs its FP8 leg on this node: FP8 asked for, or auto on an FP8 arch."""
    if sft.fp8 is True:
        return True
    return sft.fp8 == "auto" and arch_has_fp8(vendor, arch)[0] and sft.fp8_blocker is None


def _eligible(module, fqn: str) -> bool:
    """A decoder linear layer float8 can run: not the head or an embedding, not a LoRA adapter,
    both dimensions multiples of DIM_MULTIPLE."""
    import torch

    if not isinstance(module, torch.nn.Linear) or type(module).__name__ in FLOAT8_CLASSES:
        return False
    parts = fqn.split(".")
    if parts[-1] in ("lm_head", "score", "embed_tokens") or any(p.startswith("lora_") for p in parts):
        return False
    return module.in_features % DIM_MULTIPLE == 0 and module.out_features % DIM_MULTIPLE == 0


def convert(model, recipe: str = RECIPE, frozen_cast_once: bool = False) -> dict:
    """Swap the decoder's eligible nn.Linear layers (PEFT's base_layer for LoRA) for float8 ones in
    place; the count of what is float8 afterwards, counted on the model. `frozen_cast_once` (weights
    whole on each GPU: below ZeRO-3): a frozen layer becomes a FrozenFloat8Linear (cast_frozen casts
    its weight once, on the GPU, before the first step), every other one torchao's Float8Linear."""
    if os.environ.get(SKIP_ENV) != "1":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        if frozen_cast_once:
            _swap_frozen(model)
        config = Float8LinearConfig.from_recipe_name(recipe)
        convert_to_float8_training(model, module_filter_fn=_eligible, config=config)
    return count(model, recipe)


FLOAT8_CLASSES = ("Float8Linear", "FrozenFloat8Linear")


def count(model, recipe: str = RECIPE) -> dict:
    """Which linear layers of `model` are float8 now (by class, not by setting)."""
    import torch

    fp8, other, once = [], [], 0
    for name, module in model.named_modules():
        if type(module).__name__ in FLOAT8_CLASSES:
            fp8.append(name)
            once += type(module).__name__ == "FrozenFloat8Linear"
        elif isinstance(module, torch.nn.Linear):
            other.append(name)
    total = len(fp8) + len(other)
    how = f"{recipe}; {once} frozen weights cast once" if once else recipe
    return {
        "recipe": recipe,
        "float8_layers": len(fp8),
        "frozen_cast_once": once,
        "linear_layers": total,
        "float8_names": fp8,
        "bf16_names": other,
        "summary": f"{len(fp8)} of {total} linear layers in float8 ({how})",
    }


# Frozen weights cast to float8 once (LoRA's base weights, freeze tuning's frozen layers). torchao's
# Float8Linear casts every weight again in each forward and backward (amax, scale, cast), although a
# frozen weight never changes. A FrozenFloat8Linear holds its weight in e4m3 with one scale per tensor
# (the tensorwise recipe's weight cast), in both layouts torch._scaled_mm takes: W for the forward,
# W^T for the input gradient (a frozen weight gets no gradient). Per step only the input (e4m3) and the
# output gradient (e5m2) are cast, with torchao's own scaling: the numerics of Float8Linear's
# tensorwise recipe, without its weight casts. The two float8 copies take the bytes of the 16-bit
# weight they replace, which is freed. Only where weights are whole on each GPU (ZeRO-3 gathers its
# shards anew each step, so they stay torchao's). Measured on one H200: bench/results/
# fp8_frozen_probe_h200x1_20261203.json (a decoder-layer stack, 1.32x bf16 against torchao's 1.27x
# at hidden 4096) and the pipeline figures of PIPELINE_RATIO.


def cast_once(zero_stage: int) -> bool:
    """Whether frozen weights are cast to float8 once (FrozenFloat8Linear): where they are whole on
    each GPU, below ZeRO-3."""
    return zero_stage < 3


def _float8_dtypes():
    """(e4m3, e5m2) as torchao picks them for this GPU (MI300's gfx942: the FNUZ variants)."""
    from torchao.float8.config import e4m3_dtype, e5m2_dtype

    return e4m3_dtype, e5m2_dtype


def _to_float8(t, dtype):
    """(t in float8 `dtype`, the inverse scale torch._scaled_mm takes): one scale for the tensor, its
    absolute maximum onto the format's largest value (torchao's tensorwise scaling)."""
    import torch

    fmax = torch.finfo(dtype).max
    scale = (fmax / t.abs().amax().to(torch.float64).clamp(min=1e-12)).to(torch.float32)
    bits = (t.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype)
    return bits, scale.reciprocal()


@functools.cache
def _frozen_matmul_class():
    import torch

    class FrozenFloat8Matmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w8, w8t, w_inv):
            e4m3, _ = _float8_dtypes()
            x2 = x.reshape(-1, x.shape[-1])
            x8, x_inv = _to_float8(x2, e4m3)
            # the output GEMM with fast accumulation, the input-gradient one without: torchao's
            # tensorwise recipe (Float8LinearConfig's gemm_config_output / gemm_config_grad_input)
            y = torch._scaled_mm(
                x8, w8.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype, use_fast_accum=True
            )
            ctx.save_for_backward(w8t, w_inv)
            return y.reshape(*x.shape[:-1], y.shape[-1])

        @staticmethod
        def backward(ctx, grad):
            w8t, w_inv = ctx.saved_tensors
            _, e5m2 = _float8_dtypes()
            g2 = grad.reshape(-1, grad.shape[-1])
            g8, g_inv = _to_float8(g2, e5m2)
            gx = torch._scaled_mm(g8, w8t.t(), scale_a=g_inv, scale_b=w_inv, out_dtype=grad.dtype)
            return gx.reshape(*grad.shape[:-1], gx.shape[-1]), None, None, None

    return FrozenFloat8Matmul


@functools.cache
def _frozen_linear_class():
    import torch

    matmul = _frozen_matmul_class()

    class FrozenFloat8Linear(torch.nn.Linear):
        """A frozen nn.Linear whose weight cast_frozen holds in float8 (module comment above); until
        then a plain linear layer."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.float8_cast = False

        def cast_weight(self) -> None:
            # Plain tensor attributes, not buffers: DDP broadcasts every buffer from rank 0 before each
            # forward (broadcast_buffers), and these never change; torch.compile takes them as graph
            # inputs all the same (one graph for every layer).
            e4m3, _ = _float8_dtypes()
            w8, w_inv = _to_float8(self.weight.detach(), e4m3)
            self.weight_float8 = w8.contiguous()
            self.weight_float8_t = w8.t().contiguous()
            self.weight_inverse_scale = w_inv
            del self.weight  # the 16-bit copy: nothing reads it once the float8 ones exist
            self.float8_cast = True

        def forward(self, x):
            if not self.float8_cast:
                return super().forward(x)
            y = matmul.apply(x, self.weight_float8, self.weight_float8_t, self.weight_inverse_scale)
            return y if self.bias is None else y + self.bias

    return FrozenFloat8Linear


def frozen_linear(linear):
    """A FrozenFloat8Linear sharing `linear`'s weight and bias (still 16 bit until its cast_weight)."""
    import torch

    with torch.device("meta"):
        new = _frozen_linear_class()(linear.in_features, linear.out_features, bias=linear.bias is not None)
    new.weight = linear.weight
    new.bias = linear.bias
    return new


def _swap_frozen(model) -> int:
    """Replace each eligible frozen nn.Linear of `model` by its frozen_linear (cast_frozen casts them
    on the GPU); how many."""
    import torch

    swapped = 0
    for fqn, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            name = f"{fqn}.{child_name}" if fqn else child_name
            if type(child) is not torch.nn.Linear or child.weight.requires_grad or not _eligible(child, name):
                continue
            setattr(module, child_name, frozen_linear(child))
            swapped += 1
    return swapped


# The canary's check of the cast-once path (llmft.env.canary.fp8_leg): a frozen layer cast once and
# the same layer as torchao's Float8Linear compute the same tensorwise numerics with the same GEMM
# settings, so their outputs and input gradients agree to the bit on a CPU; beyond this relative
# difference the node's float8 path for frozen weights is not what was measured.
FROZEN_CHECK_TOLERANCE = 1e-3


def frozen_check(device: str = "cpu") -> dict:
    """One frozen bf16 linear layer (256 -> 512) cast once against torchao's Float8Linear on `device`:
    the largest relative difference of the output and the input gradient, and whether it is within
    FROZEN_CHECK_TOLERANCE."""
    import copy

    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    gen = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(256, 512, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        base.weight.copy_(torch.randn(512, 256, generator=gen) * 0.05)
    base = base.to(device).requires_grad_(False)
    theirs = torch.nn.Sequential(copy.deepcopy(base))
    convert_to_float8_training(theirs, config=Float8LinearConfig.from_recipe_name(RECIPE))
    ours = frozen_linear(copy.deepcopy(base))
    ours.cast_weight()
    x = torch.randn(64, 256, generator=gen).to(device, torch.bfloat16)
    results = []
    for layer in (theirs, ours):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.float().pow(2).sum().backward()
        results.append((y.detach().float(), xi.grad.float()))
    diff = max(
        float((a - b).norm() / b.norm().clamp(min=1e-12)) for a, b in zip(results[1], results[0], strict=True)
    )
    return {"ok": diff <= FROZEN_CHECK_TOLERANCE, "relative_difference": diff}


def cast_frozen(model) -> int:
    """Cast each FrozenFloat8Linear's weight to float8 where it now lives (after the trainer moved
    the model to its GPU and DeepSpeed / DDP wrapped it, before the first step); how many."""
    import torch

    done = 0
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "FrozenFloat8Linear" and not module.float8_cast:
                module.cast_weight()
                done += 1
    return done


def write_report(out_dir: str | Path, report: dict) -> None:
    from llmft.core.io import write_json

    write_json(Path(out_dir) / FP8_FILE, report)


def read_report(out_dir: str | Path) -> dict | None:
    path = Path(out_dir) / FP8_FILE
    return json.loads(path.read_text()) if path.exists() else None


# Package combinations known to break (read from the packages' sources): peft's LoRA
# dispatch (peft/tuners/lora/torchao.py) imports torchao.quantization.LinearActivationQuantizedTensor
# whenever torchao is installed, which torchao 0.18.0 removed: every LoRA run fails at model load.
# Against torch, torchao's own import check (torchao/__init__.py) skips its compiled kernels outside
# the torch releases each torchao was built for: 0.16.0 for torch 2.10, 0.17.0 for torch >= 2.11.
TORCHAO_FIRST_WITHOUT_PEFT_API = (0, 18)
TORCHAO_FOR_PEFT = "0.17.0"
# torchao (major, minor) -> (oldest torch, newest torch or None) its compiled kernels load on
TORCHAO_TORCH = {(0, 16): ((2, 10), (2, 10)), (0, 17): ((2, 11), None), (0, 18): ((2, 11), None)}
TORCHAO_FOR_TORCH = {(2, 10): "0.16.0"}


def _vt(version: str, n: int = 2) -> tuple[int, ...]:
    nums = [int(x) for x in re.findall(r"\d+", version.split("+")[0])[:n]]
    return tuple(nums) + (0,) * (n - len(nums))


def _torchao_for(torch: str) -> str:
    return TORCHAO_FOR_TORCH.get(_vt(torch), TORCHAO_FOR_PEFT)


def package_conflicts(versions: dict) -> list[tuple[str, str]]:
    """(what breaks, the fix) for torchao against peft and torch, from installed versions
    ({"torchao": "0.18.0", "peft": "0.18.1", "torch": "2.11.0"}; no torchao breaks nothing)."""
    ao, peft, torch = versions.get("torchao"), versions.get("peft"), versions.get("torch")
    out = []
    if not ao:
        return out
    if peft and _vt(ao) >= TORCHAO_FIRST_WITHOUT_PEFT_API:
        out.append(
            (
                f"torchao {ao} with peft {peft}: peft's LoRA imports LinearActivationQuantizedTensor from "
                f"torchao.quantization, which torchao {ao} no longer has (every LoRA run fails at model "
                "load, FP8 or not)",
                f"pip install torchao=={_torchao_for(torch or '')} (the version envs/ pin for this torch)",
            )
        )
    span = TORCHAO_TORCH.get(_vt(ao))
    if torch and span and (_vt(torch) < span[0] or (span[1] and _vt(torch) > span[1])):
        built = ".".join(map(str, span[0])) + (" only" if span[1] else " and newer")
        out.append(
            (
                f"torchao {ao} with torch {torch}: torchao {ao} is built for torch {built} and skips its "
                "compiled kernels on this torch",
                f"pip install torchao=={_torchao_for(torch)} (the version envs/ pin for torch "
                f"{'.'.join(map(str, _vt(torch)))})",
            )
        )
    return out
