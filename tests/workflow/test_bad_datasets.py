"""Hostile dataset inputs through the real workflow on the local profile: a FIFO, a symlink loop or
/dev/zero as a data path stops the run before any job, and LLaMA-Factory's KTO demo given as
sharegpt fails prepare_data naming the column, leaving no data folder behind."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import make_workdir, snakemake

pytestmark = pytest.mark.workflow
TARGET = "results/demo/data/stats.json"


@pytest.mark.parametrize(
    "kind,needle",
    [("fifo", "is a FIFO (named pipe)"), ("loop", "is a symlink loop"), ("zero", "is a device")],
)
@pytest.mark.reliability(
    fault="a FIFO, a symlink loop or `/dev/zero` as `data.sources[].path`",
    seen='the run stops before any job naming the key, the path and what it is (it used to say "not found")',
    steps_lost="none",
    data_lost="none",
)
def test_a_special_file_as_dataset_stops_before_any_job(tmp_path, kind, needle):
    work = tmp_path / "w"
    path = work / "rows.jsonl"
    make_workdir(work, data__sources=[{"path": "rows.jsonl"}])
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "loop":
        os.symlink(path.name, path)
    else:
        path.symlink_to("/dev/zero")
    proc = snakemake(work, "-n", TARGET, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137) and "Traceback" not in out, out[-3000:]
    assert f"config key data.sources[0].path: {path} {needle}" in out


@pytest.mark.reliability(
    fault="LLaMA-Factory's `kto_en_demo.json` given as a sharegpt source (a `label` column)",
    seen=(
        "prepare_data fails naming each row's `label` column and LLaMA-Factory's kto stage, and says to "
        "give the file under preference.data.sources; no row is trained with its label dropped"
    ),
    steps_lost="none",
    data_lost="none: no data folder is left behind",
)
def test_kto_data_as_sharegpt_fails_naming_the_column_and_leaves_no_data_folder(tmp_path):
    work = tmp_path / "w"
    make_workdir(work, data__sources=[{"path": "kto.json", "format": "sharegpt"}])
    rows = [
        {"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"a {i}"}],
         "label": i % 2 == 0}
        for i in range(40)
    ]  # fmt: skip
    (work / "kto.json").write_text(json.dumps(rows))
    proc = snakemake(work, TARGET, timeout=600)
    assert proc.returncode not in (0, 124, 137), proc.stderr[-3000:]
    log = (work / "results/demo/logs/prepare_data.log").read_text()
    assert "40 bad row(s) (unused_column 40)" in log and "Traceback" not in log, log[-3000:]
    assert (
        "kto.json row 1: field 'label' holds a KTO label (desirable or not), for LLaMA-Factory's kto stage"
        in log
    )
    assert "give the file under preference.data.sources" in log  # where such data goes
    assert not (work / "results/demo/data").exists()
