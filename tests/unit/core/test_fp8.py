"""FP8 training applied by llmft (llmft.core.fp8): the scaling recipe, where `auto` turns it on (from
node facts: the H200's captured by verify_env on the device, the MI300X's and the other ROCm archs'
hand-written from AMD's documentation, never captured on a node), the package refusals, the plan text,
the conversion counted on real tiny models (full and LoRA), and the canary's refusal when FP8 silently
did not apply."""

import copy
import dataclasses
import json

import pytest
from llmft.core import fp8
from llmft.core.config import ConfigError, validate
from llmft.core.platform import Platform
from llmft.core.settings import Config, Sft
from llmft.env.rules import judge_canary, judge_torchao
from llmft.sft.plan import describe, resolve

from tests.conftest import REPO

MI300X = json.loads((REPO / "tests/fixtures/facts_mi300x.json").read_text())
H200 = json.loads((REPO / "bench/results/pipeline_h200x1_20261201.verify.json").read_text())["nodes"][0]


def test_the_recipe_is_the_measured_fastest_for_both_trainable_and_frozen_weights():
    assert fp8.choose_recipe(fp8.MEASURED_SPEEDUP) == fp8.RECIPE == "tensorwise"
    assert fp8.MEASURED_SPEEDUP[fp8.RECIPE] == {"trainable": 1.43, "frozen": 1.39}
    # a recipe fast for one case and slow for the other loses to one fast for both
    assert (
        fp8.choose_recipe({"a": {"trainable": 2.0, "frozen": 1.1}, "b": {"trainable": 1.3, "frozen": 1.3}})
        == "b"
    )


@pytest.mark.parametrize(
    "vendor, arch, has",
    [
        ("cuda", "sm_90", True),  # H200 / H100
        ("cuda", "sm_89", True),  # Ada
        ("cuda", "sm_100", True),
        ("cuda", "sm_80", False),  # A100: no FP8 tensor cores
        ("rocm", "gfx942", True),  # MI300X (hand-written from AMD's docs)
        ("rocm", "gfx942:sramecc+:xnack-", True),
        ("rocm", "gfx950", True),  # MI355X (hand-written)
        ("rocm", "gfx90a", False),  # MI250X (hand-written)
        ("cpu", "", False),
    ],
)
def test_fp8_hardware_by_arch(vendor, arch, has):
    assert fp8.arch_has_fp8(vendor, arch)[0] is has


def _facts(base: dict, n: int, fp8_ok) -> list[dict]:
    nodes = []
    for i in range(n):
        f = copy.deepcopy(base)
        f["host"] = f"n{i + 1}"
        f["canary"] = {
            "ok": True,
            "message": "",
            **({"fp8": {"ok": fp8_ok, "message": ""}} if fp8_ok is not None else {}),
        }
        nodes.append(f)
    return nodes


def _measured_ratio(result: str, ours: str, theirs: str) -> float:
    runs = json.loads((REPO / f"bench/results/{result}.json").read_text())["runs"]
    return runs[ours]["tokens_per_s_per_gpu"] / runs[theirs]["tokens_per_s_per_gpu"]


def test_the_whole_step_ratios_are_the_benchs_own_numbers():
    # tokens/s of the FP8 run over the bf16 run, in one device call each (full: see below)
    for kind, hidden, result, ours, theirs in (
        # the FP8 full plan (compiled, one shape, kernels tuned) over llmft's bf16 plan: the report of
        # the second of two calls on one held machine, the bf16 run from the first
        ("full", 2048, "sft_fp8_h200x1_cdt1b", "fp8_full_static_cdt_1b", "fp8_full_bf16_1b"),
        ("frozen", 2048, "sft_fp8_h200x1_zero1b", "fp8_lora_z0_1b", "lora_compile0_1b"),
        ("frozen", 4096, "sft_fp8_h200x1_auto8b", "fp8_lora_auto_8b", "fp8_lora_bf16_8b"),
    ):
        ratio = _measured_ratio(result, ours, theirs)
        assert fp8.PIPELINE_RATIO[kind][hidden] == pytest.approx(ratio, abs=0.001)
    # a model takes the measurement at the largest measured hidden size not above its own
    assert fp8.pipeline_ratio("lora", 4096) == (fp8.PIPELINE_RATIO["frozen"][4096], 4096)
    assert fp8.pipeline_ratio("qlora", 8192)[1] == 4096
    assert fp8.pipeline_ratio("lora", 3072)[1] == 2048
    assert fp8.pipeline_ratio("lora", 896)[1] == 2048
    assert fp8.pipeline_ratio("lora", None)[1] == 2048
    assert fp8.pipeline_ratio("freeze", 8192) == (fp8.PIPELINE_RATIO["full"][2048], 2048)


