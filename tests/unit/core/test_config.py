"""Bad configs stop before anything runs, and the message names the key or path."""

import copy
import json
import time

import pytest
import yaml
from llmft.core.config import ConfigError, deep_merge, layout, load_file, validate
from llmft.core.io import write_json

from tests.conftest import REPO, tiny_config

DEMO = yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def with_(dotted: str, value):
    cfg = copy.deepcopy(DEMO)
    node = cfg
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return cfg


def test_demo_config_is_valid_and_filled():
    cfg = validate(DEMO, base_dir=REPO)
    assert cfg["run"] == "demo"
    assert cfg["verify"]["timeout_seconds"] == 120  # a default filled in from the schema
    assert layout(cfg).world_size == 2


def test_empty_config_takes_every_default():
    cfg = validate({})
    assert cfg["sft"]["zero_stage"] == "auto" and cfg["sft"]["precision"] == "bf16"


BAD = [
    ("unknown top-level key", {**DEMO, "trainig": {}}, "trainig"),
    ("unknown nested key", with_("sft.learning_rat", 0.1), "learning_rat"),
    ("wrong type", with_("sft.learning_rate", "fast"), "sft.learning_rate"),
    ("bad enum", with_("sft.precision", "fp8"), "sft.precision"),
    ("bad run name", with_("run", "my run/1"), "config key run"),
    ("run name ..", with_("run", ".."), "not starting with '.'"),
    ("run name .", with_("run", "."), "not starting with '.'"),
    ("hidden run name", with_("run", ".x"), "not starting with '.'"),
    ("run name current", with_("run", "current"), "reserved"),
    ("run name nightly", with_("run", "nightly"), "reserved"),
    ("shell in run name", with_("run", "a;touch pwned"), "config key run"),
    ("substitution in run name", with_("run", "$(id)"), "config key run"),
    ("heldout fraction out of range", with_("data.heldout_fraction", 1.5), "data.heldout_fraction"),
    ("replay share of every row", with_("nightly.replay_fraction", 1.0), "nightly.replay_fraction"),
    ("negative nodes", with_("hardware.nodes", 0), "hardware.nodes"),
    (
        "missing dataset file",
        with_("data.sources", [{"path": "data/nope.jsonl"}]),
        "data.sources[0].path: dataset file not found",
    ),
    ("dataset not json", with_("data.sources", [{"path": "Makefile"}]), "data.sources[0].path"),
    ("unknown builtin", with_("data.sources", [{"path": "builtin:alpaca"}]), "data.sources[0].path"),
    ("model folder missing", with_("model.name_or_path", "models/none"), "model.name_or_path"),
    ("gpu vendor without gpus", with_("hardware.vendor", "rocm"), "hardware.gpus_per_node"),
    ("reserved passthrough key", with_("sft.extra", {"output_dir": "/tmp/x"}), "sft.extra"),
    ("unknown template", with_("model.template", "llama33"), "no template 'llama33' (did you mean llama3"),
    ("typo in sft.extra", with_("sft.extra", {"lora_rnak": 8}), "not LLaMA-Factory 0.9.5 training arguments"),
    ("exponent read as text", with_("sft.learning_rate", "1e-4"), "write 0.0001 (e.g. 1.0e-4 for 1e-4)"),
]

# Values that would reach a shell, a folder name or a model's own code.
HOSTILE = [
    ("run name ending in a newline", with_("run", "demo\n"), "config key run: 'demo\\n' is not allowed"),
    ("reserved run name with a newline", with_("run", "current\n"), "config key run: 'current\\n' is not"),
    ("run name -rf", with_("run", "-rf"), "not starting with '.' or '-'"),
    ("run name --help", with_("run", "--help"), "not starting with '.' or '-'"),
    ("run name of 256 characters", with_("run", "r" * 256), "is 256 characters long, at most 128"),
    ("image with a command", with_("container.image", "$(touch${IFS}x)"), "config key container.image"),
    ("image with ;", with_("container.image", "a.sif;id"), "docker://, oras:// or library://"),
    ("image as an option", with_("container.image", "--bind=/"), "not starting with -"),
    (
        "schedule with a second entry",
        with_("nightly.schedule", "0 2 * * *\n* * * * * id"),
        "nightly.schedule",
    ),
    ("schedule with a command", with_("nightly.schedule", "0 2 * * * id"), "five cron fields"),
    ("partition with a #SCRON line", with_("nightly.partition", "cpu\n#SCRON --x"), "nightly.partition"),
    ("partition with a space", with_("nightly.partition", "cpu -A x"), "a Slurm partition name is"),
    (
        "remote code",
        with_("sft.extra", {"trust_remote_code": True}),
        "sft.extra.trust_remote_code: llmft never",
    ),
    ("long text", with_("sft.extra", {"run_name": "x" * 10_000}), "sft.extra.run_name: a text of 10000"),
    (
        "config too big",
        with_("verify.required_packages", ["p" * 8000] * 9),
        "config key verify: the config is",
    ),
]


