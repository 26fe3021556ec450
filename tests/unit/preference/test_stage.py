"""The preference stage's config keys, plan (reference model, two sequences per pair) and rendered
LLaMA-Factory arguments."""

import pytest
from llmft.core.config import ConfigError, validate
from llmft.core.platform import Platform
from llmft.core.settings import Config, replace
from llmft.preference import stage as preference
from llmft.sft.plan import GIB, estimate, resolve
from llmft.sft.render import precheck, render, tiny_shape
from llmft.sft.steptime import step_time


def gpu_cfg(gpus=1, gpu="h200", sft=None, **pref):
    """A GPU config; the reference resident (as LLaMA-Factory runs it) unless reference_logps is given."""
    pref.setdefault("data", {"cutoff_len": 2048})
    pref.setdefault("reference_logps", "resident")
    return Config.from_dict(
        validate(
            {
                "hardware": {"vendor": "cuda", "nodes": 1, "gpus_per_node": gpus, "gpu_model": gpu},
                "data": {"cutoff_len": 2048},
                "sft": sft or {},
                "preference": pref,
            }
        )
    )


def cpu_cfg(**pref):
    """The CPU demo's config with a preference section."""
    return Config.from_dict(validate({"preference": pref}))


def declared(cfg: Config) -> Platform:
    """The platform the config declares (Platform reads the validated dict)."""
    return Platform.declared(cfg)


def plan(cfg, model_dir):
    view = preference.view(cfg)
    return pref_resolve(view, model_dir, declared(view))


def pref_resolve(view, model_dir, platform, shape=None):
    """sft's planner for the preference stage's view, with its objective on `platform`."""
    return resolve(view, model_dir, platform, shape, preference.objective(view, platform))


def pref_render(view, *args, ref_model=None, **kwargs):
    """sft's renderer for the preference stage's view, with its objective and data check."""
    objective_for = lambda platform: preference.objective(view, platform, ref_model)  # noqa: E731
    return render(view, *args, objective_for=objective_for, check_data=preference.check_data, **kwargs)


def test_reference_copy_is_16_bit_weights_sharded_only_by_zero3(model):
    from llmft.core.shape import model_shape

    shape = model_shape(model("1b"))
    common = dict(world=8, micro_batch=2, seq_len=2048, gradient_checkpointing=False)
    for stage, share in ((2, 1), (3, 8)):
        without = estimate(shape, stage=stage, **common)
        copy = estimate(shape, stage=stage, reference="copy", **common)
        assert copy.reference == pytest.approx(2 * shape.params / share / GIB)
        # the reference's fp32 logits of the micro-batch beside the policy's
        assert copy.loss - without.loss == pytest.approx(2 * 2048 * 4 * shape.vocab / GIB)
    lora = estimate(shape, stage=2, finetuning_type="lora", reference="forward", **common)
    assert lora.reference == 0  # the adapter-free policy: no second set of weights
    fp32 = estimate(shape, stage=0, precision="fp32", reference="copy", **common)
    assert fp32.reference == pytest.approx(4 * shape.params / GIB)


