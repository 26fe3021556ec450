"""Test-only: the Slurm tests' snakemake processes poll the test cluster at most POLL_CAP_S apart.

tests/slurm/cluster.py puts this folder first on PYTHONPATH for the snakemake it starts, so Python
imports this file at start-up. snakemake-executor-plugin-slurm (2.8) sleeps 10 s longer after every
status poll that finds no job finished, up to a hard-coded 180 s, and no setting caps that: on the
test cluster a one-minute job was noticed ~20 s after it ended, a requeued one minutes later. Here
the interval the plugin sets is capped; it still polls with the same command (squeue) and reads the
same states, only sooner. Nothing else is touched, and nothing happens in a process that does not
import the plugin.
"""

import importlib.abc
import importlib.util
import sys

POLL_CAP_S = 2
PLUGIN = "snakemake_executor_plugin_slurm"


def _cap(executor) -> None:
    interval = executor.next_seconds_between_status_checks  # the property of Snakemake's RemoteExecutor
    executor.next_seconds_between_status_checks = property(
        interval.fget, lambda self, seconds: interval.fset(self, min(seconds, POLL_CAP_S))
    )


class _CapOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != PLUGIN:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _cap(module.Executor)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _CapOnImport())
