"""The configured lm-eval tasks, checked where the config is checked: a name lm-eval does not know
(with its close matches) and a task whose data is not on this machine are refused before any job,
because benchmark jobs run offline (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE)."""

from __future__ import annotations

import difflib
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from llmft.core.config import ConfigError
from llmft.core.settings import Eval

# datasets' packaged builders read local files named in data_files; anything else is a Hub dataset.
LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas"}


def include_paths(ecfg: Eval, base_dir: Path) -> list[str]:
    """eval.benchmark_include_path as absolute folders (relative ones to the working directory)."""
    return [str((base_dir / p).resolve()) for p in ecfg.benchmark_include_path]


def data_cache(ecfg: Eval) -> Path:
    """The datasets cache the jobs read: eval.benchmark_data_cache, else datasets' own default."""
    if ecfg.benchmark_data_cache:
        return Path(ecfg.benchmark_data_cache).expanduser().resolve()
    env = os.environ.get("HF_DATASETS_CACHE")
    if env:
        return Path(env).expanduser().resolve()
    hf_home = os.environ.get("HF_HOME") or "~/.cache/huggingface"
    return (Path(hf_home).expanduser() / "datasets").resolve()


def task_manager(ecfg: Eval, base_dir: Path):
    include = include_paths(ecfg, base_dir)
    for folder in include:
        if not Path(folder).is_dir():
            raise ConfigError(f"config key eval.benchmark_include_path: {folder} is not a folder")
    from lm_eval.tasks import TaskManager

    if include:  # indexing lm-eval's own ~14 000 task YAMLs costs each process tens of CPU seconds
        local = TaskManager(include_path=include, include_defaults=False)
        if all(_whole(local.task_index, bench["task"]) for bench in ecfg.benchmarks):
            return local
    return TaskManager(include_path=include or None)


def _whole(index: dict, name: str, seen: frozenset = frozenset()) -> bool:
    """Whether task or group `name` of an index of the include folders alone runs only tasks that
    index holds: a tag, or a group naming a task the folders lack, may reach lm-eval's own tasks
    (the full index has them; a name in both resolves to the include folder's, as in the full one)."""
    from lm_eval.tasks._index import Kind

    entry = index.get(name)
    if entry is None or entry.kind == Kind.TAG:
        return False
    if entry.kind != Kind.GROUP or name in seen:
        return True
    subs = [sub.get("task") if isinstance(sub, dict) else sub for sub in (entry.cfg or {}).get("task", [])]
    return all(isinstance(sub, str) and _whole(index, sub, seen | {name}) for sub in subs)


def leaf_configs(index: dict, name: str, seen: frozenset = frozenset()) -> list[tuple[str, dict]]:
    """(task name, its YAML config) of every task a task, group or tag name of a task index runs."""
    from lm_eval.tasks._index import Kind

    entry = index.get(name)
    if entry is None or name in seen:
        return []
    seen = seen | {name}
    if entry.kind == Kind.TAG:
        return [leaf for e in index.values() if name in e.tags for leaf in leaf_configs(index, e.name, seen)]
    if entry.kind == Kind.GROUP:
        out = []
        for sub in (entry.cfg or {}).get("task", []):
            if isinstance(sub, str):
                out += leaf_configs(index, sub, seen)
            elif isinstance(sub, dict):  # an inline task: its own keys over the task it names
                base = dict(index[sub["task"]].cfg or {}) if sub.get("task") in index else {}
                out.append((str(sub.get("task")), {**base, **sub}))
        return out
    return [(name, entry.cfg or {})]


def _data_files(cfg: dict) -> list[str]:
    files = (cfg.get("dataset_kwargs") or {}).get("data_files") or []
    if isinstance(files, dict):
        files = [f for v in files.values() for f in ([v] if isinstance(v, str) else v)]
    elif isinstance(files, str):
        files = [files]
    return [str(f) for f in files]


def _function_file(value: str) -> Path | None:
    """The Python file of a YAML `!function module.name`: lm-eval's index keeps the tag as the YAML's
    folder joined with module.name, and imports the module from beside the YAML."""
    path = Path(value)
    if not path.is_absolute() or "." not in path.name:
        return None
    module = path.parent / (path.name.rpartition(".")[0].replace(".", "/") + ".py")
    return module if module.is_file() else None


