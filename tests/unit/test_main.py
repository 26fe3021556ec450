"""The CLI (`python -m llmft`): help for every option, named errors for a bad config, check-config's
merge, and the planner on the demo config."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import yaml
from llmft.__main__ import build_parser, main
from llmft.core.config import load_schema, parse_config_args

REPO = Path(__file__).resolve().parents[2]


def _commands(parser: argparse.ArgumentParser, prefix=()):
    """(argv prefix, parser, help) of every subcommand, nested ones (sft check) included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield (*prefix, name), sub, helps.get(name)
                yield from _commands(sub, (*prefix, name))


def test_every_cli_option_and_command_has_help():
    missing = []
    for argv, sub, text in _commands(build_parser()):
        if not text:
            missing.append(" ".join(argv))
        for action in sub._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) and not action.help:
                missing.append(f"{' '.join(argv)} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing


def _config_commands() -> list[list[str]]:
    """Each subcommand that reads --config, with its required options given."""
    out = []
    for argv, sub, _ in _commands(build_parser()):
        opts = {s for a in sub._actions for s in a.option_strings}
        if "--config-json" in opts:
            required = [
                x for a in sub._actions if a.required and a.option_strings for x in (a.option_strings[0], "x")
            ]
            out.append([*argv, *required])
    return out


FAULTS = {
    "missing": ("--config", "{tmp}/nowhere.yaml", "nowhere.yaml: cannot read it"),
    "folder": ("--config", "{tmp}", "cannot read it"),
    "bad YAML": ("--config", "{tmp}/bad.yaml", "bad.yaml: not valid YAML"),
    "a list": ("--config", "{tmp}/list.yaml", "list.yaml: must be a mapping"),
    "bad JSON config": ("--config", "{tmp}/bad.json", "bad.json: not valid JSON"),
    "bad overrides": ("--overrides", "{{run: x", "--overrides: not valid JSON"),
    "bad config-json": ("--config-json", "[1, 2]", "--config-json: must be a JSON object"),
}


@pytest.mark.reliability(
    fault="a stage CLI (`python -m llmft <stage>`) given as `--config` a missing file, a folder, bad YAML "
    "or JSON, or a YAML list; `--overrides` / `--config-json` not a JSON object",
    seen="`llmft: config error:` naming the file or flag and why, exit 2, no traceback",
    steps_lost="none",
    data_lost="none",
)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_bad_or_missing_config_is_a_named_error_in_every_stage_cli(fault, tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("sft:\n  learning_rate: [1e-3\n")
    (tmp_path / "list.yaml").write_text("- run: x\n")
    (tmp_path / "bad.json").write_text('{"run": "x",}')
    flag, value, want = FAULTS[fault]
    commands = _config_commands()
    assert len(commands) >= 11, commands  # every stage, sft's three steps, plan
    if flag == "--config":
        commands.append(["nightly-schedule"])  # a config file only, as `nightly --config` takes
    for argv in commands:
        rc = main([*argv, flag, value.format(tmp=tmp_path)])  # an exception here is the traceback
        err = capsys.readouterr().err
        assert rc == 2 and "llmft: config error: " in err and want in err, (argv, err)


@pytest.mark.reliability(
    fault="`llmft check-config --config my.yaml`: a file where `snakemake --config` takes key=value",
    seen="exit 2, `llmft: config error:` saying a config file goes in --configfile",
    steps_lost="none",
    data_lost="none",
)
@pytest.mark.reliability(
    fault="`llmft check-config` on a config the workflow's DAG-time plan check refuses (more trainable "
    "layers than the model has)",
    seen="exit 2, the workflow's own message naming the key (`sft.freeze_trainable_layers`)",
    steps_lost="none",
    data_lost="none",
)
def test_check_config_prints_the_config_snakemake_runs(tmp_path, capsys):
    """config/config.yaml, then each --configfile, then --config key=value, as Snakemake merges them:
    the keys my.yaml leaves out are config/config.yaml's, not the schema's defaults."""
    (tmp_path / "config").mkdir()
    (tmp_path / "config/config.yaml").write_text((REPO / "config/config.yaml").read_text())
    (tmp_path / "my.yaml").write_text("sft:\n  learning_rate: 2.0e-4\n  num_train_epochs: 4.0\n")
    (tmp_path / "late.yaml").write_text("sft:\n  num_train_epochs: 2.0\n")
    base = yaml.safe_load((REPO / "config/config.yaml").read_text())
    schema_sft = load_schema()["properties"]["sft"]["properties"]
    assert base["sft"]["precision"] != schema_sft["precision"]["default"]  # else the test proves nothing

    argv = ["check-config", "-d", str(tmp_path), "--configfile", str(tmp_path / "my.yaml")]
    assert main([*argv, str(tmp_path / "late.yaml"), "--config", "run=try2", "eval={max_rows: 7}"]) == 2
    assert "eval.max_rows: '7' is text" in capsys.readouterr().err  # as the pipeline refuses it
    assert main([*argv, str(tmp_path / "late.yaml"), "--config", "run=try2"]) == 0
    out, err = capsys.readouterr()
    cfg = json.loads(out)
    assert (
        cfg["sft"]["learning_rate"] == 2.0e-4
        and cfg["sft"]["num_train_epochs"] == 2.0
        and cfg["run"] == "try2"
    )
    for key in ("precision", "zero_stage", "per_device_train_batch_size"):
        assert cfg["sft"][key] == base["sft"][key], key
    assert cfg["hardware"]["processes_per_node"] == base["hardware"]["processes_per_node"]
    assert "config/config.yaml, then " in err and "my.yaml, then " in err and "--config run=try2" in err
    assert cfg["model"]["template"] == "default"  # resolved from auto, as the workflow resolves it

    # the workflow's DAG-time plan check refuses it: so does check-config
    (tmp_path / "freeze.yaml").write_text("sft: {finetuning_type: freeze, freeze_trainable_layers: 9}\n")
    assert main(["check-config", "-d", str(tmp_path), "--configfile", str(tmp_path / "freeze.yaml")]) == 2
    assert "sft.freeze_trainable_layers: 9 but the model has 2 decoder layers" in capsys.readouterr().err

    assert main(["check-config", "-d", str(tmp_path), "--config", str(tmp_path / "my.yaml")]) == 2
    assert "a config file goes in --configfile" in capsys.readouterr().err


def test_config_values_are_read_as_snakemake_reads_them(monkeypatch):
    # importing snakemake.cli loads every executor plugin; an empty SLURM_CONF keeps Slurm's quick
    monkeypatch.setenv("SLURM_CONF", os.devnull)
    from snakemake.cli import parse_config

    entries = ["run=007", "lr=1e-4", "flag=True", "off=False", "name='quoted'", "empty=", "dotted=1.0.2",
               "nested={a: 1, b: [x]}", "sft={learning_rate: 0.1}", "sft={epochs: 2}"]  # fmt: skip
    assert parse_config_args(entries) == parse_config(entries)


def test_nightly_gates_with_the_config_its_snakemake_runs(tmp_path, monkeypatch):
    """`llmft nightly --config my.yaml` trains with my.yaml over config/config.yaml (snakemake's
    --configfile); its gate, skip and retention must read that config too."""
    import llmft.nightly.run

    seen = {}
    monkeypatch.setattr(
        llmft.nightly.run, "nightly", lambda cfg, *rest, **kw: seen.update(cfg=cfg, rest=rest, kw=kw) or 0
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config").mkdir()
    (tmp_path / "config/config.yaml").write_text((REPO / "config/config.yaml").read_text())
    (tmp_path / "my.yaml").write_text("nightly: {tolerance: 0.05}\n")
    assert main(["nightly", "--config", "my.yaml", "--run", "r", "--", "--dry-run"]) == 0
    assert seen["cfg"].nightly.tolerance == 0.05
    assert (
        seen["cfg"].sft.precision
        == yaml.safe_load((REPO / "config/config.yaml").read_text())["sft"]["precision"]
    )
    assert seen["rest"][-1] == ["--dry-run"] and seen["kw"]["configfile"] == "my.yaml"


def test_plan_runs_on_the_demo_config(capsys):
    """builtin:tiny has no folder before its rule builds it: the planner plans model.tiny's shape."""
    config = str(REPO / "config/config.yaml")
    assert main(["plan", "--config", config]) == 0
    assert "plan: ZeRO-" in capsys.readouterr().out
    assert main(["plan", "--config", config, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["platform"]["vendor"] == "cpu" and plan["zero_stage"] in (0, 1, 2, 3)
