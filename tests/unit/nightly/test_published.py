"""A published run as `llmft promote` and model.continue_from trust it: its folders sealed by content
when published, and the promote command's words."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from llmft.core.io import write_json
from llmft.core.lineage import published_problems, run_problems
from llmft.core.modelfiles import SEAL, seal_folder, seal_problems
from llmft.nightly.promote import GATE_WHY, record, set_current
from safetensors.numpy import save_file


def finished_run(results, name, lora=False):
    """A run folder as sft and report leave it: summary.json, a sealed sft/model (real safetensors,
    config.json, tokenizer.json) and, for LoRA, a sealed sft/adapter."""
    run = results / name
    model = run / "sft" / "model"
    model.mkdir(parents=True)
    save_file(
        {"model.embed_tokens.weight": np.arange(4096, dtype=np.float32)}, str(model / "model.safetensors")
    )
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (model / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    seal_folder(model)
    summary = {"seal": SEAL, "adapter": None}
    if lora:
        adapter = run / "sft" / "adapter"
        adapter.mkdir()
        save_file({"lora_A": np.ones(64, dtype=np.float32)}, str(adapter / "adapter_model.safetensors"))
        (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "base", "r": 8}))
        seal_folder(adapter)
        summary["adapter"] = {"path": str(adapter)}
    write_json(run / "sft" / "train_summary.json", summary)
    write_json(run / "report" / "summary.json", {"run": name, "tuned": {"exact_match": 0.5}})
    return run


def flip_one_byte(path, at=-1):
    """Corrupt a file in place at the same size, and give it back its old modification time."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size


def test_a_published_model_changed_in_place_at_the_same_size_is_named(tmp_path):
    run = finished_run(tmp_path, "a")
    model = run / "sft" / "model"
    assert run_problems(run) == [] and published_problems(run) == []
    cache = model.with_name("model.verified.json")
    assert set(json.loads(cache.read_text())["files"]) == {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
    }
    flip_one_byte(model / "model.safetensors")
    [problem] = run_problems(run)  # the header still reads whole: only the seal sees it
    assert (
        problem
        == f"{model / 'model.safetensors'} no longer has the content sealed when published (changed in place)"
    )
    assert published_problems(run) == [problem]


def test_the_seal_is_read_again_only_for_files_that_changed(tmp_path):
    model = finished_run(tmp_path, "a") / "sft" / "model"
    assert seal_problems(model) == []
    # a cache that vouches for a changed file does not hide it: its size, times or inode moved
    cache = model.with_name("model.verified.json")
    before = json.loads(cache.read_text())
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 65}))
    assert seal_problems(model) == [
        f"{model / 'config.json'} no longer has the content sealed when published (changed in place)"
    ]
    assert "config.json" not in json.loads(cache.read_text())["files"]
    assert json.loads(cache.read_text())["files"]["model.safetensors"] == before["files"]["model.safetensors"]
    (model / "tokenizer.json").unlink()
    assert f"{model / 'tokenizer.json'} is missing (sealed when the folder was published)" in seal_problems(
        model
    )


def test_a_published_folder_that_lost_its_seal_is_named(tmp_path):
    run = finished_run(tmp_path, "a")
    (run / "sft" / "model" / SEAL).unlink()
    assert published_problems(run) == [
        f"{run / 'sft' / 'model' / SEAL} is missing: the folder was changed since it was published"
    ]


def test_an_edited_adapter_config_is_refused_by_name(tmp_path):
    """adapter_config.json names the folder PEFT reads a base config from: an edit is refused, named."""
    run = finished_run(tmp_path, "a", lora=True)
    assert run_problems(run) == []
    path = run / "sft" / "adapter" / "adapter_config.json"
    path.write_text(json.dumps({"base_model_name_or_path": "/tmp", "r": 8}))  # the same size
    assert run_problems(run) == [f"{path} no longer has the content sealed when published (changed in place)"]


def llmft(results, *args):
    return subprocess.run(
        [sys.executable, "-m", "llmft", *args, "--results", str(results)], capture_output=True, text=True
    )


def test_promote_refuses_a_corrupt_published_model_by_file(tmp_path):
    run = finished_run(tmp_path, "a")
    flip_one_byte(run / "sft" / "model" / "model.safetensors", at=-5)
    proc = llmft(tmp_path, "promote", "a")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("llmft promote a: run a is not a finished run: ")
    assert "model.safetensors no longer has the content sealed when published" in proc.stderr
    assert not (tmp_path / "current").exists()


@pytest.mark.parametrize("by_gate", [True, False])
def test_promoting_the_promoted_run_says_who_promoted_it_once(tmp_path, by_gate):
    finished_run(tmp_path, "night1")
    if by_gate:  # what the first night's gate does (nightly.run._judge)
        reason = "first promoted model (exact_match 0.5000)"
        set_current(tmp_path, "night1", reason)
        state = {"nights": [], "promoted": None}
        record(state, "promote", None, "night1", GATE_WHY + reason)
        write_json(tmp_path / "nightly" / "state.json", state)
    else:
        assert llmft(tmp_path, "promote", "night1", "--why", "looks good").returncode == 0
    proc = llmft(tmp_path, "promote", "night1")
    assert proc.returncode == 2, proc.stderr
    line = "llmft promote night1: run night1 is already the promoted model: "
    assert proc.stderr.startswith(line) and proc.stderr.count("llmft") == 1  # no `llmft: ` before the command
    if by_gate:
        assert proc.stderr == line + f"the nightly gate promoted it ({reason}); nothing to do\n"
    else:
        assert "@" in proc.stderr and "(looks good); nothing to do" in proc.stderr


