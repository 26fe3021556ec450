"""The bench's hand-tuned LoRA runs are the plain tool's: LLaMA-Factory's own Liger kernels, no llmft
compiled layers and no llmft fused loss; llmft's runs keep both."""

import pytest

from bench import sft_bench as sb

HAND = ["fp8_lora_hand_8b", "fp8_lora_hand_1b", "fp8_lora_lf_8b", "fp8_lora_lf_1b", "lora_hand_8b"]


@pytest.mark.parametrize("name", HAND)
def test_hand_tuned_lora_runs_only_the_plain_tools_code(name):
    sft = sb.config_for(name, 10)["sft"]
    assert sft["torch_compile"] is False and sft["liger_kernel"] is True and sft["fp8"] is False
    assert sb.variant_env(name)["LLMFT_LIGER_CROSS_ENTROPY"] == "1"


@pytest.mark.parametrize("name", ["fp8_lora_auto_8b", "fp8_lora_auto_1b", "lora_eager_8b"])
def test_llmfts_runs_keep_llmfts_fused_loss(name):
    assert "LLMFT_LIGER_CROSS_ENTROPY" not in sb.variant_env(name)
    assert "torch_compile" not in sb.config_for(name, 10)["sft"] or name == "lora_eager_8b"


def test_the_liger_loss_variants_differ_from_auto_only_in_the_loss():
    for size in ("8b", "1b"):
        auto, liger = sb.VARIANTS[f"fp8_lora_auto_{size}"], sb.VARIANTS[f"fp8_lora_ligerce_{size}"]
        assert auto == liger
        assert sb.variant_env(f"fp8_lora_ligerce_{size}") == {"LLMFT_LIGER_CROSS_ENTROPY": "1"}


def test_the_full_fused_loss_variant_differs_from_the_bf16_plan_only_in_the_loss():
    assert sb.VARIANTS["fp8_full_fusedce_1b"] == sb.VARIANTS["fp8_full_bf16_1b"]
    assert sb.variant_env("fp8_full_fusedce_1b") == {"LLMFT_LIGER_CROSS_ENTROPY": "0"}
    assert "LLMFT_LIGER_CROSS_ENTROPY" not in sb.variant_env("fp8_full_bf16_1b")


def test_every_baseline_pins_off_what_llamafactory_cannot_do():
    """The by-hand recipes and hand-tuned runs, full and LoRA: no llmft compile, no llmft FP8, whatever
    `auto` would choose for llmft's own runs."""
    baselines = [n for n in sb.VARIANTS if any(tag in n for tag in ("hand", "recipe", "_lf_"))]
    assert len(baselines) >= 12
    for name in baselines:
        sft = sb.config_for(name, 10)["sft"]
        assert sft["torch_compile"] is False and sft["fp8"] is False, name
