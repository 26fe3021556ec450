"""Standard benchmarks (eval.benchmarks, lm-eval-harness) base vs tuned: the jobs, the refusals
before any job, and the two project tasks under tests/bench_tasks run on the demo's tiny model."""

import json
import math
import re
import subprocess
from importlib.metadata import version

import pytest
import yaml
from llmft.core.assets import CATEGORIES, CATEGORY_TEMPLATES, WORDS

from tests.conftest import (
    BIN,
    DEMO,
    REPO,
    make_workdir,
    place_verify,
    rules_run,
    shared_run,
    shell_commands,
    snakemake,
    snakemake_env,
)

pytestmark = pytest.mark.workflow

TASKS = str(REPO / "tests" / "bench_tasks")
OURS = [{"task": "llmft_category"}, {"task": "llmft_first_word"}]


def test_no_benchmarks_no_jobs_and_evaluate_never_sees_the_keys(tmp_path):
    plain = snakemake(make_workdir(tmp_path / "plain"), "-n", "-p")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "benchmarks" not in rules_run(plain.stdout + plain.stderr)
    with_bench = snakemake(
        make_workdir(tmp_path / "bench", eval__benchmarks=OURS, eval__benchmark_include_path=[TASKS]),
        "-n",
        "-p",
    )
    assert with_bench.returncode == 0, with_bench.stderr[-3000:]
    # a benchmark added reruns neither evaluate nor training: same commands; without benchmarks no
    # stage's command names them (the DAG is as before the key existed)
    for rule in ("evaluate", "sft"):
        assert shell_commands(plain, rule) == shell_commands(with_bench, rule) != []
    for rule in ("evaluate", "report", "sft", "prepare_data"):
        assert all("benchmark" not in cmd for cmd in shell_commands(plain, rule))
    assert '"benchmarks": [{' in shell_commands(with_bench, "report")[0]
    bench = shell_commands(with_bench, "benchmarks")
    assert len(bench) == 2 and all(
        cmd.startswith("HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 python -m llmft bench") for cmd in bench
    )
    assert {re.search(r"--out (\S+)", c).group(1) for c in bench} == {
        "results/demo/benchmarks/base/scores.json",
        "results/demo/benchmarks/tuned/scores.json",
    }


def _refused(proc, *needles):
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("llmft config error: config key eval.benchmarks[0].task"), proc.stderr[-2000:]
    for needle in needles:
        assert needle in last
    assert "Traceback" not in proc.stderr and rules_run(proc.stderr + proc.stdout) == []


@pytest.mark.reliability(
    fault="an lm-eval task name with a typo in eval.benchmarks (`arc_eazy`)",
    seen="refused before any job (`snakemake -n` too), naming the key, the task and its close matches",
    steps_lost="none",
    data_lost="none",
)
def test_an_unknown_task_is_refused_with_close_matches(tmp_path):
    work = make_workdir(tmp_path, eval__benchmarks=[{"task": "arc_eazy"}])
    _refused(snakemake(work, "-n"), "no task 'arc_eazy'", "did you mean", "arc_easy")


@pytest.mark.reliability(
    fault="a benchmark whose data is not on this (offline) machine: `arc_easy` with an empty datasets cache",
    seen="refused before any job (`snakemake -n` too), naming the task, its dataset and the cache folder",
    steps_lost="none",
    data_lost="none",
)
def test_a_task_whose_data_is_missing_offline_is_refused_with_the_cache_path(tmp_path):
    cache = tmp_path / "hf datasets"
    cache.mkdir()
    work = make_workdir(
        tmp_path / "w", eval__benchmarks=[{"task": "arc_easy"}], eval__benchmark_data_cache=str(cache)
    )
    _refused(snakemake(work, "-n"), "task 'arc_easy' cannot run offline", "allenai/ai2_arc", str(cache))


