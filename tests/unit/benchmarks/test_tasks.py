"""Which lm-eval task index a benchmark process builds: the include folders' alone when every configured
name runs only their tasks, lm-eval's whole index (its own tasks too) otherwise."""

from pathlib import Path

from llmft.benchmarks.tasks import _whole, task_manager
from llmft.core.settings import Eval

from tests.conftest import REPO

TASKS = REPO / "tests" / "bench_tasks"

GROUPS = {
    "mine.yaml": "group: mine\ntask:\n  - llmft_category\n  - task: llmft_first_word\n    num_fewshot: 1\n",
    "mixed.yaml": "group: mixed\ntask:\n  - llmft_category\n  - arc_easy\n",
    "nested.yaml": "group: nested\ntask:\n  - mine\n  - mixed\n",
    "tagged.yaml": "task: llmft_tagged\ntag: shared_tag\ndataset_path: json\noutput_type: loglikelihood\n",
}


def _folder(tmp_path: Path) -> Path:
    for name, text in GROUPS.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_task_or_group_of_the_folders_own_tasks_is_whole_and_one_reaching_lm_evals_is_not(tmp_path):
    from lm_eval.tasks._index import TaskIndex

    index = TaskIndex.build([TASKS, _folder(tmp_path)])
    assert _whole(index, "llmft_category") and _whole(index, "mine")
    assert not _whole(index, "mixed")  # arc_easy is lm-eval's
    assert not _whole(index, "nested")  # through mixed
    assert not _whole(index, "shared_tag")  # a tag may also name lm-eval's tasks
    assert not _whole(index, "arc_easy")


def test_the_include_folders_alone_are_indexed_when_they_hold_every_configured_task(tmp_path):
    folders = [str(TASKS), str(_folder(tmp_path))]
    ecfg = Eval(benchmark_include_path=folders, benchmarks=[{"task": "llmft_category"}, {"task": "mine"}])
    tm = task_manager(ecfg, tmp_path)
    assert "llmft_category" in tm.task_index and "mine" in tm.task_index
    assert "arc_easy" not in tm.task_index  # lm-eval's own tasks were not indexed
