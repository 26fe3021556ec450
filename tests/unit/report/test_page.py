"""Evaluation batching/sharding and the report's pure parts: throughput, MFU, data stats, trend."""

import json

import pytest
from llmft.core import flops
from llmft.core.config import validate
from llmft.core.draw import svg_lines
from llmft.core.modelfiles import safetensors_stats
from llmft.core.platform import Platform
from llmft.core.settings import Config
from llmft.evaluate.worker import plan_batches, shard
from llmft.report.page import data_rows, peak_flops, pick_samples, throughput_series
from llmft.report.trend import collect_runs

# the config of the minimal runs below (run r, the rest defaults)
RUN_R = Config.from_dict(validate({"run": "r"}))


@pytest.mark.parametrize("n_rows,batch", [(1, 4), (10, 3), (263, 64), (50, 1)])
def test_batch_plan_covers_every_row_once_longest_first(n_rows, batch):
    lengths = [(i * 7919) % 37 + 1 for i in range(n_rows)]
    plan = plan_batches(lengths, batch)
    flat = [i for b in plan for i in b]
    assert sorted(flat) == list(range(n_rows))
    assert all(len(b) <= batch for b in plan)
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)


@pytest.mark.parametrize("processes", [1, 2, 3, 8])
def test_shards_partition_the_plan_and_keep_batches_whole(processes):
    plan = plan_batches([5, 1, 9, 3, 3, 7, 2, 8, 6, 4, 1], 2)
    shards = [shard(plan, processes, k) for k in range(processes)]
    # Each batch goes to exactly one process unchanged: its greedy output cannot depend on how
    # many processes (GPUs) the job has.
    assert sorted(map(tuple, (b for s in shards for b in s))) == sorted(map(tuple, plan))


