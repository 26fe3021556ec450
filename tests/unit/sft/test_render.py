"""Rendering the LLaMA-Factory YAML / DeepSpeed JSON, metrics, report escaping."""

import json

import pytest
import yaml
from llmft.core.config import validate
from llmft.core.draw import esc, svg_lines, table
from llmft.core.launch import launch_env
from llmft.core.lineage_record import run_head
from llmft.core.platform import Platform
from llmft.core.settings import Config
from llmft.core.shape import model_shape
from llmft.core.slurm import Allocation
from llmft.evaluate.metrics import exact_match
from llmft.sft.plan import ZERO3_SUB_GROUP, resolve
from llmft.sft.render import deepspeed_config, render

from tests.conftest import REPO, tiny_config

DEMO = validate(yaml.safe_load((REPO / "config/config.yaml").read_text()), base_dir=REPO)


@pytest.fixture
def tiny(tmp_path):
    return tiny_config(tmp_path / "tiny")


def plan_of(raw, model_dir):
    """The plan for what the config declares (its hardware.gpu_model), as `llmft plan` makes it."""
    cfg = Config.from_dict(raw)
    return resolve(cfg, model_dir, Platform.declared(cfg))


def render_declared(raw, model_dir, out, name, deepspeed_name=None):
    """render() of a validated config for the platform it declares, into out/<name>.yaml and
    out/<deepspeed_name or name>.json (data folder "d", work root "w")."""
    cfg = Config.from_dict(raw)
    yaml_out, ds_out = out / f"{name}.yaml", out / f"{deepspeed_name or name}.json"
    return render(cfg, model_dir, "d", str(yaml_out), str(ds_out), "w", Platform.declared(cfg))