@dataclass
class TaskReads:
    """What the configured tasks of the include folders read, wherever it is: their configs as lm-eval
    reads them (YAML includes merged), each `!function` as its file and name; the local files and
    folders their datasets load; and the Python files their `!function`s import."""

    configs: list = field(default_factory=list)
    data: list[Path] = field(default_factory=list)
    code: list[Path] = field(default_factory=list)


def task_reads(ecfg: Eval, include: list[str]) -> TaskReads:
    """lm-eval's own tasks are not here: its version stands for them."""
    from lm_eval.tasks._index import TaskIndex

    index = TaskIndex.build([Path(p) for p in include])
    reads = TaskReads()

    def canonical(value):
        if isinstance(value, dict):
            return {k: canonical(v) for k, v in value.items()}
        if isinstance(value, list):
            return [canonical(v) for v in value]
        module = _function_file(value) if isinstance(value, str) else None
        if module is None:
            return value
        reads.code.append(module)
        return {"function": Path(value).name, "file": hashlib.sha256(module.read_bytes()).hexdigest()}

    for bench in ecfg.benchmarks:
        for task, cfg in leaf_configs(index, bench["task"]):
            reads.configs.append([task, canonical(cfg)])
            named = [*_data_files(cfg), (cfg.get("dataset_kwargs") or {}).get("data_dir")]
            if cfg.get("dataset_path") not in LOCAL_BUILDERS:  # else a builder's name, not a path
                named.append(cfg.get("dataset_path"))
            reads.data += [Path(p) for p in named if isinstance(p, str) and p and Path(p).exists()]
    reads.data = sorted(set(reads.data))
    reads.code = sorted(set(reads.code))
    return reads


def missing_data(task: str, cfg: dict, cache: Path) -> str | None:
    """Why the task's data is not here, or None. Tasks that load their own documents
    (custom_dataset) are trusted: their code reads whatever it reads."""
    if cfg.get("custom_dataset") or not cfg.get("dataset_path"):
        return None
    path = str(cfg["dataset_path"])
    if path in LOCAL_BUILDERS:
        gone = [f for f in _data_files(cfg) if not Path(f).exists()]
        return f"its data file(s) {gone} do not exist" if gone else None
    if Path(path).is_dir():
        return None
    # datasets caches a Hub dataset owner/name under <cache>/owner___name/
    folder = cache / path.replace("/", "___")
    if folder.is_dir() or any(p.name.lower() == folder.name.lower() for p in _children(cache)):
        return None
    return (
        f"its dataset {path} is not in the datasets cache {cache} (expected {folder}); fill the cache "
        "on a machine with internet: python -m llmft benchmarks-fetch, with the same "
        "eval.benchmark_data_cache"
    )


def _children(folder: Path) -> list[Path]:
    return list(folder.iterdir()) if folder.is_dir() else []


def check(ecfg: Eval, base_dir: Path) -> None:
    """Refuse, naming the task, an unknown task (with close matches) or one whose data is missing."""
    if not ecfg.benchmarks:
        return
    tm = task_manager(ecfg, base_dir)
    cache = data_cache(ecfg)
    for i, bench in enumerate(ecfg.benchmarks):
        name, where = bench["task"], f"config key eval.benchmarks[{i}].task"
        if name not in tm.task_index:
            close = difflib.get_close_matches(name, tm.all_tasks, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"{where}: lm-eval has no task {name!r}{hint}")
        for task, cfg in leaf_configs(tm.task_index, name):
            why = missing_data(task, cfg, cache)
            if why:
                raise ConfigError(f"{where}: task {task!r} cannot run offline: {why}")


def fetch(ecfg: Eval, base_dir: Path) -> Path:
    """On a machine with internet (a login node): build every configured task once, which makes
    datasets download its data into the cache the jobs read; then check it is all there."""
    cache = data_cache(ecfg)
    os.environ["HF_DATASETS_CACHE"] = str(cache)
    tm = task_manager(ecfg, base_dir)
    for i, bench in enumerate(ecfg.benchmarks):
        try:
            tm.load([bench["task"]])
        except Exception as exc:  # lm-eval and datasets raise many kinds; the task and cache are what matter
            raise ConfigError(
                f"config key eval.benchmarks[{i}].task: could not fetch the data of {bench['task']!r} "
                f"into {cache}: {type(exc).__name__}: {str(exc)[:300]}"
            ) from None
    check(ecfg, base_dir)
    return cache