def test_safetensors_stats_counts_without_loading(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file(
        {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}, str(tmp_path / "m.safetensors")
    )
    stats = safetensors_stats(tmp_path)
    assert stats == {"n_params": 17, "weight_bytes": 12 * 4 + 5 * 2, "dtypes": ["BF16", "F32"]}


def test_throughput_is_per_interval_and_per_gpu_without_eval_time():
    history = [
        {"step": 10, "loss": 3.0, "num_input_tokens_seen": 8000, "train_runtime": 2.0},
        {"step": 20, "loss": 2.0, "num_input_tokens_seen": 24000, "train_runtime": 4.0},
        {"step": 20, "eval_loss": 2.1, "eval_runtime": 1.0, "num_input_tokens_seen": 24000},
        {"step": 30, "loss": 1.5, "num_input_tokens_seen": 28000, "train_runtime": 7.0},
    ]
    # Steps 20-30 took 3 s of which 1 s was the held-out evaluation after step 20.
    assert throughput_series(history, world=2) == [(10, 2000.0), (20, 4000.0), (30, 1000.0)]


def test_mfu_is_the_gpu_peak_against_flops_per_token():
    h200 = validate({"hardware": {"gpus_per_node": 1, "gpu_model": "h200"}})
    peak, note = peak_flops(Platform.declared(Config.from_dict(h200)))
    assert peak == 989.0 and "H200" in note
    # 1.24 B at 5 131 tokens/s/GPU and 6 x 1.24e9 FLOPs per token: 3.86 %
    assert flops.mfu(5131, 6 * 1.24e9, peak) == pytest.approx(0.0386, abs=5e-4)
    assert peak_flops(Platform.declared(Config.from_dict(validate({}))))[0] is None  # CPU: n/a
    assert peak_flops(None)[0] is None  # a run rendered before the platform was recorded


def test_data_rows_show_unknown_numeric_keys_generically():
    stats = {
        "rows_read": 10,
        "invalid": 1,
        "near_duplicates": 3,
        "decontamination": {"ngram_hits": 2, "benchmarks": ["gsm8k"], "by_set": {"mmlu": 1}},
        "length_histogram": {"edges": [0, 4], "counts": [1]},
        "invalid_examples": ["x row 3: field 'output' is missing"],
        "note": "text is not a count",
    }
    rows = dict(map(tuple, data_rows(stats)))
    assert rows["rows_read"] == 10 and rows["near_duplicates"] == 3
    assert rows["decontamination.ngram_hits"] == 2 and rows["decontamination.by_set.mmlu"] == 1
    assert "note" not in rows and "length_histogram" not in rows and "decontamination.benchmarks" not in rows


def test_samples_side_by_side_a_few_per_task():
    tuned = [
        {
            "index": i,
            "task": t,
            "prompt": f"p{i}",
            "reference": "r",
            "prediction": f"t{i}",
            "exact_match": i % 2,
        }
        for i, t in enumerate(["a"] * 8 + ["b"] * 2)
    ]
    base = [{"index": i, "prediction": f"b{i}"} for i in range(10)]
    rows = pick_samples(base, tuned, per_task=3)
    assert [r[0] for r in rows] == ["a", "a", "a", "b", "b"]
    assert rows[3][3:5] == ["b8", "t8"]  # base and tuned output of the same row


def test_trend_reads_optional_promotion_keys(tmp_path):
    def put(run, summary, promotion=None):
        (tmp_path / run / "report").mkdir(parents=True)
        (tmp_path / run / "report/summary.json").write_text(json.dumps({"run": run, **summary}))
        if promotion is not None:
            (tmp_path / run / "promotion.json").write_text(json.dumps(promotion))

    put("a", {"generated": "2026-01-01", "tuned": {"exact_match": 0.5}})
    put("b", {"generated": "2026-01-02", "promotion": "promoted"})
    put("c", {"generated": "2026-01-03", "promotion": {"status": "rejected", "reason": "worse"}})
    put("d", {"generated": "2026-01-04"}, promotion={"status": "promoted", "reason": "first model"})
    (tmp_path / "nightly").mkdir()  # state folders without a report are not runs
    (tmp_path / "e" / "report").mkdir(parents=True)
    (tmp_path / "e" / "report/summary.json").write_text("{truncated")
    runs = collect_runs(tmp_path)
    assert [r["run"] for r in runs] == ["a", "b", "c", "d"]
    assert [r["_promotion"] for r in runs] == ["", "promoted", "rejected: worse", "promoted: first model"]


def test_charts_escape_names_and_mark_empty_ones():
    evil = "<script>alert(1)</script>"
    chart = svg_lines({evil: [(0, 1.0), (1, 2.0)]}, evil, evil)
    assert "<script>" not in chart and "&lt;script&gt;" in chart
    empty = svg_lines({"mfu": []}, "MFU", "step", na="n/a on CPU")
    assert "class='chart na'" in empty and "n/a on CPU" in empty


def test_token_budget_caps_padded_tokens_per_batch():
    lengths = [100, 90, 80, 10, 10, 10, 10, 10, 500]
    plan = plan_batches(lengths, batch_size=4, max_tokens=200)
    assert plan[0] == [8]  # longer than the budget alone: a batch of its own
    assert all(len(b) * lengths[b[0]] <= 200 for b in plan[1:])
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))


@pytest.mark.parametrize("keep_logits", [True, False])
def test_answer_nll_matches_each_row_scored_alone(keep_logits):
    """Left padding, explicit positions and kept logits change nothing: each row's answer NLL
    equals that of the row run alone, unpadded, with full logits."""
    import torch
    from llmft.evaluate.worker import answer_nll
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    model = LlamaForCausalLM(cfg).eval()
    rows = [([5, 6, 7, 8, 9], [10, 11]), ([12], [13, 14, 15, 16]), ([17, 18, 19], [20])]
    with torch.inference_mode():
        got = answer_nll(model, rows, pad_id=0, device="cpu", keep_logits=keep_logits)
        for (p, a), (nll, count) in zip(rows, got, strict=True):
            logits = model(input_ids=torch.tensor([p + a])).logits[0]
            ref = torch.nn.functional.cross_entropy(logits[len(p) - 1 : -1], torch.tensor(a), reduction="sum")
            assert count == len(a)
            assert nll == pytest.approx(float(ref), rel=1e-4)