@pytest.mark.parametrize(
    "base, gpus, arch, kind, hidden",
    [
        (H200, 1, "sm_90", "full", 2048),
        (H200, 1, "sm_90", "full", 8192),
        (H200, 1, "sm_90", "freeze", 4096),
        (MI300X, 8, "gfx942", "full", 4096),
    ],
)
def test_auto_turns_full_fp8_on_from_the_measured_size_up_once_the_canary_passed(
    base, gpus, arch, kind, hidden
):
    hardware = {"gpus_per_node": gpus, "nodes": 2}
    cfg = validate({"hardware": hardware, "sft": {"precision": "bf16", "finetuning_type": kind}})
    on, reason = fp8.decide(
        Config.from_dict(cfg).sft, Platform.from_facts(Config.from_dict(cfg), _facts(base, 2, True)), hidden
    )
    assert on is True and f"auto -> on: {arch}" in reason
    assert f"llmft's float8 path measured 1.20x bf16 end to end ({kind}, hidden 2048, one H200)" in reason
    off, why = fp8.decide(
        Config.from_dict(cfg).sft, Platform.from_facts(Config.from_dict(cfg), _facts(base, 2, False)), hidden
    )
    assert off is False and "canary's FP8 leg did not pass on every node" in why


@pytest.mark.parametrize("kind, hidden", [("full", 64), ("full", 1024), ("freeze", 2047)])
def test_auto_leaves_full_training_of_smaller_models_in_bf16(kind, hidden):
    # measured at hidden 2048 only: a smaller model's GEMMs save less than the casts cost
    cfg = validate({"hardware": {"gpus_per_node": 1}, "sft": {"precision": "bf16", "finetuning_type": kind}})
    got, reason = fp8.decide(
        Config.from_dict(cfg).sft, Platform.from_facts(Config.from_dict(cfg), _facts(H200, 1, True)), hidden
    )
    assert got is False and "auto -> off" in reason and "sft.fp8: true turns it on" in reason
    assert f"at hidden 2048 and up only (this model: {hidden}" in reason
    # LoRA keeps the smallest measurement below it (its frozen weights cast once)
    lora = validate({"hardware": {"gpus_per_node": 1}, "sft": {"finetuning_type": "lora"}})
    assert (
        fp8.decide(
            Config.from_dict(lora).sft,
            Platform.from_facts(Config.from_dict(lora), _facts(H200, 1, True)),
            hidden,
        )[0]
        is True
    )


@pytest.mark.parametrize(
    "base, gpus, arch, hidden, measured",
    [
        (H200, 1, "sm_90", 2048, "1.06x bf16 end to end (LoRA, hidden 2048"),
        (H200, 1, "sm_90", 3072, "1.06x bf16 end to end (LoRA, hidden 2048"),
        (H200, 1, "sm_90", 4096, "1.20x bf16 end to end (LoRA, hidden 4096"),
        (H200, 1, "sm_90", 8192, "1.20x bf16 end to end (LoRA, hidden 4096"),
        (MI300X, 8, "gfx942", 8192, "1.20x bf16 end to end (LoRA, hidden 4096"),
    ],
)
def test_auto_turns_lora_fp8_on_at_the_sizes_it_was_measured_faster_once_the_canary_passed(
    base, gpus, arch, hidden, measured
):
    hardware = {"gpus_per_node": gpus, "nodes": 2}
    cfg = validate({"hardware": hardware, "sft": {"finetuning_type": "lora"}})
    assert cfg["sft"]["fp8"] == "auto" and cfg["sft"]["precision"] == "bf16"  # the defaults
    on, reason = fp8.decide(
        Config.from_dict(cfg).sft, Platform.from_facts(Config.from_dict(cfg), _facts(base, 2, True)), hidden
    )
    # on MI300X (hand-written facts: never run there) the speed is the H200's, and the reason says so;
    # the node's own canary FP8 leg is what must pass
    assert on is True and f"auto -> on: {arch}" in reason
    assert f"measured {measured}, one H200)" in reason
    assert "the canary's FP8 leg passed on every node" in reason
    # the same node without a passing FP8 leg, or a node never measured: off, saying which
    off, why = fp8.decide(
        Config.from_dict(cfg).sft, Platform.from_facts(Config.from_dict(cfg), _facts(base, 2, False)), hidden
    )
    assert off is False and "canary's FP8 leg did not pass on every node" in why
    off, why = fp8.decide(Config.from_dict(cfg).sft, Platform.declared(Config.from_dict(cfg)), hidden)
    assert off is False and "no node is measured yet" in why