@pytest.fixture(scope="module")
def benched(tmp_path_factory):
    """The demo pipeline with the two project tasks as benchmarks: the tiny model is trained on the
    demo's word tasks, which teach both (the category of a word, the first word of a list). A copy
    of the session's trained demo (test_pipeline's): the benchmarks change no stage before them, so
    only the two benchmark jobs and the report run here."""
    built = shared_run("demo", **DEMO)
    work = built.copy_to(tmp_path_factory.mktemp("bench"), eval__benchmarks=OURS,
                         eval__benchmark_include_path=[TASKS])  # fmt: skip
    proc = snakemake(work, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(set(rules_run(proc.stdout + proc.stderr))) == ["all", "benchmarks", "report"]
    return work


def _scores(work, which: str, run: str = "demo") -> dict:
    return json.loads((work / f"results/{run}/benchmarks/{which}/scores.json").read_text())


def test_the_tuned_model_scores_higher_on_both_tasks(benched):
    base, tuned = _scores(benched, "base"), _scores(benched, "tuned")
    assert base["lm_eval"] == tuned["lm_eval"] == version("lm_eval")
    assert base["dtype"] == "float32" and base["reused_from"] is None
    for task, metric in (("llmft_category", "acc"), ("llmft_first_word", "first_word")):
        b, t = base["tasks"][task], tuned["tasks"][task]
        assert b["samples"] == t["samples"] == 40
        # beyond lm-eval's own noise: two standard errors of the difference
        noise = 2 * math.hypot(b["stderr"][metric], t["stderr"][metric])
        assert t["metrics"][metric] - b["metrics"][metric] > max(noise, 0.3), (task, b, t)
    # on the page and in summary.json: both tasks, lm-eval's stderr, and a verdict naming no task
    summary = json.loads((benched / "results/demo/report/summary.json").read_text())["benchmarks"]
    assert summary["regressed"] == [] and summary["verdict"].startswith("no benchmark regressed")
    row = summary["tasks"]["llmft_category"]
    assert row["base"] == base["tasks"]["llmft_category"]["metrics"]["acc"]
    assert row["tuned_stderr"] == tuned["tasks"]["llmft_category"]["stderr"]["acc"] > 0
    page = (benched / "results/demo/report/index.html").read_text()
    assert (
        "Standard benchmarks: base vs tuned" in page
        and f"{row['tuned']:.4f} ± {row['tuned_stderr']:.4f}" in page
    )


def test_another_run_with_the_same_base_model_reuses_its_scores(benched):
    target = "results/second/benchmarks/base/scores.json"
    proc = snakemake(benched, target, "--config", "run=second")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(rules_run(proc.stderr + proc.stdout)) == {"base_model", "benchmarks"}
    again, first = _scores(benched, "base", "second"), _scores(benched, "base")
    assert again["reused_from"] and again["key"] == first["key"] and again["tasks"] == first["tasks"]
    assert "reusing" in (benched / "results/second/logs/benchmarks_base.log").read_text()


def _broken_rows() -> list[dict]:
    """Category rows in the demo's three phrasings (the benchmark's among them), each word answered
    with the next category (an apple is a color): a model trained on them learns a wrong answer to
    every llmft_category question it saw."""
    names = list(CATEGORIES)
    wrong = {w: names[(names.index(c) + 1) % len(names)] for c, ws in CATEGORIES.items() for w in ws}
    return [
        {"instruction": t.format(w=w), "input": "", "output": wrong[w]}
        for w in WORDS
        for t in CATEGORY_TEMPLATES
    ]


def _nightly(work, run: str, config: str) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "python"), "-m", "llmft", "nightly", "--run", run, "--config", config]
    cmd += ["--profile", str(REPO / "profiles" / "local"), "--", "-s", str(REPO / "Snakefile")]
    return subprocess.run(cmd, cwd=work, env=snakemake_env(), capture_output=True, text=True, timeout=1500)


@pytest.mark.reliability(
    fault="a nightly retrain whose tuned model was trained on data that teaches a benchmark task's "
    "wrong answers (every llmft_category word labelled with another category)",
    seen="the nightly gate rejects the night naming the task, its score against the promoted run's, "
    "the drop and the budget (nightly.max_benchmark_drop); results/current still points at the "
    "promoted run",
    steps_lost="none: the night's run stays on disk, judged and rejected",
    data_lost="none",
)
def test_the_nightly_gate_refuses_a_model_trained_to_break_a_task(benched):
    """Night 1 is the trained demo (promoted); night 2 trains the same base on wrong categories. The
    held-out gate is opened wide (tolerance 1.0) so that the benchmark budget is what decides."""
    first = _nightly(benched, "demo", "config/config.yaml")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert (benched / "results/current").resolve().name == "demo"
    rows = benched / "data" / "broken.jsonl"
    rows.parent.mkdir(exist_ok=True)
    rows.write_text("".join(json.dumps(r) + "\n" for r in _broken_rows()))
    budget = 0.1
    night = {
        "data": {"sources": [{"path": "data/broken.jsonl", "format": "alpaca", "weight": 1.0}]},
        # ~20 s of training on 2 CPU processes: the 210 rows seen ~23 times each (the loss is ~0.1
        # by step 100: the wrong answers are learned)
        "sft": {"max_steps": 150, "save_steps": 150, "logging_steps": 50},
        "eval": {"max_rows": 24},
        "nightly": {"tolerance": 1.0, "max_benchmark_drop": {"llmft_category": budget}},
    }
    (benched / "config" / "broken.yaml").write_text(yaml.safe_dump(night))
    # the same machine as the demo's: its verify_env report serves this night (nothing here asserts
    # on verify_env; test_pipeline's demo runs it for real)
    place_verify(benched / "results/demo/env/verify.json", benched, "broken")
    second = _nightly(benched, "broken", "config/broken.yaml")
    log = benched / "results/nightly/broken.log"
    assert second.returncode == 0, second.stderr[-2000:] + (log.read_text()[-4000:] if log.exists() else "")
    # the scores this run computed: the training broke the task (below its own base model) ...
    base, tuned, promoted = (
        _scores(benched, w, r) for w, r in (("base", "broken"), ("tuned", "broken"), ("tuned", "demo"))
    )
    acc = {
        k: s["tasks"]["llmft_category"]["metrics"]["acc"]
        for k, s in (("base", base), ("tuned", tuned), ("promoted", promoted))
    }
    assert acc["tuned"] < acc["base"], acc
    drop = acc["promoted"] - acc["tuned"]
    assert drop > budget, acc
    # ... and the gate says so, naming the task, both scores, the drop and the budget
    verdict = json.loads((benched / "results/broken/promotion.json").read_text())
    assert verdict["status"] == "rejected", verdict
    assert verdict["reason"].startswith("rejected: benchmark forgetting (run demo)"), verdict
    assert (
        f"llmft_category acc {acc['tuned']:.4f} vs current {acc['promoted']:.4f}: "
        f"dropped {drop:.4f}, budget {budget}" in verdict["reason"]
    ), verdict
    assert (benched / "results/current").resolve().name == "demo"
    assert json.loads((benched / "results/current.json").read_text())["run"] == "demo"
