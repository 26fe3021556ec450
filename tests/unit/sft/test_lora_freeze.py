"""LoRA / QLoRA / freeze keys: validation that names the key, what reaches LLaMA-Factory's YAML, the
planner's trainable parameters, and verify_env's bitsandbytes rule on recorded facts."""

import copy

import pytest
import yaml
from llmft.core.config import ConfigError, validate
from llmft.core.platform import Platform
from llmft.core.settings import Config
from llmft.core.shape import ModelShape
from llmft.env.rules import judge_bitsandbytes
from llmft.sft.plan import resolve, trainable_params
from llmft.sft.render import precheck, render

from tests.conftest import REPO, tiny_config

DEMO = yaml.safe_load((REPO / "config" / "config.yaml").read_text())


LORA_ONLY = "is only used with sft.finetuning_type: lora"


def sft(**keys) -> dict:
    cfg = copy.deepcopy(DEMO)
    cfg["sft"].update(keys)
    return cfg


BAD = [
    ("rank 0", sft(finetuning_type="lora", lora_rank=0), "config key sft.lora_rank"),
    ("rank text", sft(finetuning_type="lora", lora_rank="big"), "config key sft.lora_rank"),
    ("alpha 0", sft(finetuning_type="lora", lora_alpha=0), "sft.lora_alpha"),
    ("dropout 1", sft(finetuning_type="lora", lora_dropout=1.0), "config key sft.lora_dropout"),
    ("target with a space", sft(finetuning_type="lora", lora_target="q_proj, v_proj"), "sft.lora_target"),
    ("empty target list", sft(finetuning_type="lora", lora_target=[]), "config key sft.lora_target"),
    ("all and names", sft(finetuning_type="lora", lora_target=["all", "q_proj"]), "mixes 'all'"),
    ("target twice", sft(finetuning_type="lora", lora_target="q_proj,q_proj"), "names a module twice"),
    ("2 bits", sft(finetuning_type="lora", quantization_bit=2), "sft.quantization_bit"),
    ("8 bits under ZeRO-3", sft(finetuning_type="lora", quantization_bit=8), "allows only 4-bit"),
    ("quantized full", sft(quantization_bit=4), f"sft.quantization_bit: 4 {LORA_ONLY}"),
    ("QLoRA, CPU, ZeRO-3", sft(finetuning_type="lora", quantization_bit=4), "sft.zero_stage: 0 (or auto)"),
    ("rank without lora", sft(lora_rank=16), f"sft.lora_rank: 16 {LORA_ONLY}"),
    ("freeze, lora", sft(finetuning_type="lora", freeze_trainable_layers=1), "freeze_trainable_layers: 1"),
    ("0 trainable layers", sft(finetuning_type="freeze", freeze_trainable_layers=0), "0 trains nothing"),
    ("lora key in extra", sft(finetuning_type="lora", extra={"lora_rank": 4}), "set sft.lora_rank instead"),
]  # fmt: skip