def test_true_turns_fp8_on_where_the_gpu_has_it():
    cfg = validate({"hardware": {"gpus_per_node": 1, "nodes": 2}, "sft": {"precision": "bf16", "fp8": True}})
    got, reason = fp8.decide(
        Config.from_dict(cfg).sft, Platform.from_facts(Config.from_dict(cfg), _facts(H200, 2, True))
    )
    assert got is True and "sft.fp8: true on sm_90" in reason


def test_auto_is_off_on_an_arch_without_fp8_even_when_its_canary_leg_passed():
    mi250 = copy.deepcopy(MI300X)
    for d in mi250["devices"]:
        d["arch"] = "gfx90a:sramecc+:xnack-"
    cfg = validate({"hardware": {"gpus_per_node": 8}, "sft": {"precision": "bf16", "fp8": "auto"}})
    platform = Platform.from_facts(Config.from_dict(cfg), _facts(mi250, 1, True))
    on, reason = fp8.decide(Config.from_dict(cfg).sft, platform)
    assert not on and "gfx90a has no FP8 matmuls" in reason
    cfg["sft"]["fp8"] = True
    with pytest.raises(ConfigError, match=r"config key sft\.fp8: true but gfx90a has no FP8 matmuls"):
        fp8.decide(Config.from_dict(cfg).sft, platform)


@pytest.mark.reliability(
    fault="sft.fp8: true with fp32 precision, or LLaMA-Factory's fp8 flag in sft.extra",
    seen="config check, naming sft.fp8",
    steps_lost="none",
    data_lost="none",
)
def test_config_refuses_fp8_with_fp32_and_llamafactorys_inert_flag():
    with pytest.raises(ConfigError, match=r"sft\.fp8: true but sft\.precision is fp32"):
        validate({"sft": {"fp8": True, "precision": "fp32"}})
    with pytest.raises(
        ConfigError, match=r"sft\.extra\.fp8: LLaMA-Factory's FP8 flag falls back to bf16.*sft\.fp8"
    ):
        validate({"sft": {"extra": {"fp8": True, "fp8_backend": "torchao"}}})


def _h200_plan(**sft) -> Config:
    hardware = {"vendor": "cuda", "gpus_per_node": 1, "gpu_model": "h200"}
    return Config.from_dict(validate({"hardware": hardware, "data": {"cutoff_len": 2048}, "sft": sft}))


def _llama_folder(model, hidden: int, layers: int, intermediate: int, tied: bool):
    """A model folder holding only the config.json of a Llama-3 shape (the planner reads no weight)."""
    model.mkdir()
    shape = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=intermediate, vocab_size=128256, tie_word_embeddings=tied)  # fmt: skip
    (model / "config.json").write_text(json.dumps({"model_type": "llama", **shape}))
    return model