@pytest.mark.parametrize("name,cfg,needle", HOSTILE, ids=[b[0] for b in HOSTILE])
@pytest.mark.reliability(
    fault=(
        "run names `demo\\n`, `current\\n`, `-rf`, `--help`, 256 characters; a `container.image`, "
        "`nightly.schedule` or `nightly.partition` carrying a command or a newline; "
        "`sft.extra.trust_remote_code: true`; a 10 000-character text; a config over 64 KiB as JSON"
    ),
    seen="refused, naming the key and what it may be",
    steps_lost="none",
    data_lost="none",
)
def test_hostile_values_are_refused_naming_the_key(name, cfg, needle):
    with pytest.raises(ConfigError) as err:
        validate(cfg, base_dir=REPO)
    assert needle in str(err.value)
    assert len(str(err.value)) < 1000  # a long value is cut in the message


def test_safe_images_schedules_and_partitions_pass():
    images = ["", "/shared/images/llmft-rocm.sif", "docker://ghcr.io/org/llmft:1.2@sha256:ab12"]
    images += ["oras://reg.example/llmft:7", "library://user/col/llmft:latest", "images/x+y.sif"]
    for image in images:
        assert validate(with_("container.image", image), base_dir=REPO)["container"]["image"] == image
    for schedule in ("0 2 * * *", "*/15 1-5 * jan,feb mon-fri", "@daily"):
        assert validate(with_("nightly.schedule", schedule), base_dir=REPO)["nightly"]["schedule"] == schedule
    assert validate(with_("nightly.partition", "cpu,cpu-long"), base_dir=REPO)["nightly"]["partition"]
    assert validate(with_("sft.extra", {"trust_remote_code": False}), base_dir=REPO)


BOMB_S = 10


@pytest.mark.reliability(
    fault="a YAML alias bomb (9 ** 9 values) in a file given to `python -m llmft check-config "
    "--configfile`, or to a stage CLI's --config (load_file)",
    seen=f"refused within {BOMB_S} s, exit 2, naming the file and the key",
    steps_lost="none",
    data_lost="none",
)
def test_an_alias_bomb_file_is_refused_before_it_is_expanded(tmp_path, capsys):
    from llmft.__main__ import main

    lines = ["&a0 [x, x, x, x, x, x, x, x, x]"] + [
        f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)
    ]
    path = tmp_path / "bomb.yaml"
    path.write_text("sft:\n  extra:\n    run_name:\n" + "".join(f"      - {line}\n" for line in lines))
    said = "bomb.yaml: config key sft.extra.run_name expands to more than"
    (tmp_path / "config").mkdir()
    (tmp_path / "config/config.yaml").write_text((REPO / "config/config.yaml").read_text())
    t0 = time.monotonic()
    assert main(["check-config", "-d", str(tmp_path), "--configfile", str(path)]) == 2
    assert time.monotonic() - t0 < BOMB_S and said in capsys.readouterr().err
    with pytest.raises(ConfigError, match=said):
        load_file(path)
    # the same values, built in memory (a JSON config, --config): counted only up to the bound
    raw = yaml.safe_load(path.read_text())
    with pytest.raises(ConfigError, match=r"config key sft.extra.run_name: the config holds more than 20000"):
        validate(raw)