@pytest.mark.parametrize(
    "row",
    [
        {"instruction": "Add", "input": "1 2", "output": "3"},
        {"instruction": "", "input": "only input", "output": "x"},
        {"instruction": "no input", "input": "", "output": "y"},
        {
            "instruction": "and now?",
            "input": "",
            "output": "z",
            "system": "You are terse.",
            "history": [["hi", "hello"], ["how are you", "fine"]],
        },
    ],
)
def test_conversation_is_the_one_llamafactory_builds(row):
    """Our messages and system prompt equal LLaMA-Factory's alpaca converter's, turn by turn."""
    from llamafactory.data.converter import AlpacaDatasetConverter
    from llamafactory.data.parser import DatasetAttr
    from llamafactory.hparams import DataArguments
    from llmft.evaluate.run import messages

    attr = DatasetAttr("file", dataset_name="heldout", system="system", history="history")
    converted = AlpacaDatasetConverter(attr, DataArguments())({"system": None, "history": None, **row})
    assert messages(row) == converted["_prompt"] + converted["_response"]
    assert (row.get("system") or None) == (converted["_system"] or None)


def test_loss_batches_spread_by_padded_size():
    """One long batch and many short ones: the process that draws the long batch gets few others."""
    lengths = [1000] * 4 + [100] * 40
    plan = plan_batches(lengths, batch_size=8, max_tokens=4000)
    shards = [shard(plan, 2, k, cost=lengths) for k in range(2)]
    assert sorted(map(tuple, (b for s in shards for b in s))) == sorted(map(tuple, plan))
    work = [sum(len(b) * max(lengths[i] for i in b) for b in s) for s in shards]
    assert max(work) <= 1.25 * min(work), work
    # every n-th batch would give one process all the long rows' work and more
    rr = [sum(len(b) * max(lengths[i] for i in b) for b in plan[k::2]) for k in range(2)]
    assert max(rr) > max(work)


def test_the_verdict_shows_the_data_behind_it_and_warns_when_it_is_thin():
    from llmft.report.page import data_loss_line, verdict_caution

    stats = {"rows_read": 999, "too_long": 961, "invalid": 0, "duplicates": 2}
    assert data_loss_line(stats) == "Data: 963 of 999 rows read dropped (96.4%: 961 too long, 2 duplicates)."
    caution = verdict_caution(stats, 4)
    assert "only 4 held-out rows" in caution and "96% of the rows were dropped" in caution
    assert verdict_caution({"rows_read": 3000, "duplicates": 416}, 263) == ""


def _minimal_run(tmp_path, train: dict):
    """The inputs a run page needs (the others are optional), with this train_summary.json."""
    (tmp_path / "sft").mkdir()
    (tmp_path / "eval/tuned").mkdir(parents=True)
    (tmp_path / "eval/tuned/metrics.json").write_text(json.dumps({"rows": 2, "exact_match": 0.5}))
    (tmp_path / "eval/tuned/predictions.jsonl").write_text("")
    (tmp_path / "sft/train_summary.json").write_text(json.dumps(train))
    write_lineage(tmp_path)
    return tmp_path


def write_lineage(run, run_name: str = "r"):
    """The run's lineage.json as the lineage rule writes it, from the run's verify.json (its stack)."""
    from llmft.core.lineage_record import make

    make(
        Config.from_dict(validate({"run": run_name})),
        "m",
        run / "data",
        run / "env/verify.json",
        {},
        run / "lineage.json",
    )


def test_a_resumed_run_shows_the_runtime_of_every_attempt_and_says_it_resumed(tmp_path):
    from llmft.report.page import build_report

    # attempt 1 trained 0 -> 12 in 22 s and was killed; attempt 2 resumed from 10, LLaMA-Factory timed 30 s
    train = {"train_runtime_s": 30.0, "attempt": {"attempts": 2, "starts": [0, 10], "runtime_s": 52.0}}
    run = _minimal_run(tmp_path, train)
    summary = build_report(RUN_R, str(run), str(run / "report"))
    assert (summary["train_runtime_s"], summary["train_runtime_s_last_attempt"]) == (52.0, 30.0)
    assert (summary["attempts"], summary["attempt_starts"]) == (2, [0, 10])
    page = (run / "report/index.html").read_text()
    assert (
        "train runtime (s), all attempts</td><td>52 (resumed: 2 attempts, started at steps 0, 10; "
        "the last attempt alone 30 s)"
    ) in page