def test_plan_text_says_fp8_why_and_the_recipe_and_estimates_it_as_measured(tmp_path):
    """At 1.24 B (hidden 2048) on an H200 whose canary passed: `auto` turns FP8 on for full
    fine-tuning (measured 1.20x with compiled layers of one shape and tuned kernels) and for LoRA
    (1.06x, no DeepSpeed, frozen weights cast once); the step-time estimate follows the measured ratio."""
    model = _llama_folder(tmp_path / "1b", 2048, 16, 8192, tied=True)
    for kind in ("full", "lora"):
        cfg = _h200_plan(finetuning_type=kind)
        declared = Platform.declared(cfg)
        measured = dataclasses.replace(declared, fp8_canary=True)
        auto = resolve(cfg, str(model), measured)
        off = resolve(_h200_plan(finetuning_type=kind, fp8=False), str(model), measured)
        ratio = "1.20x bf16 end to end" if kind == "full" else "1.06x bf16 end to end"
        assert auto.fp8 and any("auto -> on" in r and ratio in r for r in auto.reasons)
        # full: compiled, every micro-batch one shape, kernels tuned, as it was measured; LoRA neither
        full = kind == "full"
        assert auto.compile and auto.compile_tuning is full
        assert auto.static_tokens == (auto.micro_batch * auto.seq_len if full else 0)
        on = resolve(_h200_plan(finetuning_type=kind, fp8=True), str(model), declared)
        text = describe(on)
        assert on.fp8 and "FP8 (tensorwise float8) on the decoder's linear layers" in text
        cast_once = "any frozen weights cast to float8 once" in text
        assert (on.zero_stage < 3) == cast_once == fp8.cast_once(on.zero_stage)
        assert "sft.fp8: true on sm_90" in text and "tensorwise 1.43x trainable / 1.39x frozen" in text
        # the planner uses the measured whole-step ratio: FP8 faster than bf16 for both
        assert on.step.tokens_per_s_per_gpu > off.step.tokens_per_s_per_gpu
        # same settings: LoRA holds FP8's casts on top (more memory); compiled full fine-tuning saves
        # its linear layers' inputs in float8 (less, as measured on one H200: plan.py)
        if (on.micro_batch, on.zero_stage) == (off.micro_batch, off.zero_stage):
            if kind == "lora":
                assert on.memory.activations > off.memory.activations
            else:
                assert on.memory.activations < off.memory.activations
        # torch_compile auto: an FP8 plan compiles its decoder layers (eager float8 ran at 0.49x bf16,
        # compiled 0.98x), a bf16 full plan does not; LoRA compiles either way
        assert on.compile and off.compile is (kind == "lora")
        assert "torch.compile per decoder layer" in text
    cpu = validate({"hardware": {"gpus_per_node": 0}})
    assert (
        "auto -> off: CPU processes have no FP8"
        in fp8.decide(Config.from_dict(cpu).sft, Platform.declared(Config.from_dict(cpu)))[1]
    )


def test_static_shapes_and_kernel_tuning_follow_the_plan(tmp_path):
    """sft.static_shapes pads every flattened micro-batch to micro-batch x cutoff_len tokens and
    sft.compile_tuning turns on Inductor's kernel tuning: `auto` turns both on for a compiled FP8 full
    plan (as measured), neither for a compiled bf16 full plan or LoRA (static shapes saying why for
    LoRA); `true` where the layers do not compile is refused naming the key."""
    model = _llama_folder(tmp_path / "1b", 2048, 16, 8192, tied=True)
    measured = dataclasses.replace(Platform.declared(_h200_plan()), fp8_canary=True)
    full = resolve(_h200_plan(finetuning_type="full"), str(model), measured)
    assert (full.packing, full.attention) == ("neat", "varlen")
    assert full.static_tokens == full.micro_batch * 2048 and full.compile_tuning
    text = describe(full)
    assert f"(kernels tuned), every micro-batch padded to {full.static_tokens} tokens" in text
    assert f"static_shapes auto -> on: every micro-batch padded to {full.static_tokens} tokens" in text
    assert "compile_tuning auto -> on" in text and "71 794 tokens/s against 66 036 untuned" in text
    lora = resolve(_h200_plan(finetuning_type="lora"), str(model), measured)
    assert lora.compile and not lora.static_tokens and not lora.compile_tuning
    assert "static_shapes auto -> off: measured for full fine-tuning only, not LoRA" in describe(lora)
    # a compiled bf16 full plan: auto leaves it unpadded (measured no faster), true pads it
    bf16 = resolve(_h200_plan(fp8=False, torch_compile=True), str(model), measured)
    assert bf16.compile and not bf16.static_tokens and not bf16.compile_tuning
    bf16 = resolve(_h200_plan(fp8=False, torch_compile=True, static_shapes=True), str(model), measured)
    assert bf16.static_tokens and not bf16.compile_tuning and not bf16.fp8
    assert "static_shapes true: every micro-batch padded" in describe(bf16)
    off = resolve(_h200_plan(static_shapes=False, compile_tuning=False), str(model), measured)
    assert off.fp8 and off.compile and not off.static_tokens and not off.compile_tuning
    for key in ("static_shapes", "compile_tuning"):
        with pytest.raises(ConfigError, match=f"config key sft.{key}: true needs compiled decoder layers"):
            resolve(_h200_plan(fp8=False, **{key: True}), str(model), measured)