def test_a_pair_is_planned_as_two_sequences_with_its_reference(model):
    one_b = model("1b")
    dpo = plan(
        gpu_cfg(per_device_train_batch_size=4, gradient_accumulation_steps=1, padding_free=False), one_b
    )
    sft_cfg = gpu_cfg(
        sft={"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "packing": "off"}
    )
    sft_cfg = replace(sft_cfg, "preference", None)
    sft = resolve(sft_cfg, one_b, declared(sft_cfg))
    assert (dpo.micro_batch, dpo.sequences_per_row, dpo.reference) == (4, 2, "copy")
    assert dpo.tokens_per_micro_batch == sft.tokens_per_micro_batch == 8 * 2048
    assert dpo.zero_stage == sft.zero_stage
    assert dpo.memory.activations == pytest.approx(sft.memory.activations)
    # + the reference's weights and fp32 logits, and the policy's own logits, which Liger's fused
    # loss spares sft but not a preference loss
    assert dpo.liger and sft.liger
    tokens = 8 * 2048
    logits = tokens * (4 * 128256 + (10 + 6) * 128256 - 8 * 2048) / GIB
    assert dpo.memory.peak - sft.memory.peak == pytest.approx(dpo.memory.reference + logits, rel=1e-6)
    # the reference's forward pass: 2 FLOPs per weight and token more than sft's 6 (+ attention)
    assert 1.25 < dpo.step.compute_s / sft.step.compute_s < 1.45
    # padding-free (auto on a GPU whose torch has varlen attention): one chunk's logits at a time,
    # the reference's none beside the policy's
    free = plan(gpu_cfg(per_device_train_batch_size=4, gradient_accumulation_steps=1), one_b)
    assert free.padding_free and not dpo.padding_free
    chunk = 1024 * 10 * 128256 - tokens * 8 * 2048
    assert free.memory.peak - sft.memory.peak == pytest.approx(free.memory.reference + chunk / GIB, rel=1e-6)
    lora = plan(gpu_cfg(finetuning_type="lora", per_device_train_batch_size=4), one_b)
    assert lora.reference == "forward" and lora.memory.reference == 0
    orpo = plan(gpu_cfg(loss="orpo", per_device_train_batch_size=4), one_b)
    assert orpo.reference == "none" and orpo.memory.reference == 0


def test_liger_saves_no_logits_in_a_preference_loss(model):
    from llmft.core.shape import model_shape

    shape = model_shape(model("1b"))
    common = dict(stage=2, world=1, micro_batch=2, seq_len=2048, gradient_checkpointing=False, liger=True)
    fused = estimate(shape, **common)
    pairs = estimate(shape, logits=True, **common)
    assert fused.loss == pytest.approx(2 * 2048 * 8 * shape.hidden / GIB)
    # LLaMA-Factory's padded forward: sft's 10 bytes + its fp32 log-softmax and gradient (6)
    assert pairs.loss == pytest.approx(2 * 2048 * 16 * shape.vocab / GIB)
    # padding-free: one chunk of 1024 tokens' logits at a time, whatever the micro-batch
    free = estimate(shape, logits=True, padding_free=True, **common)
    assert free.loss == pytest.approx(1024 * 10 * shape.vocab / GIB)


def test_auto_batch_counts_both_sequences_of_a_pair(model):
    p = plan(gpu_cfg(), model("1b"))
    # 16384-token micro-batch budget and 32768 tokens per step, each pair two rows of 2048
    assert p.micro_batch * 2 * 2048 <= 16384
    assert p.tokens_per_step == 32768


@pytest.mark.reliability(
    fault="a preference config whose policy and reference model cannot fit",
    seen="refused by the check the workflow makes when it builds the DAG (render.precheck of the "
    "preference stage's view and objective, as workflow/rules/preference_helpers.smk calls it), naming the "
    "reference model and the keys to change",
    steps_lost="none (no job starts)",
    data_lost="none",
)
def test_a_preference_stage_that_cannot_fit_is_refused_naming_the_reference(model):
    cfg = gpu_cfg(gpu="h100", sft={"zero_stage": 0, "gradient_checkpointing": False})
    cfg = replace(cfg, "model.name_or_path", str(model("8b")))
    with pytest.raises(ConfigError) as err:
        staged = preference.training(cfg)
        precheck(staged.cfg, staged.objective_for)
    msg = str(err.value)
    assert "the preference stage (dpo: 2 sequences per row, reference model copy) does not fit" in msg
    assert "preference.finetuning_type: lora" in msg


def test_step_time_of_a_reference_copy_under_zero3_gathers_it_too(model):
    from llmft.core.shape import model_shape

    shape = model_shape(model("8b"))
    platform = declared(gpu_cfg(gpus=8))
    kw = dict(
        stage=3, offload=False, micro_batch=2, seq_len=2048, accumulation=1, gradient_checkpointing=False
    )
    base = step_time(shape, platform, trainable=shape.params, **kw)
    copy = step_time(shape, platform, trainable=shape.params, reference="copy", **kw)
    # gathers: 2 x weights + grads for the policy, one more set of weights for the reference
    assert copy.comm_s / base.comm_s == pytest.approx(4 / 3)


@pytest.mark.parametrize(
    "pref, key",
    [
        ({"method": "kto", "loss": "orpo"}, "preference.loss"),
        ({"loss": "simpo", "reference": "start"}, "preference.reference"),
        ({"simpo_gamma": 1.0}, "preference.simpo_gamma"),
        ({"method": "kto", "ftx": 0.5}, "preference.ftx"),
        ({"kto_desirable_weight": 2.0}, "preference.kto_desirable_weight"),
        ({"method": "ipo"}, "preference.method"),
        ({"method": "kto", "group_by_length": True}, "preference.group_by_length"),
        ({"method": "kto", "padding_free": True}, "preference.padding_free"),
    ],
)
def test_preference_keys_a_method_does_not_read_are_refused_by_name(pref, key):
    with pytest.raises(ConfigError, match=f"config key {key}"):
        validate({"preference": pref})


@pytest.mark.parametrize("metric", ["preference_accuracy", "reward_margin"])
def test_the_gate_metric_preference_accuracy_needs_a_preference_stage(metric):
    with pytest.raises(ConfigError, match=f"config key nightly.metric: {metric} needs a preference stage"):
        validate({"nightly": {"metric": metric}})
    assert (
        validate({"nightly": {"metric": "preference_accuracy"}, "preference": {}})["preference"]["method"]
        == "dpo"
    )
    assert validate({})["preference"] is None


def _rendered(tmp_path, **pref):
    cfg = cpu_cfg(**pref)
    view = preference.view(cfg)
    shape = tiny_shape(cfg.model.tiny)
    out = tmp_path / "p"
    return pref_render(
        view, "results/r/sft/model", "results/r/preference/data", str(out / "y.yaml"), str(out / "ds.json"),
        "results/r/work", declared(view), shape=shape, ref_model="results/r/base_model",
    )  # fmt: skip


def test_rendered_arguments_of_each_method_and_loss(tmp_path):
    dpo = _rendered(tmp_path)
    assert (dpo["stage"], dpo["pref_loss"], dpo["pref_beta"], dpo["pref_ftx"]) == ("dpo", "sigmoid", 0.1, 0.0)
    assert (dpo["dataset"], dpo["eval_dataset"]) == ("llmft_pref_train", "llmft_pref_heldout")
    assert dpo["learning_rate"] == 1e-3 and dpo["num_train_epochs"] == 1.0  # builtin:tiny's auto rate
    assert dpo["model_name_or_path"] == "results/r/sft/model" and "ref_model" not in dpo
    assert dpo["output_dir"].startswith("results/r/work/preference-")
    assert "packing" not in dpo and "neat_packing" not in dpo
    simpo = _rendered(tmp_path, loss="simpo", simpo_gamma=1.0)
    assert (simpo["pref_loss"], simpo["simpo_gamma"]) == ("simpo", 1.0)
    kto = _rendered(tmp_path, method="kto", kto_undesirable_weight=1.5)
    assert kto["stage"] == "kto" and kto["kto_rejected_weight"] == 1.5 and "pref_loss" not in kto
    base_ref = _rendered(tmp_path, reference="base")
    assert base_ref["ref_model"] == "results/r/base_model"
    lora = _rendered(tmp_path, finetuning_type="lora")
    assert lora["finetuning_type"] == "lora" and lora["lora_rank"] == 8


def test_the_auto_learning_rate_is_the_recipes_and_the_demo_rate_for_builtin_tiny():
    cfg = cpu_cfg()
    assert preference.learning_rate(cfg) == 1e-3  # builtin:tiny, whatever trains
    cfg = replace(cfg, "preference.finetuning_type", "lora")
    assert preference.learning_rate(cfg) == 1e-3
    cfg = replace(cfg, "model.name_or_path", "models/llama-3.2-1b")
    assert preference.learning_rate(cfg) == 5e-6
    cfg = replace(cfg, "preference.finetuning_type", "full")
    assert preference.learning_rate(cfg) == 5e-7
    cfg = replace(cfg, "preference.learning_rate", 2e-6)
    assert preference.learning_rate(cfg) == 2e-6


def _tokenized_pairs(data_dir, lengths: bool):
    """A tokenized-pairs folder as prepare_preference saves it, with or without the length column."""
    from datasets import Dataset, DatasetDict

    rows = {"chosen_input_ids": [[1, 2, 3], [4, 5]], "rejected_input_ids": [[6], [7, 8, 9, 10]]}
    if lengths:
        rows[preference.LENGTH_COLUMN] = [3, 4]
    split = Dataset.from_dict(rows)
    DatasetDict({"train": split, "validation": split}).save_to_disk(str(data_dir / "tokenized"))
    return str(data_dir)


def test_pairs_are_batched_by_length_when_asked_and_their_lengths_were_stored(model, tmp_path):
    from llmft.sft.plan import describe

    one_b = model("1b")
    gpu = plan(gpu_cfg(), one_b)  # auto: off, saying what was measured
    assert not gpu.group_by_length and "batched by length" not in describe(gpu)
    assert any(r.startswith("group_by_length auto -> off: on one H200") for r in gpu.reasons)
    grouped = plan(gpu_cfg(group_by_length=True), one_b)
    assert grouped.group_by_length and "batched by length" in describe(grouped)
    assert not plan(gpu_cfg(method="kto"), one_b).group_by_length
    assert not plan(gpu_cfg(group_by_length=False), one_b).group_by_length
    for pref, grouped in (({}, False), ({"group_by_length": True}, True)):  # the CPU demo
        cfg = cpu_cfg(**pref)
        view = preference.view(cfg)
        cpu = pref_resolve(view, "tiny", declared(view), tiny_shape(cfg.model.tiny))
        assert cpu.group_by_length is grouped
    # sft's plan and YAML are unchanged by the key
    sft = gpu_cfg(sft={"packing": "off"})
    assert "group_by_length" not in resolve(sft, one_b, declared(sft)).to_json()

    def rendered(data_dir, **pref):
        cfg = gpu_cfg(**pref)
        view = preference.view(cfg)
        out = tmp_path / "out"
        return pref_render(
            view, one_b, data_dir, str(out / "y.yaml"), str(out / "ds.json"), "work", declared(view)
        )

    with_lengths = _tokenized_pairs(tmp_path / "with", lengths=True)
    args = rendered(with_lengths, group_by_length=True)
    assert (args["train_sampling_strategy"], args["length_column_name"]) == ("group_by_length", "length")
    assert args["llmft"]["plan"]["group_by_length"] is True
    assert "train_sampling_strategy" not in rendered(with_lengths)
    # pairs tokenized without their lengths: transformers' sampler would stop the job at its start
    without = _tokenized_pairs(tmp_path / "without", lengths=False)
    args = rendered(without)
    assert "train_sampling_strategy" not in args and args["llmft"]["plan"]["group_by_length"] is False
    with pytest.raises(
        ConfigError, match="config key preference.group_by_length: true, but .* no pair lengths"
    ):
        rendered(without, group_by_length=True)


def test_the_plan_sizes_sequences_by_the_preference_cutoff_not_sfts(model):
    """A pair's side is at most preference.data.cutoff_len tokens (prepare_preference drops longer
    ones), whatever data.cutoff_len says for sft: the planner's sequences are that long."""
    from llmft.sft.plan import describe

    short, long = (plan(gpu_cfg(data={"cutoff_len": n}), model("1b")) for n in (512, 4096))
    assert (short.seq_len, long.seq_len) == (512, 4096)
    assert "x 4096 tokens" in describe(long)


def test_dpo_runs_padding_free_where_the_varlen_kernel_ran(model, tmp_path):
    """auto: on with varlen attention on every node (and on a CPU), off without it or with an explicit
    attention kernel; true without the kernel is refused by name; the rendered YAML tells the launcher."""
    import dataclasses

    from llmft.sft.plan import describe

    one_b = model("1b")
    on = plan(gpu_cfg(), one_b)
    assert on.padding_free and "padding-free" in describe(on)
    assert any(r.startswith("padding_free auto -> on") for r in on.reasons)
    assert not plan(gpu_cfg(padding_free=False), one_b).padding_free
    assert not plan(gpu_cfg(method="kto"), one_b).padding_free
    explicit = plan(gpu_cfg(sft={"flash_attn": "sdpa"}), one_b)
    assert not explicit.padding_free
    assert any("sft.flash_attn is set to 'sdpa'" in r for r in explicit.reasons)
    cfg = gpu_cfg()
    view = preference.view(cfg)
    no_kernel = dataclasses.replace(declared(view), attention=("sdpa",))
    assert not pref_resolve(view, one_b, no_kernel).padding_free
    forced = preference.view(gpu_cfg(padding_free=True))
    with pytest.raises(ConfigError, match="config key preference.padding_free: true needs torch's varlen"):
        pref_resolve(forced, one_b, no_kernel)
    # fp32 on a GPU: the varlen kernel computes in fp16/bf16 only
    fp32 = preference.view(gpu_cfg(sft={"precision": "fp32"}))
    assert not pref_resolve(fp32, one_b, declared(fp32)).padding_free
    fp32_forced = preference.view(gpu_cfg(padding_free=True, sft={"precision": "fp32"}))
    refusal = "padding_free: true needs torch's varlen attention, which computes"
    with pytest.raises(ConfigError, match=refusal):
        pref_resolve(fp32_forced, one_b, declared(fp32_forced))
    cpu = cpu_cfg()
    cpu_view = preference.view(cpu)
    cpu = pref_resolve(cpu_view, "tiny", declared(cpu_view), tiny_shape(cpu.model.tiny))
    assert cpu.padding_free  # the CPU's per-sequence SDPA: the demo and the tests run this path
    sft = gpu_cfg(sft={"packing": "off"})
    assert "padding_free" not in resolve(sft, one_b, declared(sft)).to_json()
    out = tmp_path / "out"
    args = pref_render(view, one_b, _tokenized_pairs(tmp_path / "d", lengths=False), str(out / "y.yaml"),
                  str(out / "ds.json"), "work", declared(view))  # fmt: skip
    assert args["llmft"]["padding_free"] is True and args["llmft"]["plan"]["padding_free"] is True
    off = preference.view(gpu_cfg(padding_free=False))
    args = pref_render(off, one_b, _tokenized_pairs(tmp_path / "e", lengths=False), str(out / "z.yaml"),
                  str(out / "ds2.json"), "work", declared(off))  # fmt: skip
    assert "padding_free" not in args["llmft"]


def test_cached_reference_logps_plan_no_reference_model_and_auto_caches_on_gpus(model, tmp_path):
    """preference.reference_logps: cached plans no reference weights, logits or forward pass, and the
    rendered YAML names the reference step's record for the worker; auto is cached on GPUs, resident
    on CPU processes; orpo/simpo ignore the key, and the plan says so."""
    from llmft.sft.plan import describe

    one_b = model("1b")
    sizes = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "padding_free": False}
    resident = plan(gpu_cfg(**sizes), one_b)
    cached = plan(gpu_cfg(**sizes, reference_logps="cached"), one_b)
    assert (resident.reference, cached.reference) == ("copy", "cached")
    assert resident.memory.reference > 0 and cached.memory.reference == 0
    # the reference's fp32 logits of the micro-batch are gone too
    logits = 4 * 2 * 2048 * 4 * 128256 / GIB
    assert resident.memory.loss - cached.memory.loss == pytest.approx(logits)
    assert cached.step.compute_s < resident.step.compute_s * 0.85  # no reference forward per step
    assert "reference model cached" in describe(cached)
    assert any(r.startswith("reference_logps cached: the reference step's") for r in cached.reasons)

    mode, why = preference.reference_logps(preference.view(gpu_cfg(reference_logps="auto")))
    assert mode == "cached" and why.startswith("reference_logps auto -> cached") and "frozen weights" in why
    lora = preference.reference_logps(
        preference.view(gpu_cfg(reference_logps="auto", finetuning_type="lora"))
    )
    assert lora[0] == "cached" and "frozen weights" not in lora[1]
    qlora = gpu_cfg(reference_logps="auto", sft={"finetuning_type": "lora", "quantization_bit": 4})
    assert preference.reference_logps(preference.view(qlora))[0] == "resident"
    cpu = cpu_cfg()
    assert preference.reference_logps(cpu)[0] == "resident"
    assert "CPU processes" in preference.reference_logps(cpu)[1]
    ignored = plan(gpu_cfg(loss="orpo", reference_logps="cached"), one_b)
    assert ignored.reference == "none"
    assert "reference_logps cached ignored: preference.loss orpo has no reference model" in ignored.reasons

    view = preference.view(gpu_cfg(reference_logps="cached", reference="base", start_from="sft"))
    data = _tokenized_pairs(tmp_path / "d", lengths=False)
    args = pref_render(view, one_b, data, str(tmp_path / "y.yaml"), str(tmp_path / "ds.json"), "work",
                       declared(view), ref_model="base")  # fmt: skip
    assert args["llmft"]["reference_logps"] == f"results/{view.run}/preference/reference/reference.json"
    assert args["llmft"]["plan"]["reference"] == "cached" and "ref_model" not in args
    assert "reference_logps" not in _rendered(tmp_path)["llmft"]  # the demo: auto, resident on CPU