@pytest.mark.parametrize("name,cfg,needle", BAD, ids=[b[0] for b in BAD])
@pytest.mark.reliability(
    fault=(
        "run names `..`, `.`, `current`, `nightly`, `a;touch pwned`, `$(id)`; an unknown template; "
        "a typo in `sft.extra`; `1e-4` read by YAML as text"
    ),
    seen="refused, naming the key (and the fix: the closest template, `1.0e-4`)",
    steps_lost="none",
    data_lost="none",
)
def test_bad_config_names_the_key(name, cfg, needle):
    with pytest.raises(ConfigError) as err:
        validate(cfg, base_dir=REPO)
    assert needle in str(err.value)


def test_an_empty_dataset_file_is_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"data.sources\[0\].path: .*empty.jsonl is empty"):
        validate(with_("data.sources", [{"path": str(tmp_path / "empty.jsonl")}]), base_dir=REPO)


@pytest.mark.parametrize(
    "kind,needle",
    [("fifo", "is a FIFO (named pipe), not a regular file"), ("loop", "is a symlink loop"),
     ("zero", "is a device, not a regular file")],
)  # fmt: skip
def test_a_fifo_symlink_loop_or_device_dataset_path_is_named(tmp_path, kind, needle):
    import os

    path = tmp_path / "rows.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "loop":
        os.symlink(path.name, path)
    else:
        path.symlink_to("/dev/zero")
    with pytest.raises(ConfigError) as err:
        validate(with_("data.sources", [{"path": str(path)}]), base_dir=REPO)
    assert str(err.value) == f"config key data.sources[0].path: {path} {needle}" + (
        " (never opened: reading it could block or never end)" if kind != "loop" else ""
    )


def test_offload_needs_zero3():
    cfg = with_("sft.zero_stage", 2)
    cfg["sft"]["offload"] = True
    with pytest.raises(ConfigError, match="sft.offload"):
        validate(cfg, base_dir=REPO)


def test_more_processes_than_gpus():
    cfg = with_("hardware.gpus_per_node", 1)
    with pytest.raises(ConfigError, match="hardware.processes_per_node"):
        validate(cfg, base_dir=REPO)


def test_the_names_table_is_the_installed_llamafactorys():
    """lf_names.json (what config validation checks templates and sft.extra against) is what the
    LLaMA-Factory installed with llmft accepts; regenerate it with `python -m llmft.core.lf.lfnames`."""
    from llmft.core.lf.lfnames import from_llamafactory, names

    assert names() == from_llamafactory()


def test_the_json_config_sft_steps_read_keeps_small_numbers(tmp_path):
    """render_sft_config writes the config sft's three steps read as JSON, whose `1e-05` YAML would
    read as text: the file is read as JSON."""
    path = tmp_path / "config.json"
    write_json(path, {"run": "r", "sft": {"learning_rate": 1e-5}})
    assert "1e-05" in path.read_text()
    assert load_file(path)["sft"]["learning_rate"] == 1e-5
    with pytest.raises(ConfigError, match="sft.learning_rate"):
        load_file(path.rename(tmp_path / "config.yaml"))


@pytest.mark.reliability(
    fault=(
        "a model folder whose model or tokenizer needs its own code (`auto_map`, a type transformers lacks)"
    ),
    seen="refused by config validation, naming the key, the file and its model_type / tokenizer_class",
    steps_lost="none",
    data_lost="none",
)
def test_a_model_folder_that_needs_its_own_code_is_refused(tmp_path):
    code = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    remote = tiny_config(tmp_path / "remote", model_type="x_remote", auto_map=code)
    with pytest.raises(
        ConfigError, match=r"model.name_or_path: .*remote/config.json \(model_type 'x_remote'\)"
    ):
        validate(with_("model.name_or_path", remote), base_dir=REPO)
    tok = tiny_config(tmp_path / "tok")
    (tmp_path / "tok/tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "XTokenizer", "auto_map": {"AutoTokenizer": ["tok_x.XTokenizer", None]}}
        )
    )
    with pytest.raises(ConfigError, match=r"tok/tokenizer_config.json \(tokenizer_class 'XTokenizer'\)"):
        validate(with_("model.name_or_path", tok), base_dir=REPO)
    # a built-in type that still ships an auto_map (older uploads) loads without the folder's code
    builtin = tiny_config(tmp_path / "builtin", auto_map=code)
    (tmp_path / "builtin/tokenizer.json").write_text("{}")  # a folder the config check takes needs one
    assert validate(with_("model.name_or_path", builtin), base_dir=REPO)["model"]["name_or_path"] == builtin