def test_render_writes_yaml_and_zero3(tmp_path, tiny):
    args = render_declared(DEMO, tiny, tmp_path, "lf", "ds")
    on_disk = yaml.safe_load((tmp_path / "lf.yaml").read_text())
    assert on_disk == args
    assert args["overwrite_output_dir"] is False
    assert args["logging_nan_inf_filter"] is False  # NaN must reach the divergence guard
    assert args["ddp_timeout"] == round(DEMO["sft"]["collective_timeout_minutes"] * 60)
    assert args["deepspeed"] == str(tmp_path / "ds.json")
    # the demo's explicit settings pass through the planner unchanged
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (16, 1)
    assert args["disable_gradient_checkpointing"] is True and "neat_packing" not in args
    assert args["llmft"]["plan"]["zero_stage"] == 3
    ds = json.loads((tmp_path / "ds.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    # no per-step overflow pass in bf16: the divergence guard stops a NaN/inf run instead
    assert ds["bf16"] == {"enabled": "auto", "check_grad_overflow": False}
    # on gloo the whole model fits one bucket, rounded up to a million elements (HF's h^2 = 16 384
    # sent one message per parameter). No overlap without a GPU stream.
    zero, params = ds["zero_optimization"], model_shape(tiny).params
    assert zero["overlap_comm"] is False
    assert zero["reduce_bucket_size"] == zero["stage3_prefetch_bucket_size"] >= params
    assert zero["reduce_bucket_size"] - params < 1e6 and zero["reduce_bucket_size"] % 1e6 == 0


def test_extra_passes_through_and_changes_work_dir(tmp_path, tiny):
    cfg = validate({**DEMO, "sft": {**DEMO["sft"], "extra": {"packing": True}}}, base_dir=REPO)
    a = render_declared(DEMO, tiny, tmp_path, "a")
    b = render_declared(cfg, tiny, tmp_path, "b")
    assert b["packing"] is True and "packing" not in a
    assert a["output_dir"] != b["output_dir"]  # a new config never resumes an old checkpoint


def test_zero0_has_no_deepspeed_and_no_unused_param_search(tmp_path, tiny):
    cfg = validate({**DEMO, "sft": {**DEMO["sft"], "zero_stage": 0}}, base_dir=REPO)
    args = render_declared(cfg, tiny, tmp_path, "a")
    assert "deepspeed" not in args and args["ddp_find_unused_parameters"] is False


def test_gpu_auto_render_uses_the_plan(tmp_path, tiny):
    cfg = validate({"hardware": {"vendor": "cuda", "gpus_per_node": 8, "gpu_model": "h100"}})
    args = render_declared(cfg, tiny, tmp_path, "a")
    assert args["neat_packing"] is True and args["flash_attn"] == "sdpa"  # sdpa loads, varlen runs
    assert args["llmft"]["attention"] == "varlen"
    # varlen rows carry a 0/1 mask of their real tokens: their padding is not counted as tokens
    assert args["include_num_input_tokens_seen"] == "non_padding"
    assert args["disable_gradient_checkpointing"] is True
    plan = args["llmft"]["plan"]
    # several GPUs in bf16: ZeRO-2 (16-bit compute, sharded states), not plain DDP under autocast
    assert plan["zero_stage"] == 2 and plan["tokens_per_step"] == cfg["sft"]["tokens_per_step"]
    assert json.loads((tmp_path / "a.json").read_text())["zero_optimization"]["stage"] == 2
    ddp = validate({**cfg, "sft": {"zero_stage": 0}})
    args = render_declared(ddp, tiny, tmp_path, "c")
    assert "deepspeed" not in args and args["ddp_find_unused_parameters"] is False
    zero3 = validate({**cfg, "sft": {"zero_stage": 3}})
    render_declared(zero3, tiny, tmp_path, "b")
    ds = deepspeed_config(plan_of(zero3, tiny), Platform.declared(Config.from_dict(zero3)))
    assert ds["zero_optimization"]["overlap_comm"] is True
    assert ds["zero_optimization"]["sub_group_size"] == ZERO3_SUB_GROUP  # what the planner assumes
    assert ds["zero_optimization"]["stage3_prefetch_bucket_size"] >= 5e7  # not HF's h^2


def test_torch_compile_renders_compiled_layers_and_liger_loss_alone(tmp_path, tiny):
    hw = {"vendor": "cuda", "gpus_per_node": 8, "gpu_model": "h100"}
    cfg = validate({"hardware": hw, "sft": {"torch_compile": True, "liger_kernel": True}})
    args = render_declared(cfg, tiny, tmp_path, "a")
    # LLaMA-Factory's switch would patch every Liger kernel; the launcher applies the fused loss alone
    assert "enable_liger_kernel" not in args
    assert args["llmft"]["compile_layers"] is True and args["llmft"]["liger_loss_only"] is True
    eager = validate({"hardware": hw, "sft": {"liger_kernel": True}})
    args = render_declared(eager, tiny, tmp_path, "b")
    assert args["enable_liger_kernel"] is True and not args["llmft"]["compile_layers"]


def test_static_shapes_and_compile_tuning_reach_the_training_entry(tmp_path, tiny, monkeypatch):
    hw = {"vendor": "cuda", "gpus_per_node": 8, "gpu_model": "h100"}
    sft = {"torch_compile": True, "static_shapes": True, "compile_tuning": True, "fp8": False}
    cfg = validate({"hardware": hw, "sft": sft, "data": {"cutoff_len": 512}})
    args = render_declared(cfg, tiny, tmp_path, "a")
    plan = args["llmft"]["plan"]
    assert args["llmft"]["static_tokens"] == plan["micro_batch"] * 512 == plan["static_tokens"]
    assert args["llmft"]["compile_tuning"] is True
    assert f"every micro-batch padded to {plan['static_tokens']} tokens" in (tmp_path / "a.yaml").read_text()
    # neither by default on a bf16 plan (its layers do not compile)
    plain = validate({"hardware": hw})
    args = render_declared(plain, tiny, tmp_path, "b")
    assert "static_tokens" not in args["llmft"] and "compile_tuning" not in args["llmft"]
    # the collator pads a flattened micro-batch to exactly that many tokens, counting real ones only
    import torch
    from llmft.core import varlen

    monkeypatch.setenv(varlen.PAD_TO_ENV, "16")
    seg = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 0, 0, 0]])
    ids = torch.arange(12).view(2, 6)
    out = varlen.trainer_batch({"attention_mask": seg, "input_ids": ids, "labels": ids.clone()})
    assert out["input_ids"].shape == (1, 16) and out[varlen.TOKENS_KEY] == 8
    assert out["cu_seq_lens_q"].tolist() == [0, 2, 5, 8, 16] and out["labels"][0, 8:].eq(-100).all()
    monkeypatch.setenv(varlen.PAD_TO_ENV, "4")  # fewer than the real tokens: the usual multiple of 16
    out = varlen.trainer_batch({"attention_mask": seg, "input_ids": ids, "labels": ids.clone()})
    assert out["input_ids"].shape == (1, varlen.PAD_MULTIPLE)


def test_compile_tuning_turns_on_inductors_kernel_tuning(tiny, monkeypatch):
    import torch._inductor.config as inductor
    from llmft.sft.callbacks import compile_layers
    from transformers import AutoConfig, AutoModelForCausalLM

    monkeypatch.setattr(inductor, "coordinate_descent_tuning", False)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny))
    compile_layers(model)
    assert inductor.coordinate_descent_tuning is False
    compile_layers(model, tuning=True)
    assert inductor.coordinate_descent_tuning is True


