"""A LLaMA-Factory dataset_info.json entry as a data source, through Snakemake: the entry's file and
the dataset_info.json are prepare_data's inputs (an edit to either reruns it), the job reads the
entry as LLaMA-Factory would, and an entry that cannot be read stops the run before any job."""

import json

import pytest

from tests.conftest import make_workdir, rules_run, snakemake

pytestmark = pytest.mark.workflow
TARGET = "results/demo/data/stats.json"


def write_entry(work, entry: dict) -> None:
    (work / "lf" / "dataset_info.json").write_text(json.dumps({"mine": entry}))


def test_entry_is_an_input_of_prepare_data(tmp_path):
    work = make_workdir(tmp_path, data__sources=[{"dataset_info": "lf/dataset_info.json", "name": "mine"}])
    (work / "lf").mkdir()
    rows = [{"q": f"question {i}", "a": f"answer {i}", "sys": "Be brief."} for i in range(60)]
    (work / "lf" / "rows.json").write_text(json.dumps(rows))
    write_entry(
        work, {"file_name": "rows.json", "columns": {"prompt": "q", "response": "a", "system": "sys"}}
    )
    proc = snakemake(work, TARGET)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads((work / TARGET).read_text())
    assert stats["sources"][0]["path"] == "lf/rows.json" and stats["sources"][0]["kept"] == 60
    train = [json.loads(x) for x in open(work / "results/demo/data/train.jsonl")]
    assert train[0]["instruction"].startswith("question") and train[0]["system"] == "Be brief."
    assert rules_run((p := snakemake(work, "-n", TARGET)).stderr + p.stdout) == []
    # the entry's columns change what is read: prepare_data reruns
    write_entry(work, {"file_name": "rows.json", "columns": {"prompt": "q", "response": "a"}})
    assert "prepare_data" in rules_run((p := snakemake(work, "-n", TARGET)).stderr + p.stdout)
    # an entry that needs a hub: one line naming the key and the entry, before any job
    write_entry(work, {"hf_hub_url": "org/data"})
    proc = snakemake(work, "-n", TARGET)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("llmft config error: config key data.sources[0].dataset_info: entry 'mine'")
    assert "hf_hub_url" in last
