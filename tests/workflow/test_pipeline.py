"""The whole DAG on the local executor with the tiny model: real LLaMA-Factory + DeepSpeed ZeRO-3.

One module-scoped run of the embedded default; later tests reuse its results.
"""

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import DEMO, make_workdir, rules_run, shared_run, snakemake

pytestmark = pytest.mark.workflow


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    # the embedded default as is (the suite's other pipelines skip the canary), built once per
    # session (test_benchmarks adds its benchmarks to a copy); this module's copy is its own
    built = shared_run("demo", **DEMO)
    return built.copy_to(tmp_path_factory.mktemp("demo")), built.log


def test_all_five_stages_ran_for_real(demo):
    work, log = demo
    ran = rules_run(log)
    for stage in ("verify_env", "prepare_data", "sft", "evaluate", "report"):
        assert stage in ran
    run = work / "results/demo"
    verify = json.loads((run / "env/verify.json").read_text())
    assert verify["ok"] and verify["nodes"][0]["packages"]["deepspeed"]
    # the numerics canary ran through the demo's kernels and matched the committed fp32 curve
    canary = verify["nodes"][0]["canary"]
    assert canary["ok"] and canary["path"]["precision"] == "fp32" and len(canary["run"]["losses"]) == 40
    assert "canary" in {f["check"] for f in verify["findings"] if f["ok"]}
    assert "Numerics canary" in (run / "report/index.html").read_text()
    # the stack fingerprint, measured on the node that trained: in verify.json, summary.json (its
    # lineage too) and the page's environment section
    stack, node = verify["stack"], verify["nodes"][0]
    assert stack["fingerprint"] == node["stack_fingerprint"] and stack["differs"] == []
    fp = stack["fingerprint"]
    assert (fp["build"], fp["torch"], fp["deepspeed"]) == (
        "cpu",
        node["torch_version"],
        node["packages"]["deepspeed"],
    )
    assert fp["torch_git"] and fp["gpu_model"] is None and fp["nccl"] is None
    report = json.loads((run / "report/summary.json").read_text())
    assert report["stack"]["hash"] == report["lineage"]["stack"] == stack["hash"]
    assert f"Software stack <code>{stack['hash']}</code>" in (run / "report/index.html").read_text()
    sft_log = (run / "logs/sft.log").read_text()
    # LLaMA-Factory under torchrun with 2 processes and DeepSpeed ZeRO-3
    assert "Initializing 2 distributed tasks" in sft_log
    assert re.search(r"stage\W+3", (run / "sft/deepspeed.json").read_text())
    # The stage that ran, from DeepSpeed's own output rather than the config we asked it for (its
    # INFO log, which would say so, is off): only ZeRO-3 partitions the weights, and then names each
    # rank's checkpoint file zero_pp_rank_<rank>_mp_rank_00_model_states.pt; stages 0-2 write one
    # mp_rank_00_model_states.pt.
    states = {p.name for p in (run / "work").glob("sft-*/checkpoint-*/global_step*/*model_states.pt")}
    assert states == {f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" for rank in (0, 1)}, states
    summary = json.loads((run / "sft/train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["final_loss"] < summary["first_loss"] / 3


def test_tuned_beats_base_on_heldout_exact_match(demo):
    work, _ = demo
    run = work / "results/demo"
    base = json.loads((run / "eval/base/metrics.json").read_text())
    tuned = json.loads((run / "eval/tuned/metrics.json").read_text())
    assert tuned["rows"] == base["rows"] > 100
    assert tuned["exact_match"] - base["exact_match"] >= 0.3
    assert tuned["eval_loss"] < base["eval_loss"]
    page = (run / "report/index.html").read_text()
    # the verdict line: "Tuned exact match 0.62 vs base ..." (three significant digits, 0.620 is 0.62)
    assert f"Tuned exact match {tuned['exact_match']:.3g} vs base" in page and "<svg" in page


def test_trained_model_loads_and_generates(demo):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = demo[0] / "results/demo/sft/model"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert all(p.numel() > 0 for p in model.parameters())  # ZeRO-3 gathered real weights
    prompt = tok("Human: What is the first word?\nowl cat\nAssistant:", return_tensors="pt")

    def first_word(m):
        out = m.generate(**prompt, max_new_tokens=4, do_sample=False)
        return tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True).split()[:1]

    # the trained answer, not just any tokens: the random-init base does not give it
    assert first_word(model) == ["owl"]
    assert first_word(AutoModelForCausalLM.from_pretrained(demo[0] / "results/demo/base_model")) != ["owl"]


def test_training_wrote_one_tensorboard_run_with_loss_and_learning_rate(demo):
    from tests.events import scalars, steps_per_file

    run = demo[0] / "results/demo"
    folders = [d for d in (run / "tracking/tensorboard").iterdir() if d.is_dir()]
    assert len(folders) == 1  # one run
    # one file holds the training curve (the held-out evaluation after training may open another):
    # two ranks writing would log every step twice
    assert [len(steps) > 0 for steps in steps_per_file(folders[0], "train/loss")].count(True) == 1
    tags = scalars(folders[0])
    history = json.loads((run / "sft/train_summary.json").read_text())["history"]
    logged = {h["step"]: h for h in history if "loss" in h}
    assert tags["train/loss"] and set(tags["train/loss"]) == set(logged)
    for step, value in tags["train/loss"].items():
        assert value == pytest.approx(logged[step]["loss"], rel=1e-5)
    assert set(tags["train/learning_rate"]) == set(logged) and "eval/loss" in tags


def test_page_flops_equal_the_benchs_count_for_the_same_run(demo):
    """The run page's FLOPs per token against bench/sft_bench.py's, from the run's own files: the
    bench re-measures each train row's length with its own tokenizer pass, the page uses
    prepare_data's statistics."""
    import yaml

    from bench.sft_bench import run_flops, token_lengths

    run = demo[0] / "results/demo"
    summary = json.loads((run / "report/summary.json").read_text())
    args = yaml.safe_load((run / "sft/llamafactory.yaml").read_text())
    lengths = token_lengths(run / "data", str(run / "base_model"))
    bench = run_flops(args, run / "base_model", lengths)
    assert summary["flops_per_token"] == pytest.approx(bench.total, rel=1e-3)
    assert summary["attention_span_tokens"] == pytest.approx(bench.span, rel=1e-3)
    page = (run / "report/index.html").read_text()
    assert "embedding lookup not counted" in page and f"{bench.total:.4g}" in page


def test_summary_has_one_throughput_figure_the_formula_over_the_logged_steps(demo):
    """summary.json's one throughput field, recomputed here from the run's own step log
    (llmft_steps.jsonl) and evaluation times: (T_b - T_a) / (t_b - t_a - E) / world size, over the
    last attempt's steps after its first quarter."""
    run = demo[0] / "results/demo"
    summary = json.loads((run / "report/summary.json").read_text())
    train = json.loads((run / "sft/train_summary.json").read_text())
    assert sorted(k for k in summary if "tokens_per_second" in k) == [
        "eval_new_tokens_per_second",  # generation at evaluation, not training
        "tokens_per_second_per_gpu",
    ]
    (steps_file,) = (run / "work").glob("sft-*/llmft_steps.jsonl")
    records = [json.loads(line) for line in steps_file.read_text().splitlines()]
    last_start = max(i for i, r in enumerate(records) if "attempt_start" in r)
    steps = [r for r in records[last_start:] if "time" in r and "step" in r]
    a, b = steps[len(steps) // 4], steps[-1]
    evals = [
        h["eval_runtime"]
        for h in train["history"]
        if "eval_runtime" in h and a["step"] <= h["step"] < b["step"]
    ]
    expected = (b["tokens"] - a["tokens"]) / (b["time"] - a["time"] - sum(evals)) / summary["world_size"]
    assert summary["tokens_per_second_per_gpu"] == pytest.approx(expected, abs=0.05)
    assert summary["tokens_per_second_per_gpu"] == train["tokens_per_second_per_gpu"]
    assert summary["throughput_steps"] == train["throughput_steps"] == [a["step"] + 1, b["step"]]
    assert f"here steps {a['step'] + 1}-{b['step']}" in (run / "report/index.html").read_text()


def test_evaluate_logs_progress_per_batch(demo):
    log = (demo[0] / "results/demo/logs/evaluate_tuned.log").read_text()
    lines = re.findall(r"generate batch (\d+)/(\d+)", log)
    assert lines and lines[-1][0] == lines[-1][1]  # every batch, to the last one
    assert re.search(r"loss batch \d+/\d+", log)


def test_tuned_model_has_the_structure_of_its_tied_base(demo):
    from llmft.core.modelfiles import safetensors_stats, structure_difference

    run = demo[0] / "results/demo"
    assert structure_difference(run / "sft/model", run / "base_model") == []
    assert safetensors_stats(run / "sft/model") == safetensors_stats(run / "base_model")
    summary = json.loads((run / "sft/train_summary.json").read_text())
    assert summary["model_files"]["checked"] and summary["model_files"]["dropped"] == []


def test_sft_trains_on_the_rows_prepare_data_tokenized(demo):
    from datasets import load_from_disk

    run = demo[0] / "results/demo"
    rendered = (run / "sft/llamafactory.yaml").read_text()
    assert rendered.count("tokenized_path: results/demo/data/tokenized") == 1
    sft_log = (run / "logs/sft.log").read_text()
    assert "Loaded tokenized dataset from results/demo/data/tokenized" in sft_log
    assert "Running tokenizer on dataset" not in sft_log  # the CPU stage did it, once
    stats = json.loads((run / "data/stats.json").read_text())
    tokenized = load_from_disk(str(run / "data/tokenized"))
    assert len(tokenized["train"]) == stats["train_rows"]
    assert len(tokenized["validation"]) == stats["heldout_rows"]


def test_second_run_with_nothing_changed_runs_no_job(demo):
    work, _ = demo
    proc = snakemake(work)
    assert proc.returncode == 0
    assert rules_run(proc.stderr + proc.stdout) == []
    assert "Nothing to be done" in proc.stderr + proc.stdout


def as_if_finished(work: Path) -> None:
    """Every output of the run present and recorded as made (`snakemake --touch`), no job run."""
    plan = snakemake(work, "-n", "--forceall")
    outputs = {o.strip() for line in re.findall(r"output: (.*)", plan.stdout) for o in line.split(",")}
    assert "results/demo/sft/model" in outputs, plan.stdout[-3000:]
    for out in outputs:
        path = work / out
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir() if Path(out).suffix == "" else path.write_text("")
    touched = snakemake(work, "--touch")
    assert touched.returncode == 0, touched.stderr[-3000:]


@pytest.mark.parametrize(
    "kind,promised", [("full", "sft/model"), ("lora", "sft/model"), ("lora", "sft/adapter")]
)
def test_a_missing_published_output_is_planned_again(tmp_path, kind, promised):
    """The DAG alone, in seconds: a promised output missing from a finished run makes sft (and what
    reads the model) run again, not "Nothing to be done"."""
    work = make_workdir(tmp_path, sft__finetuning_type=kind)
    as_if_finished(work)
    shutil.rmtree(work / "results/demo" / promised)
    plan = snakemake(work, "-n")
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert {"sft", "evaluate", "report"} <= set(re.findall(r"^rule (\w+):", plan.stdout, re.M)), plan.stdout


@pytest.mark.reliability(
    fault="the published model (sft/model) deleted after a finished run",
    seen="the rerun publishes it again from the finished training without training again, then "
    "evaluates it and rebuilds the page",
    steps_lost="none",
    data_lost="none",
)
def test_a_deleted_published_model_is_made_again(demo):
    work, _ = demo
    run = work / "results/demo"
    before = json.loads((run / "sft/train_summary.json").read_text())
    shutil.rmtree(run / "sft/model")
    proc = snakemake(work)
    log = proc.stderr + proc.stdout
    assert proc.returncode == 0, log[-3000:]
    assert {"sft", "evaluate", "report"} <= set(rules_run(log)) and "Nothing to be done" not in log
    assert (run / "sft/model/config.json").is_file() and list((run / "sft/model").glob("*.safetensors"))
    sft_log = (run / "logs/sft.log").read_text()
    assert "had finished: publishing it again, not training" in sft_log
    summary = json.loads((run / "sft/train_summary.json").read_text())
    assert summary["attempt"]["republished_without_training"]
    assert summary["steps"] == before["steps"] and summary["final_loss"] == before["final_loss"]


@pytest.mark.reliability(
    fault="a forced sft rerun (`snakemake -R sft`) that fails",
    seen="the run's page and summary.json are removed with the model they described, not left "
    "looking current; the next run makes the model and the page again",
    steps_lost="none",
    data_lost="none",
)
def test_a_failed_forced_sft_rerun_leaves_no_current_page(demo):
    work, _ = demo
    run = work / "results/demo"
    config = run / "sft/config.json"
    good = config.read_text()
    bad = json.loads(good)
    bad["sft"]["learning_rat"] = 1e-4  # the job's first step refuses it: sft fails
    config.write_text(json.dumps(bad))
    proc = snakemake(work, "-R", "sft")
    log = proc.stderr + proc.stdout
    assert proc.returncode != 0 and "sft" in rules_run(log), log[-3000:]
    # the failed job's own lines, as Snakemake prints its log (profile: show-failed-logs)
    assert "unknown key(s) ['learning_rat']" in log, log[-3000:]
    assert not (run / "sft/model").exists()
    assert not (run / "report/index.html").exists() and not (run / "report/summary.json").exists()
    config.write_text(good)
    proc = snakemake(work)
    log = proc.stderr + proc.stdout
    assert proc.returncode == 0, log[-3000:]
    assert {"sft", "report"} <= set(rules_run(log))
    assert (run / "sft/model/config.json").is_file() and (run / "report/index.html").is_file()


def test_training_param_change_reruns_only_downstream(demo):
    work, _ = demo
    make_workdir(work, **DEMO, sft__max_steps=30)
    proc = snakemake(work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = rules_run(proc.stderr + proc.stdout)
    # pack_data reruns for the re-rendered YAML (and finds nothing to pack: the demo does not pack);
    # the lineage for the tokens max_steps trains
    assert set(ran) == {"lineage", "render_sft_config", "pack_data", "sft", "evaluate", "report", "all"}
    assert ran.count("evaluate") == 1  # only the tuned model is re-evaluated
    summary = json.loads((work / "results/demo/sft/train_summary.json").read_text())
    assert summary["steps"] == 30


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ({"sft__learning_rat": 0.1}, "learning_rat"),
        ({"run": "bad name!"}, "config key run"),
        ({"data__sources": [{"path": "missing.jsonl"}]}, "dataset file not found"),
        ({"sft__lora_rank": 16}, "sft.lora_rank: 16 is only used with sft.finetuning_type: lora"),
        (
            {"sft__finetuning_type": "freeze", "sft__freeze_trainable_layers": 3},
            "sft.freeze_trainable_layers: 3 but the model has 2 decoder layers",
        ),
    ],
)
@pytest.mark.reliability(
    fault="a config typo, a bad run name, a missing dataset, a LoRA key without LoRA",
    seen="one line naming the config key, before any job; no traceback",
    steps_lost="none",
    data_lost="none",
)
def test_bad_config_stops_before_any_job(tmp_path, overrides, needle):
    work = make_workdir(tmp_path, **overrides)
    proc = snakemake(work)
    assert proc.returncode != 0
    assert needle in proc.stderr
    # the message alone, first: no Snakemake file/line/trace around it
    assert (
        proc.stderr.strip().splitlines()[-1].startswith("llmft config error:")
        and "Traceback" not in proc.stderr
    )
    assert rules_run(proc.stderr + proc.stdout) == []
    assert not (work / "results").exists()