def test_an_8b_lora_plan_turns_fp8_on_by_itself_and_estimates_it_faster(tmp_path):
    model = _llama_folder(tmp_path / "8b", 4096, 32, 14336, tied=False)
    cfg = _h200_plan(finetuning_type="lora")
    measured = dataclasses.replace(Platform.declared(cfg), fp8_canary=True)
    auto = resolve(cfg, str(model), measured)
    bf16 = resolve(_h200_plan(finetuning_type="lora", fp8=False), str(model), measured)
    assert auto.fp8 and not bf16.fp8
    assert any("auto -> on" in r and "1.20x bf16 end to end (LoRA, hidden 4096" in r for r in auto.reasons)
    assert "FP8 (tensorwise float8) on the decoder's linear layers" in describe(auto)
    assert auto.compile  # an FP8 plan compiles its decoder layers
    assert auto.step.tokens_per_s_per_gpu > bf16.step.tokens_per_s_per_gpu
    # full fine-tuning of the same model needs ZeRO-3 on one H200, whose layers do not compile, and
    # eager float8 on trained weights was measured slower: that plan stays bf16, saying why
    full = resolve(_h200_plan(finetuning_type="full"), str(model), measured)
    assert full.zero_stage == 3 and not full.fp8 and not full.compile
    assert not full.static_tokens and not full.compile_tuning
    assert full.reasons[-1].startswith(
        "sft.fp8: auto -> off: the plan's decoder layers do not compile (ZeRO-3"
    )
    assert not any(r == "sft.fp8: false" for r in full.reasons)


@pytest.mark.parametrize(
    "versions, says, fix",
    [
        ({"torchao": "0.18.0", "peft": "0.18.1", "torch": "2.11.0"},
         "torchao 0.18.0 with peft 0.18.1: peft's LoRA imports LinearActivationQuantizedTensor",
         "torchao==0.17.0"),
        ({"torchao": "0.17.0", "peft": "0.18.1", "torch": "2.10.0+rocm7.1"},
         "torchao 0.17.0 with torch 2.10.0+rocm7.1: torchao 0.17.0 is built for torch 2.11 and newer",
         "torchao==0.16.0"),
        ({"torchao": "0.16.0", "peft": "0.18.1", "torch": "2.11.0"},
         "torchao 0.16.0 with torch 2.11.0: torchao 0.16.0 is built for torch 2.10 only", "torchao==0.17.0"),
    ],
)  # fmt: skip
@pytest.mark.reliability(
    fault="torchao that breaks peft's LoRA or its torch",
    seen="verify_env's torchao rule (llmft.env.rules.judge_torchao, on the package versions a node's "
    "facts record) fails, naming both versions and the fix",
    steps_lost="none",
    data_lost="none",
)
def test_verify_env_refuses_torchao_that_breaks_peft_or_torch(versions, says, fix):
    found = judge_torchao({"packages": versions}, Sft(), "cuda")
    assert len(found) == 1 and not found[0].ok and says in found[0].message and fix in found[0].fix


@pytest.mark.parametrize(
    "versions",
    [{"torchao": "0.17.0", "peft": "0.18.1", "torch": "2.11.0"},
     {"torchao": "0.17.0", "peft": "0.18.1", "torch": "2.13.0"},
     {"torchao": "0.16.0", "peft": "0.18.1", "torch": "2.10.0+rocm7.1"},
     {"torchao": None, "peft": "0.18.1", "torch": "2.13.0"}],
)  # fmt: skip
def test_verify_env_accepts_the_pinned_combinations(versions):
    assert judge_torchao({"packages": versions}, Sft(), "cuda") == []


def test_verify_env_judges_the_installed_packages():
    """The versions nodefacts reads from this environment: torchao (when installed) must pass."""
    from llmft.env.nodefacts import _version

    versions = {p: _version(p) for p in ("torchao", "peft", "torch")}
    assert judge_torchao({"packages": versions}, Sft(), "cpu") == []
    # the installed torchao beside peft: a LoRA model builds (torchao 0.18 fails here, at peft's import)
    from peft import LoraConfig, get_peft_model

    get_peft_model(_tiny_llama(), LoraConfig(r=8, target_modules="all-linear"))
    want_fp8 = Config.from_dict(validate({"sft": {"fp8": True}})).sft
    missing = judge_torchao({"packages": {**versions, "torchao": None}}, want_fp8, "cpu")
    assert (
        missing
        and "sft.fp8: true converts the model with torchao float8, which is not installed"
        in missing[0].message
    )