def test_a_stage_page_adds_its_section_and_summary_block(tmp_path):
    """build_report takes another stage's part of the page (llmft.preference.page's shape): its
    section goes into the page, its block into summary.json."""
    from types import SimpleNamespace

    from llmft.report.page import build_report

    block = {"models": {"preference": {"preference_accuracy": 0.75}}}
    stage = SimpleNamespace(
        load=lambda cfg, run_dir: block,
        section=lambda b: '<h2 id="stage">a stage</h2>' if b else "",
        add_to_summary=lambda summary, b: summary.update(stage=b),
    )
    train = {"train_runtime_s": 30.0, "attempt": {"attempts": 1, "starts": [0], "runtime_s": 29.0}}
    run = _minimal_run(tmp_path, train)
    summary = build_report(RUN_R, str(run), str(run / "report"), stage_pages=(stage,))
    assert summary["stage"] == block
    assert '<h2 id="stage">a stage</h2>' in (run / "report/index.html").read_text()


def test_a_run_in_one_attempt_shows_its_runtime_alone(tmp_path):
    from llmft.report.page import build_report

    train = {"train_runtime_s": 30.0, "attempt": {"attempts": 1, "starts": [0], "runtime_s": 29.0}}
    run = _minimal_run(tmp_path, train)
    summary = build_report(RUN_R, str(run), str(run / "report"))
    assert (summary["train_runtime_s"], summary["attempts"], summary["attempt_starts"]) == (30.0, 1, [0])
    assert "resumed" not in (run / "report/index.html").read_text()


def test_the_gate_section_shows_both_models_on_the_same_rows():
    from llmft.report.page import gate_section

    gate = {
        "tuned": {"eval_loss": 0.81, "exact_match": 0.5},
        "heldout_rows": 65,
        "heldout_fingerprint": "ab12",
    }
    other = {"run": "night1", "tuned": {"eval_loss": 0.93, "exact_match": 0.4}, "heldout_rows": 65,
             "heldout_fingerprint": "ab12"}  # fmt: skip
    html = gate_section({"gate": gate, "compared_with": other}, "exact_match")
    assert "both on the same 65 held-out rows (fingerprint ab12)" in html
    # the gate's metric is the first column, each model's scores in its row
    assert html.index("exact_match (gate)") < html.index("<th>eval_loss</th>")
    assert "<td>this run</td><td>0.5</td><td>0.81</td>" in html
    assert "<td>promoted: night1</td><td>0.4</td><td>0.93</td>" in html
    other["heldout_fingerprint"] = "cd34"
    assert "not scored on the same held-out rows" in gate_section(
        {"gate": gate, "compared_with": other}, "eval_loss"
    )
    assert gate_section({"gate": gate}, "eval_loss") == ""  # compared with nothing: no section


def test_the_gate_section_shows_which_task_a_night_lost(tmp_path):
    """Rows that name their task: both models' exact match per task beside the gate's metric, read
    from the gate's two metrics.json files (llmft.nightly.gate's sides, as gate.json carries them);
    a single task (or none) adds nothing."""
    from llmft.core.io import write_json
    from llmft.nightly.gate import heldout_sides
    from llmft.report.page import gate_section

    def gate_scores(run_dir):
        return heldout_sides(run_dir, "night1")[0]

    common = {"rows": 40, "heldout_fingerprint": "ab12", "eval_loss": 0.2}
    write_json(tmp_path / "eval/gate/metrics.json", {**common, "exact_match": 0.6765,
               "exact_match_by_task": {"last": 0.3401, "repeat": 0.4427}})  # fmt: skip
    write_json(tmp_path / "eval/promoted/metrics.json", {**common, "exact_match": 0.8853,
               "exact_match_by_task": {"last": 0.9803, "repeat": 0.6618, "count": 1.0}})  # fmt: skip
    gate, other = heldout_sides(tmp_path, "night1")
    assert gate["exact_match_by_task"] == {"last": 0.3401, "repeat": 0.4427}
    html = gate_section({"gate": gate, "compared_with": other}, "exact_match")
    # the tasks both models were scored on, after the scores, in each model's row
    assert "<th>exact_match[last]</th><th>exact_match[repeat]</th></tr>" in html
    assert "exact_match[count]" not in html
    assert "<td>0.3401</td><td>0.4427</td></tr>" in html and html.count("<td>0.2</td>") == 2
    assert "<td>0.9803</td><td>0.6618</td></tr>" in html
    write_json(tmp_path / "eval/gate/metrics.json", {**common, "exact_match_by_task": {"": 0.5}})
    assert "exact_match_by_task" not in gate_scores(tmp_path)
    assert "exact_match[" not in gate_section(
        {"gate": gate_scores(tmp_path), "compared_with": other}, "eval_loss"
    )