def test_compile_layers_compiles_each_decoder_layer_in_place(tiny):
    from llmft.sft.callbacks import compile_layers
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny))  # random init, no weights
    keys = list(model.state_dict())
    n = compile_layers(model)
    assert n == model.config.num_hidden_layers
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert list(model.state_dict()) == keys  # checkpoints keep their parameter names
    with pytest.raises(RuntimeError, match="sft.torch_compile"):
        compile_layers(model.lm_head)  # names no repeated blocks


def test_launch_env_rocm_preset():
    cfg = validate(
        {"hardware": {"vendor": "rocm", "gpus_per_node": 8, "nodes": 2, "socket_ifname": "ens50f0"}}
    )
    env = launch_env(
        Platform.declared(Config.from_dict(cfg)),
        Allocation("9", ["a", "b"], 1, "10.0.0.1", 30000),
        base_env={},
    )
    assert env["PYTORCH_ROCM_ARCH"] == "gfx942"
    assert env["NCCL_SOCKET_IFNAME"] == "ens50f0"
    assert (env["NNODES"], env["NODE_RANK"], env["NPROC_PER_NODE"]) == ("2", "1", "8")
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["FORCE_TORCHRUN"] == "1"


def test_exact_match_normalises_space_and_case():
    assert exact_match(" Cat ", "cat") == 1.0 and exact_match("cat", "cats") == 0.0


def test_report_text_is_escaped():
    evil = "<script>alert(1)</script>"
    html = table(["prompt"], [[evil]]) + svg_lines({evil: [(0, 1), (1, 2)]}, evil, "x")
    assert "<script>" not in html and esc(evil) in html


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_zero_stage_config_leaves_nothing_for_deepspeed_to_guess(tiny, tmp_path, stage):
    """transformers fills some "auto" values and refuses a config with any other one left."""
    from transformers import LlamaConfig, TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    cpu = validate({**DEMO, "sft": {**DEMO["sft"], "zero_stage": stage}}, base_dir=REPO)
    gpu = validate({"hardware": {"vendor": "cuda", "gpus_per_node": 2}, "sft": {"zero_stage": stage}})
    for cfg in (cpu, gpu):
        typed = Config.from_dict(cfg)
        platform = Platform.declared(typed)
        ds = deepspeed_config(resolve(typed, tiny, platform), platform)
        hf = HfTrainerDeepSpeedConfig(ds)
        args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
        hf.trainer_config_process(args)

        class Model:
            config = LlamaConfig(hidden_size=64)

        hf.trainer_config_finalize(args, Model(), num_training_steps=10)
        assert "auto" not in json.dumps(hf.config), (platform.vendor, hf.config)


def test_a_resumed_attempt_reports_its_own_steps_and_what_was_lost():
    from llmft.sft.publish import attempts_summary

    first = [{"attempt_start": 0, "started": 0.0, "tokens": 0}]
    first += [{"step": s, "time": 10.0 + s, "tokens": 100 * s} for s in range(1, 13)]  # killed after 12
    second = [{"attempt_start": 10, "started": 100.0, "tokens": 1000}]  # resumed from checkpoint 10
    second += [{"step": s, "time": 110.0 + 2 * (s - 10), "tokens": 100 * s} for s in range(11, 21)]
    got = attempts_summary(first + second)
    assert (got["attempts"], got["resumed_from_step"], got["steps_trained"], got["steps_lost"]) == (
        2,
        10,
        10,
        2,
    )
    assert got["tokens_per_second_per_gpu"] == 50.0  # 100 tokens a step, 2 s a step, this attempt only
    assert got["starts"] == [0, 10]
    assert got["runtime_s"] == 22.0 + 30.0  # 0 -> 22 s (step 12), then 100 -> 130 s (step 20)
    again = attempts_summary(
        first + second + [{"attempt_start": 20, "started": 200.0}, {"republished": 300.0}]
    )
    assert again["republished_without_training"] and again["steps_trained"] == 10
    assert attempts_summary([]) == {"attempts": 0, "republished_without_training": False}


def test_lineage_names_the_base_model_folder_the_stage_was_given(tmp_path, tiny):
    """render-sft's config slice holds no model.name_or_path: the lineage's base model is the folder
    the rule passed, and a run's own built builtin:tiny folder is named builtin:tiny."""
    args = render_declared(DEMO, tiny, tmp_path, "lf", "ds")
    assert "lineage" not in args["llmft"] and "cost" not in args["llmft"]  # lineage.json holds them
    assert run_head(Config.from_dict(DEMO), tiny) == {
        "parent": None,
        "started_from": tiny,
        "base_model": tiny,
        "chain": [],
    }
    assert f"# starts from the base model {tiny}\n" in (tmp_path / "lf.yaml").read_text()
    built = run_head(Config.from_dict(DEMO), f"results/{DEMO['run']}/base_model")
    assert built["base_model"] == built["started_from"] == "builtin:tiny"