def _tiny_llama(intermediate=176):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=intermediate, vocab_size=256, tie_word_embeddings=False)  # fmt: skip
    return LlamaForCausalLM(cfg)


def test_full_model_converts_every_decoder_linear_but_not_the_head():
    model = _tiny_llama()
    report = fp8.convert(model)
    assert report["summary"] == "14 of 15 linear layers in float8 (tensorwise)"
    assert report["bf16_names"] == ["lm_head"]
    assert type(model.model.embed_tokens).__name__ == "Embedding"
    # a dimension float8 GEMMs cannot take (100 is not a multiple of 16) stays bf16
    odd = fp8.convert(_tiny_llama(intermediate=100))
    assert odd["float8_layers"] == 8 and all(("mlp" not in n) for n in odd["float8_names"])


def test_lora_converts_the_frozen_base_layers_and_keeps_the_adapters_bf16():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny_llama(), LoraConfig(r=8, target_modules="all-linear"))
    report = fp8.convert(model)
    assert report["float8_layers"] == 14 and all(n.endswith(".base_layer") for n in report["float8_names"])
    assert sum(".lora_A." in n or ".lora_B." in n for n in report["bf16_names"]) == 28
    assert report["summary"] == "14 of 43 linear layers in float8 (tensorwise)"


def _lora_pair():
    """Two copies of one bf16 tiny Llama with the same nonzero rank-8 adapters on every linear layer."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _tiny_llama().to(torch.bfloat16),
        LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False),
    )
    return model, copy.deepcopy(model)


def _step(model, ids):
    """Logits and each trainable tensor's gradient of one forward + backward."""
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), [p.grad for p in model.parameters() if p.requires_grad]


def test_lora_frozen_weights_cast_once_compute_what_torchao_computes_to_the_bit():
    """Below ZeRO-3 (frozen_cast_once) LoRA's frozen base layers become FrozenFloat8Linear. Once
    cast_frozen has cast their weights (where the trainer put them), the 16-bit copies are gone and a
    forward + backward gives the logits and adapter gradients torchao's Float8Linear gives: the same
    tensorwise recipe without its per-step weight casts."""
    import torch

    ao, once = _lora_pair()
    fp8.convert(ao)
    report = fp8.convert(once, frozen_cast_once=True)
    assert report["summary"] == "14 of 43 linear layers in float8 (tensorwise; 14 frozen weights cast once)"
    assert report["frozen_cast_once"] == 14 and all(n.endswith(".base_layer") for n in report["float8_names"])
    q = once.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert type(q).__name__ == "FrozenFloat8Linear" and q.weight.dtype == torch.bfloat16  # not cast yet
    assert fp8.cast_frozen(once) == 14 and fp8.cast_frozen(once) == 0  # once
    assert q.weight_float8.dtype == torch.float8_e4m3fn and q.weight_float8_t.shape == (64, 64)
    assert not hasattr(q, "weight") and not any(".base_layer.weight" in k for k in once.state_dict())
    # nor buffers: DDP would broadcast them from rank 0 before every forward (broadcast_buffers)
    assert not any("float8" in n for n, _ in once.named_buffers())
    frozen_16bit = sum(p.numel() for p in ao.parameters()) - sum(p.numel() for p in once.parameters())
    assert frozen_16bit == sum(m.weight.numel() for m in ao.modules() if type(m).__name__ == "Float8Linear")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    (logits_ao, grads_ao), (logits_once, grads_once) = _step(ao, ids), _step(once, ids)
    assert torch.equal(logits_ao, logits_once)
    assert len(grads_ao) == 28 and all(torch.equal(a, b) for a, b in zip(grads_ao, grads_once, strict=True))


def test_cast_once_leaves_trainable_layers_to_torchao():
    """Full fine-tuning under frozen_cast_once: nothing is frozen, every layer is torchao's."""
    report = fp8.convert(_tiny_llama(), frozen_cast_once=True)
    assert report["summary"] == "14 of 15 linear layers in float8 (tensorwise)"
    assert report["frozen_cast_once"] == 0
    assert fp8.cast_once(2) and not fp8.cast_once(3)  # ZeRO-3 gathers its weight shards anew each step