def test_a_rollback_shows_on_the_runs_pages_and_the_trend(tmp_path):
    """night1 then night2 promoted by the gate, each page saying so; `llmft rollback` rewrites
    night2's promotion.json, summary.json and page line to "rolled back", and results/trend.html."""
    from llmft.report.page import promotion_html

    state = {"nights": [], "promoted": None}
    for old, run in ((None, "night1"), ("night1", "night2")):
        finished_run(tmp_path, run)
        verdict = {"run": run, "status": "promoted", "reason": f"first or better than {old}"}
        write_json(tmp_path / run / "promotion.json", verdict)
        (tmp_path / run / "report" / "index.html").write_text(
            f"<h1>{run}</h1>\n{promotion_html(verdict)}\n<p>the rest</p>\n"
        )
        set_current(tmp_path, run, verdict["reason"])
        record(state, "promote", old, run, GATE_WHY + verdict["reason"])
    write_json(tmp_path / "nightly" / "state.json", state)
    proc = llmft(tmp_path, "rollback", "--why", "night2 answers in French")
    assert proc.returncode == 0, proc.stderr
    assert os.readlink(tmp_path / "current") == "night1"
    promotion = json.loads((tmp_path / "night2" / "promotion.json").read_text())
    assert promotion["status"] == "rolled back"
    assert promotion["reason"].startswith("results/current rolled back from here to night1 by hand (")
    assert promotion["reason"].endswith("): night2 answers in French")
    assert promotion["gate"] == {"status": "promoted", "reason": "first or better than night1"}
    summary = json.loads((tmp_path / "night2" / "report" / "summary.json").read_text())
    assert summary["promotion"] == {"status": "rolled back", "reason": promotion["reason"]}
    page = (tmp_path / "night2" / "report" / "index.html").read_text()
    assert "Nightly promotion: <b>rolled back</b>" in page and "<b>promoted</b>" not in page
    assert page.startswith("<h1>night2</h1>") and page.endswith("<p>the rest</p>\n")
    back = (tmp_path / "night1" / "report" / "index.html").read_text()
    assert "Nightly promotion: <b>promoted</b> (results/current rolled back here from night2 by hand" in back
    trend = (tmp_path / "trend.html").read_text()
    assert "rolled back: results/current rolled back from here to night1" in trend


def test_finalize_publishes_a_sealed_model(tmp_path):
    """sft's publish step on a real model folder (a tiny Llama, saved as training saves it): the
    published folder carries the seal, train_summary.json says so, and a byte flipped afterwards
    is named."""
    import shutil

    import yaml
    from llmft.core.assets import build_tiny_model
    from llmft.core.platform import Platform
    from llmft.sft.publish import finalize

    base, work, run = tmp_path / "base", tmp_path / "work", tmp_path / "results" / "r"
    build_tiny_model(base, hidden_size=32, num_layers=1, num_heads=2, vocab_size=512)
    shutil.copytree(base, work)
    platform = Platform("cpu", 1, 0, 1, "", 1.0, "", "", (), False, 1.0, "test")
    args = {
        "model_name_or_path": str(base),
        "output_dir": str(work),
        "finetuning_type": "full",
        "template": "default",
        "llmft": {"platform": platform.to_json()},
    }
    (tmp_path / "llamafactory.yaml").write_text(yaml.safe_dump(args))
    model = run / "sft" / "model"
    summary = finalize(
        str(tmp_path / "llamafactory.yaml"), str(model), str(run / "sft" / "train_summary.json")
    )
    assert summary["seal"] == SEAL
    sealed = json.loads((model / SEAL).read_text())["files"]
    assert set(sealed) == {p.name for p in model.iterdir()} - {SEAL}
    assert "model.safetensors" in sealed and published_problems(run) == []
    flip_one_byte(model / "model.safetensors")
    assert published_problems(run) == [
        f"{model / 'model.safetensors'} no longer has the content sealed when published (changed in place)"
    ]


def test_snakemake_refuses_to_build_on_a_published_model_changed_in_place(tmp_path):
    """At DAG time, before any job: the run's own published model (its scores and page would describe
    other weights) and a parent named by model.continue_from, each naming the file."""
    from tests.conftest import BIN, REPO, make_workdir, snakemake_env

    work = make_workdir(tmp_path / "w")
    run = finished_run(work / "results", "c")
    for name in ("sft/llamafactory.yaml", "data/train.jsonl", "data/stats.json"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("{}\n")
    weights = run / "sft" / "model" / "model.safetensors"
    flip_one_byte(weights)
    needle = "results/c/sft/model/model.safetensors no longer has the content sealed when published"
    for config in (["run=c"], ["run=d"]):
        if config == ["run=d"]:
            make_workdir(work, model__continue_from="results/c")
        proc = subprocess.run(
            [str(BIN / "snakemake"), "-n", "-s", str(REPO / "Snakefile"), "--config", *config],
            cwd=work, env=snakemake_env("local"), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode != 0 and needle in proc.stderr, proc.stderr[-3000:]
        assert "llmft config error" in proc.stderr and "Traceback" not in proc.stderr