def test_summary_and_page_carry_one_throughput_figure_with_its_formula(tmp_path):
    from llmft.core.draw import esc, fmt
    from llmft.core.throughput import THROUGHPUT_FORMULA
    from llmft.report.page import build_report

    train = {"world_size": 2, "tokens_per_second_per_gpu": 1234.5, "throughput_steps": [16, 60]}
    run = _minimal_run(tmp_path, train)
    summary = build_report(RUN_R, str(run), str(run / "report"))
    assert [k for k in summary if "tokens_per_second" in k] == ["tokens_per_second_per_gpu"] + [
        "eval_new_tokens_per_second"
    ]
    assert (summary["tokens_per_second_per_gpu"], summary["throughput_steps"]) == (1234.5, [16, 60])
    page = (run / "report/index.html").read_text()
    assert page.count("T_b - T_a") == 1  # the formula, stated once, with the steps it measured
    label = esc(THROUGHPUT_FORMULA.replace("per GPU", "per process"))  # a CPU run
    assert f"<td>{label}; here steps 16-60</td><td class='num'>{fmt(1234.5)}</td>" in page


def _node(host: str, torch: str, driver: str) -> dict:
    """Node facts as verify.json holds them, cut to what the stack fingerprint reads."""
    return {
        "host": host,
        "python": "3.12.3",
        "torch_version": torch,
        "build": "rocm",
        "hip_version": "7.0.51831",
        "packages": {"transformers": "5.6.0", "flash_attn": "2.8.3"},
        "smi": {"tool": "rocminfo", "gpus": [{"name": "gfx942", "marketing_name": "AMD Instinct MI300X"}]},
        "stack": {"rocm": "7.0.2-56", "driver": driver},
    }


def test_the_stack_is_on_the_page_in_summary_json_and_in_the_lineage(tmp_path):
    from llmft.core import stack
    from llmft.report.page import build_report

    run = _minimal_run(tmp_path, {})
    nodes = [_node("n1", "2.9.1+rocm7.0", "6.10.5"), _node("n2", "2.9.1+rocm7.0", "6.8.5")]
    (run / "env").mkdir()
    (run / "env/verify.json").write_text(
        json.dumps({"ok": True, "nodes": nodes, "stack": stack.of_nodes(nodes)})
    )
    write_lineage(run)
    summary = build_report(RUN_R, str(run), str(run / "report"))
    st = summary["stack"]
    assert st["differs"] == ["driver"] and st["fingerprint"]["rocm"] == "7.0.2-56"
    assert st["fingerprint"]["driver"] == {"n1": "6.10.5", "n2": "6.8.5"}
    assert summary["lineage"]["stack"] == st["hash"]
    page = (run / "report/index.html").read_text()
    assert f"Software stack <code>{st['hash']}</code>" in page
    assert "The nodes' stacks differ in: driver." in page
    assert "<tr class='bad'><td>driver</td><td>n1: 6.10.5; n2: 6.8.5</td></tr>" in page
    assert "<tr><td>gpu_model</td><td>AMD Instinct MI300X</td></tr>" in page


def test_a_verify_json_without_a_stack_gets_one_from_its_nodes(tmp_path):
    """verify.json written before the fingerprint was recorded: the report computes it from the nodes."""
    from llmft.core import stack
    from llmft.report.page import build_report

    run = _minimal_run(tmp_path, {})
    nodes = [_node("n1", "2.9.1+rocm7.0", "6.10.5")]
    (run / "env").mkdir()
    (run / "env/verify.json").write_text(json.dumps({"ok": True, "nodes": nodes}))
    write_lineage(run)
    summary = build_report(RUN_R, str(run), str(run / "report"))
    assert summary["stack"]["hash"] == stack.stack_hash(stack.fingerprint(nodes[0]))
    assert summary["stack"]["differs"] == []
    (tmp_path / "other").mkdir()
    no_verify = _minimal_run(tmp_path / "other", {})
    summary = build_report(RUN_R, str(no_verify), str(no_verify / "report"))
    assert summary["stack"] is None and summary["lineage"]["stack"] is None
    assert "Software stack: not recorded" in (no_verify / "report/index.html").read_text()