def test_the_preference_section_is_off_by_default_and_filled_when_set():
    assert validate({})["preference"] is None and validate({"preference": None})["preference"] is None
    data = validate({"preference": {}})["preference"]["data"]
    assert data["sources"] == [{"path": "builtin:synthetic_pairs", "format": "alpaca", "split": "train"}]
    assert data["cutoff_len"] == 128 and data["invalid_rows"] == "fail"


@pytest.mark.parametrize(
    ("sources", "needle"),
    [
        ([{"path": "data/nope.jsonl"}], "preference.data.sources[0].path: dataset file not found"),
        (
            [{"path": "builtin:synthetic"}],
            "preference.data.sources[0].path: unknown builtin 'builtin:synthetic'",
        ),
        ([{"dataset_info": "x.json"}], "preference.data.sources[0].name: missing"),
        ([{"path": "a.jsonl", "name": "e"}], "preference.data.sources[0].name: only with dataset_info"),
    ],
)
def test_preference_sources_are_checked_naming_the_key(sources, needle):
    with pytest.raises(ConfigError) as err:
        validate({"preference": {"data": {"sources": sources}}}, base_dir=REPO)
    assert needle in str(err.value)


# YAML as a user writes it (.inf, .nan) over the demo config: values no schema bound stops (every
# comparison with NaN is false) or past a bound the schema sets.
OUT_OF_RANGE = [
    (
        "infinite epochs",
        "sft: {num_train_epochs: .inf}",
        "config key sft.num_train_epochs: inf is not a finite",
    ),
    ("NaN learning rate", "sft: {learning_rate: .nan}", "config key sft.learning_rate: nan is not a finite"),
    ("NaN tolerance", "nightly: {tolerance: .nan}", "config key nightly.tolerance: nan is not a finite"),
    (
        "NaN preference rate",
        "preference: {learning_rate: .NaN}",
        "config key preference.learning_rate: nan is not a finite",
    ),
    ("NaN in sft.extra", "sft: {extra: {max_grad_norm: .nan}}", "config key sft.extra.max_grad_norm: nan"),
    (
        "-inf benchmark drop",
        "nightly: {max_benchmark_drop: {arc_easy: -.inf}}",
        "config key nightly.max_benchmark_drop.arc_easy: -inf is not a finite",
    ),
    ("seed -5", "sft: {seed: -5}", "config key sft.seed: -5 is less than the minimum of 0"),
    ("seed past 2^32", "sft: {seed: 4294967296}", "config key sft.seed: 4294967296 is greater than"),
    (
        "max_new_tokens 10^12",
        "eval: {max_new_tokens: 1000000000000}",
        "config key eval.max_new_tokens: 1000000000000 is greater than the maximum of 131072",
    ),
    (
        "synthetic_rows 10^12",
        "data: {synthetic_rows: 1000000000000}",
        "config key data.synthetic_rows: 1000000000000 is greater than the maximum of 1000000",
    ),
    (
        "preference synthetic_rows 10^12",
        "preference: {data: {synthetic_rows: 1000000000000}}",
        "config key preference.data.synthetic_rows: 1000000000000 is greater than the maximum",
    ),
]


@pytest.mark.parametrize("name,text,needle", OUT_OF_RANGE, ids=[b[0] for b in OUT_OF_RANGE])
@pytest.mark.reliability(
    fault=(
        "`.inf` epochs, a NaN learning rate or tolerance (anywhere a number goes, `sft.extra` too), "
        "seed -5, `max_new_tokens` or `synthetic_rows` 10^12"
    ),
    seen="refused by the config check, naming the key: not a finite number, or the schema's bound",
    steps_lost="none",
    data_lost="none",
)
def test_infinite_nan_and_out_of_range_numbers_are_refused_naming_the_key(tmp_path, name, text, needle):
    """The config file as the workflow reads it (load_file: YAML, then the whole config check)."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(deep_merge(DEMO, yaml.safe_load(text))))
    with pytest.raises(ConfigError) as err:
        load_file(path)
    assert str(err.value).startswith(needle), str(err.value)
