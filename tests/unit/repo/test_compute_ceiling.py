"""bench/compute_ceiling.py: its matrix-product bound covers every weight, kernels are sorted by kind,
and the committed results hold together (the bound above the ceiling above the measured run)."""

import json

import pytest
from llmft.core.shape import shape_from_config

from bench import compute_ceiling as cc
from bench.sft_models import llama_config
from tests.conftest import REPO


@pytest.mark.parametrize("size", ["1b", "8b"])
def test_layer_linears_are_every_weight_of_a_layer(size):
    shape = shape_from_config(llama_config(size))
    linears = cc.layer_linears(shape)
    per_layer = sum(i * o for name, (i, o) in linears.items() if "fused" not in name) + 2 * shape.hidden
    embed_head = shape.vocab * shape.hidden * (1 if shape.tied else 2)
    assert shape.layers * per_layer + embed_head + shape.hidden == shape.params
    # the fused shapes are the same products, only wider
    assert linears["qkv_fused"][1] == sum(linears[n][1] for n in ("q", "k", "v"))
    assert linears["gate_up_fused"][1] == linears["gate"][1] + linears["up"][1]


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "gemm"),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel", "attention"),
        ("cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<", "attention"),
        ("cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8", "gemm"),
        ("_rms_norm_backward_kernel", "norm"),
        ("_swiglu_forward_kernel", "swiglu"),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<", "elementwise"),
        ("ncclDevKernel_AllGather_RING_LL", "other"),
    ],
)
def test_kernel_kind(name, kind):
    assert cc.kernel_kind(name) == kind


@pytest.mark.parametrize(
    ("name", "size"),
    [
        ("compute_ceiling_h200x1_8b_20261201T0322.json", "8b"),
        ("compute_ceiling_h200x1_8b_20261201T0322_repeat.json", "8b"),
        ("compute_ceiling_h200x1_1b_20261201T0328.json", "1b"),
    ],
)
def test_committed_roofline_holds_together(name, size):
    d = json.loads((REPO / "bench/results" / name).read_text())
    layers = shape_from_config(llama_config(size)).layers
    gemm_step = layers * d["gemm_per_layer_seconds"] + d["gemm_ms"]["head"] / 1e3
    assert d["gemm_only_step_seconds"] == pytest.approx(gemm_step, abs=2e-3)
    linears = ("q", "k", "v", "o", "gate", "up", "down")
    assert d["gemm_per_layer_seconds"] == pytest.approx(sum(d["gemm_ms"][n] for n in linears) / 1e3, abs=1e-4)
    # products alone < a whole layer; the bound above the kernels' ceiling above the measured run
    assert d["gemm_per_layer_seconds"] < d["per_layer_seconds"]
    assert d["gemm_only_mfu"] > d["mfu_fwd_bwd_only"] > d["mfu_ceiling_step"] > d["measured_median_step_mfu"]
    if size == "8b":
        assert d["mfu_ceiling_step"] < 0.6, (
            "the 8 B 30x goal (59.6 % MFU) vs the ceiling, as bench/README says"
        )
