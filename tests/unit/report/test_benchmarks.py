"""Benchmarks base vs tuned on the page and in summary.json: the verdict names what regressed."""

from llmft.report.benchmarks import compare, section


def scores(**tasks):
    """scores.json as the benchmarks job writes it: per task, value and stderr of one metric."""
    return {
        "tasks": {
            name: {
                "metrics": {metric: value},
                "stderr": {metric: se},
                "higher_is_better": {metric: metric != "perplexity"},
            }
            for name, (metric, value, se) in tasks.items()
        }
    }


def test_a_drop_beyond_noise_is_named_and_one_within_noise_is_not():
    base = scores(arc=("acc", 0.60, 0.02), hella=("acc", 0.50, 0.02), wiki=("perplexity", 10.0, 0.1))
    tuned = scores(arc=("acc", 0.45, 0.02), hella=("acc", 0.48, 0.02), wiki=("perplexity", 12.0, 0.1))
    cmp = compare(base, tuned)
    # arc: -0.15 against a noise of 2 * sqrt(2) * 0.02 = 0.057; hella: -0.02, within it;
    # perplexity (lower is better) up by 2 against 0.28
    assert cmp["regressed"] == ["arc", "wiki"]
    assert cmp["tasks"]["hella"]["regressed"] is False
    assert abs(cmp["tasks"]["arc"]["noise"] - 0.0566) < 1e-3
    assert cmp["verdict"].startswith("regressed beyond noise: arc: acc 0.6000 -> 0.4500")
    assert "hella" not in cmp["verdict"]
    html = section(cmp)
    assert "0.6000 ± 0.0200" in html and "regressed beyond noise" in html


def test_gains_and_no_scores():
    cmp = compare(scores(arc=("acc", 0.2, 0.05)), scores(arc=("acc", 0.8, 0.05)))
    assert cmp["regressed"] == [] and cmp["verdict"] == "no benchmark regressed beyond its noise (1 task(s))"
    assert compare({}, {})["verdict"] == "no benchmark scores" and section(None) == ""


def test_the_trend_page_lists_each_runs_benchmarks(tmp_path):
    from llmft.core.io import write_json
    from llmft.report.trend import build_trend

    for run, acc in (("n1", 0.8), ("n2", 0.3)):
        cmp = compare(scores(arc=("acc", 0.8, 0.02)), scores(arc=("acc", acc, 0.02)))
        write_json(tmp_path / run / "report/summary.json", {"run": run, "generated": run, "benchmarks": cmp})
    write_json(tmp_path / "old/report/summary.json", {"run": "old", "generated": "n0"})  # before benchmarks
    build_trend(tmp_path, tmp_path / "trend.html")
    page = (tmp_path / "trend.html").read_text()
    assert "Standard benchmarks across runs" in page and "0.3000" in page
    assert "regressed beyond noise: arc: acc 0.8000 -&gt; 0.3000" in page


def test_the_table_shows_every_metric_a_task_reports():
    """arc_easy-style scores (acc and acc_norm): both rows, the headline (first) one marked; the
    verdict stays on the headline metric."""

    def two(acc, acc_norm):
        return {
            "tasks": {
                "arc": {
                    "metrics": {"acc": acc, "acc_norm": acc_norm},
                    "stderr": {"acc": 0.01, "acc_norm": 0.01},
                    "higher_is_better": {"acc": True, "acc_norm": True},
                }
            }
        }

    cmp = compare(two(0.60, 0.55), two(0.61, 0.40))
    assert [r["metric"] for r in cmp["tasks"]["arc"]["all"]] == ["acc", "acc_norm"]
    assert cmp["tasks"]["arc"]["metric"] == "acc" and cmp["regressed"] == []
    html = section(cmp)
    assert "<td>acc (headline)</td>" in html and "<td>acc_norm</td>" in html
    assert "0.5500 ± 0.0100" in html and "0.4000 ± 0.0100" in html and "-0.1500" in html