@pytest.mark.reliability(
    fault="frozen weights cast once compute other numbers than torchao's float8 on the node (here: "
    "llmft's own cast made 5 % off on this CPU)",
    seen="the frozen-weight check the canary's FP8 leg runs (fp8.frozen_check, against torchao's "
    "Float8Linear) fails, and the leg's verdict names the cast-once path; the leg's training is not "
    "run (FP8 emulated on a CPU takes minutes)",
    steps_lost="the canary's FP8 leg (seconds)",
    data_lost="none",
)
def test_the_canary_fp8_leg_checks_the_frozen_weight_path(monkeypatch):
    """The FP8 leg (canary.fp8_leg) also runs one frozen layer cast once against torchao's
    Float8Linear (fp8.frozen_check): equal to the bit on this CPU. With a fault injected into llmft's
    own cast (each frozen weight's scale 5 % off) the check fails, and so does the leg, saying which
    path differs. (The leg's training is not rerun here: FP8 emulated on a CPU takes minutes.)"""
    from llmft.env import canary

    good = fp8.frozen_check("cpu")
    assert good == {"ok": True, "relative_difference": 0.0}
    assert canary.frozen_verdict(True, "FP8 on the curve", good) == (True, "FP8 on the curve")
    real = fp8._to_float8
    monkeypatch.setattr(fp8, "_to_float8", lambda t, dtype: (real(t, dtype)[0], real(t, dtype)[1] * 1.05))
    broken = fp8.frozen_check("cpu")
    assert not broken["ok"] and broken["relative_difference"] > fp8.FROZEN_CHECK_TOLERANCE
    said = "FP8 frozen weights cast once differ from torchao's float8 on this node"
    ok, message = canary.frozen_verdict(True, "FP8 on the curve", broken)
    assert not ok and message.startswith(said)
    ok, message = canary.frozen_verdict(False, "FP8 drifts from bf16: 9 %", broken)
    assert not ok and message.startswith("FP8 drifts from bf16: 9 %; " + said)


@pytest.mark.reliability(
    fault="FP8 asked for but silently not applied (here: the FP8 leg's conversion switched off)",
    seen="the canary's FP8 leg fails saying FP8 was asked for but did not run, and verify_env's finding "
    "names sft.fp8; under sft.fp8: auto the failed leg only keeps FP8 off",
    steps_lost="the canary's FP8 leg (seconds)",
    data_lost="none",
)
def test_canary_fails_naming_fp8_when_fp8_silently_did_not_apply(monkeypatch):
    """sft.fp8: true on an H200's facts, the FP8 leg run on this CPU after a bf16 leg that passed: the
    leg's conversion is switched off (the test-only switch), and the canary fails naming FP8. (The bf16
    leg itself is test_canary.py's; with nothing converted the FP8 leg never compares curves.)"""
    from llmft.env import canary

    monkeypatch.setenv(fp8.SKIP_ENV, "1")
    sft = Config.from_dict(validate({"hardware": {"gpus_per_node": 1}, "sft": {"fp8": True}})).sft
    facts = copy.deepcopy(H200)
    facts["attention"] = {}  # SDPA: the kernels this CPU runs
    facts["modules"] = {}
    path = canary.planned_path(facts, sft)
    bf16 = {"ok": True, "message": "bf16 leg on the golden curve", "run": {"losses": [], "grad_norm": 1.0}}
    out = canary._with_fp8(copy.deepcopy(bf16), facts, sft, path, "cpu", "")
    assert out["fp8"]["converted"] == "0 of 15 linear layers in float8 (tensorwise)"
    assert out["ok"] is False and out["suspect"] == ["fp8"]
    assert "FP8 was asked for but did not run: 0 of 15 linear layers in float8" in out["message"]
    finding = judge_canary({"canary": out})[0]
    assert (
        not finding.ok and "FP8 was asked for but did not run" in finding.message and "sft.fp8" in finding.fix
    )
    # auto on the same node: the failed leg only keeps FP8 off
    auto_sft = dataclasses.replace(sft, fp8="auto")
    auto = canary._with_fp8(copy.deepcopy(bf16), facts, auto_sft, path, "cpu", "")
    assert auto["ok"] is True and auto["fp8"]["ok"] is False