@pytest.mark.parametrize("name,cfg,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_lora_and_freeze_values_name_the_key(name, cfg, needle):
    with pytest.raises(ConfigError) as err:
        validate(cfg, base_dir=REPO)
    assert needle in str(err.value)


def test_more_trainable_layers_than_the_model_has_is_refused_at_parse_time():
    cfg = validate(sft(finetuning_type="freeze", freeze_trainable_layers=-3), base_dir=REPO)
    with pytest.raises(
        ConfigError, match="sft.freeze_trainable_layers: -3 but the model has 2 decoder layers"
    ):
        precheck(Config.from_dict(cfg))


def test_the_cli_prints_the_message_alone(tmp_path):
    import subprocess
    import sys

    (tmp_path / "config").mkdir()
    (tmp_path / "config/config.yaml").write_text(
        yaml.safe_dump(sft(finetuning_type="lora", lora_dropout=-0.1))
    )
    proc = subprocess.run(
        [sys.executable, "-m", "llmft", "check-config"], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("llmft: config error: config key sft.lora_dropout")


@pytest.fixture
def tiny(tmp_path):
    return tiny_config(tmp_path / "tiny", tie_word_embeddings=True)


def rendered(tmp_path, model, **keys) -> dict:
    cfg = validate(sft(**keys), base_dir=REPO)
    return render(
        Config.from_dict(cfg),
        model,
        "d",
        str(tmp_path / "a.yaml"),
        str(tmp_path / "a.json"),
        "w",
        Platform.declared(Config.from_dict(cfg)),
    )


def test_lora_keys_reach_llamafactory(tmp_path, tiny):
    args = rendered(tmp_path, tiny, finetuning_type="lora", lora_rank=16, lora_target=["q_proj", "v_proj"])
    assert args["finetuning_type"] == "lora"
    assert (args["lora_rank"], args["lora_alpha"], args["lora_dropout"]) == (16, 32, 0.0)  # alpha auto = 2 r
    assert args["lora_target"] == "q_proj,v_proj" and "quantization_bit" not in args
    assert "freeze_trainable_layers" not in args
    assert args["llmft"]["finetuning_type"] == "lora"
    q = rendered(
        tmp_path,
        tiny,
        finetuning_type="lora",
        lora_alpha=8,
        lora_dropout=0.05,
        quantization_bit=4,
        zero_stage=0,
    )
    assert (q["lora_rank"], q["lora_alpha"], q["lora_dropout"], q["lora_target"]) == (8, 8, 0.05, "all")
    assert q["quantization_bit"] == 4
    assert q["output_dir"] != args["output_dir"]  # other adapter settings never resume these checkpoints


def test_freeze_and_full_keys(tmp_path, tiny):
    args = rendered(tmp_path, tiny, finetuning_type="freeze", freeze_trainable_layers=-1)
    assert args["freeze_trainable_layers"] == -1 and "lora_rank" not in args
    full = rendered(tmp_path, tiny)
    assert not {"lora_rank", "lora_target", "quantization_bit", "freeze_trainable_layers"} & set(full)


def test_planner_counts_the_adapters_it_is_given():
    # Llama-3-8B's shape: 32 layers, 4096 hidden, 8 KV heads of 128, 14336 MLP
    shape = ModelShape("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 8_030_261_248)
    q = o = 4096 + 4096
    k = v = 4096 + 1024
    gate = up = down = 4096 + 14336
    per_layer_all = q + k + v + o + gate + up + down  # in + out features of the 7 linear layers
    assert trainable_params(shape, "lora") == 32 * 8 * per_layer_all
    assert trainable_params(shape, "lora", lora_rank=64) == 32 * 64 * per_layer_all
    qv = 32 * 16 * (q + v)
    assert trainable_params(shape, "lora", lora_rank=16, lora_target="q_proj,v_proj") == qv
    assert trainable_params(shape, "freeze", freeze_trainable_layers=-4) == 4 * shape.layer_params
    assert trainable_params(shape, "full") == shape.params


def test_quantized_plans_never_pick_a_stage_bitsandbytes_cannot_train(tiny):
    gpu = {"vendor": "cuda", "gpus_per_node": 8, "processes_per_node": 0}
    for bits in (4, 8):
        cfg = sft(finetuning_type="lora", quantization_bit=bits, zero_stage="auto", precision="bf16")
        cfg["hardware"].update(gpu)
        valid = Config.from_dict(validate(cfg, base_dir=REPO))
        plan = resolve(valid, tiny, Platform.declared(valid))
        # LoRA trains without DeepSpeed on GPUs (plan._zero2_first); 8 bit would never get ZeRO-3
        assert plan.zero_stage == 0
    # on CPU processes: no DeepSpeed at all (bitsandbytes' CPU backend cannot save ZeRO-3's weights)
    cfg = Config.from_dict(
        validate(sft(finetuning_type="lora", quantization_bit=4, zero_stage="auto"), base_dir=REPO)
    )
    assert resolve(cfg, tiny, Platform.declared(cfg)).zero_stage == 0


def facts(**kw) -> dict:
    base = {"build": "cuda", "packages": {"bitsandbytes": "0.50.2"}}
    return {**base, **kw}


def judged(f: dict, **keys) -> list:
    from llmft.core.settings import Config

    cfg = sft(finetuning_type="lora", zero_stage="auto", **keys)
    cfg["hardware"].update({"vendor": "cuda", "gpus_per_node": 8, "processes_per_node": 0})
    return judge_bitsandbytes(f, Config.from_dict(validate(cfg, base_dir=REPO)).sft, "cuda")


def test_bitsandbytes_rule():
    ran = {"bits": 4, "ok": True, "device": "cuda:0", "relative_error": 0.09}
    assert judged(facts(bitsandbytes=ran)) == []  # no quantization asked: nothing to judge
    (ok,) = judged(facts(bitsandbytes=ran), quantization_bit=4)
    assert ok.ok and "4-bit layer ran on cuda:0" in ok.message
    (missing,) = judged({"build": "cuda", "packages": {"bitsandbytes": None}}, quantization_bit=4)
    assert not missing.ok and "not installed" in missing.message and "pip install bitsandbytes" in missing.fix
    assert "sft.quantization_bit: none" in missing.fix
    (old,) = judged(facts(packages={"bitsandbytes": "0.42.0"}, bitsandbytes=ran), quantization_bit=4)
    assert not old.ok and "older than 0.43.0" in old.message and "under ZeRO-3" in old.message
    broken = {"bits": 4, "ok": False, "device": "cuda:0", "error": "RuntimeError: no kernel image for sm_90"}
    (bad,) = judged(facts(bitsandbytes=broken), quantization_bit=4)
    assert not bad.ok and "no kernel image" in bad.message and "python -m bitsandbytes" in bad.fix