def test_sft_finalize_never_reports_fp8_it_did_not_count(tmp_path):
    from llmft.sft.publish import fp8_summary

    assert fp8_summary({"llmft": {}}, tmp_path)["planned"] is False
    with pytest.raises(RuntimeError, match="FP8 was planned but training wrote no llmft_fp8.json"):
        fp8_summary({"llmft": {"fp8": {"recipe": "tensorwise"}}}, tmp_path)
    report = {"recipe": "tensorwise", "float8_layers": 14, "linear_layers": 15, "float8_names": [],
              "bf16_names": ["lm_head"], "summary": "14 of 15"}  # fmt: skip
    fp8.write_report(tmp_path, report)
    assert fp8_summary({"llmft": {"fp8": {"recipe": "tensorwise"}}}, tmp_path)["float8_layers"] == 14


@pytest.fixture(scope="module")
def lf_lora_args(tmp_path_factory):
    """A tiny model folder and LLaMA-Factory's parsed arguments for a LoRA run on it."""
    from llamafactory.hparams import get_train_args
    from llmft.core.assets import build_tiny_model

    root = tmp_path_factory.mktemp("fp8_lf")
    build_tiny_model(root / "model", hidden_size=64, num_heads=4, vocab_size=512)
    args = {"model_name_or_path": str(root / "model"), "stage": "sft", "do_train": True, "dataset": "unused",
            "template": "default", "finetuning_type": "lora", "lora_target": "all",
            "output_dir": str(root / "out")}  # fmt: skip
    model_args, _, _, finetuning_args, _ = get_train_args(args)
    return root, model_args, finetuning_args


def _load_through_llamafactory(lf_lora_args, monkeypatch):
    """LLaMA-Factory's SFT workflow's load_model, as llmft.sft.train leaves it patched."""
    from llamafactory.model import load_tokenizer
    from llamafactory.train.sft import workflow
    from llmft.sft import train

    root, model_args, finetuning_args = lf_lora_args
    monkeypatch.setattr(workflow, "load_model", workflow.load_model)  # restored after the test
    train.install_fp8("tensorwise", root / "out", rank=0)
    tokenizer = load_tokenizer(model_args)["tokenizer"]
    return root, workflow.load_model(tokenizer, model_args, finetuning_args, True)


def test_the_training_entry_converts_the_model_llamafactory_loads_and_writes_the_count(
    lf_lora_args, monkeypatch
):
    root, model = _load_through_llamafactory(lf_lora_args, monkeypatch)
    written = fp8.read_report(root / "out")
    assert (
        written["summary"] == "14 of 43 linear layers in float8 (tensorwise)" == fp8.count(model)["summary"]
    )
    assert all(n.endswith(".base_layer") for n in written["float8_names"])


def test_the_training_entry_casts_frozen_weights_once_when_the_plan_says_so(lf_lora_args, monkeypatch):
    from llamafactory.model import load_tokenizer
    from llamafactory.train.sft import workflow
    from llmft.sft import train
    from llmft.sft.callbacks import CastFrozenFloat8

    root, model_args, finetuning_args = lf_lora_args
    monkeypatch.setattr(workflow, "load_model", workflow.load_model)  # restored after the test
    train.install_fp8("tensorwise", root / "once", rank=0, frozen_cast_once=True)
    model = workflow.load_model(load_tokenizer(model_args)["tokenizer"], model_args, finetuning_args, True)
    assert fp8.read_report(root / "once")["summary"] == (
        "14 of 43 linear layers in float8 (tensorwise; 14 frozen weights cast once)"
    )
    CastFrozenFloat8().on_train_begin(None, None, None, model=model)
    assert sum(getattr(m, "float8_cast", False) for m in model.modules()) == 14


@pytest.mark.reliability(
    fault="FP8 planned, but the loaded model has no float8 layer",
    seen="training entry refuses at model load, naming sft.fp8",
    steps_lost="none (before step 1)",
    data_lost="none",
)
def test_the_training_entry_refuses_to_train_in_bf16_when_fp8_was_planned(lf_lora_args, monkeypatch):
    from llmft.sft.train import FP8NotApplied

    monkeypatch.setenv(fp8.SKIP_ENV, "1")
    with pytest.raises(
        FP8NotApplied, match=r"FP8 was planned \(sft\.fp8\) but 0 of 43 linear layers in float8"
    ):
        _load_through_llamafactory(lf_lora_args, monkeypatch)
