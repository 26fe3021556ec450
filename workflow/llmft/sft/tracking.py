"""Experiment tracking for sft: TensorBoard event files by default, MLflow (a file store) or
Weights & Biases (offline) by config (`sft.tracking`), all written under results/<run>/tracking/ as
training runs, so `tensorboard --logdir results/` shows every run live.

One tracked run per training job: the Trainer logs from rank 0 only, whatever the node count, and
a requeued job continues the same run:
- TensorBoard: the same folder (one per training work folder), steps continuing from the checkpoint;
- MLflow: the run made by the first attempt is kept in the work folder (its id) and reattached
  by rank 0 before the Trainer starts; parameters are logged once, by the first attempt;
- W&B: a run id fixed by the work folder, resumed (WANDB_RESUME=allow); `wandb sync` merges the
  attempts' offline folders into one run.
A user's own MLFLOW_TRACKING_URI, WANDB_MODE, WANDB_PROJECT win over these defaults.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MODULES = {"tensorboard": "tensorboardX", "mlflow": "mlflow", "wandb": "wandb"}
RUN_ID_FILE = "llmft_mlflow_run.json"


class TrackingError(RuntimeError):
    """A tracking backend the config asks for cannot run on this node."""


def settings(backends: list[str], tracking_dir: str, run: str) -> dict:
    """The `llmft.sft.tracking` block of the rendered YAML."""
    return {"backends": list(backends), "dir": tracking_dir, "run": run}


def report_to(backends: list[str]) -> list[str] | str:
    """LLaMA-Factory's / the Trainer's report_to value."""
    return list(backends) or "none"


def _stable_id(work: Path) -> str:
    return hashlib.sha256(str(work.resolve()).encode()).hexdigest()[:16]


def environment(tracking: dict, work: Path, environ: dict | None = None) -> dict[str, str]:
    """The environment variables that point each backend at this run's folder (see the module doc)."""
    environ = os.environ if environ is None else environ
    backends = tracking.get("backends") or []
    root = Path(tracking.get("dir") or work / "tracking").resolve()
    name = f"{tracking.get('run', 'llmft')}/{work.name}"
    env: dict[str, str] = {}
    if "tensorboard" in backends:
        env["TENSORBOARD_LOGGING_DIR"] = str(root / "tensorboard" / work.name)
    if "mlflow" in backends:
        if not environ.get("MLFLOW_TRACKING_URI"):
            env["MLFLOW_TRACKING_URI"] = (root / "mlruns").as_uri()
            # a folder of files: no server, no database, safe on a shared file system; MLflow 3
            # keeps it in maintenance mode and asks for this opt-in
            env["MLFLOW_ALLOW_FILE_STORE"] = "true"
        env.setdefault("MLFLOW_EXPERIMENT_NAME", environ.get("MLFLOW_EXPERIMENT_NAME") or "llmft")
    if "wandb" in backends:
        env["WANDB_DIR"] = str(root)
        env["WANDB_RUN_ID"] = f"llmft-{_stable_id(work)}"
        env["WANDB_RESUME"] = "allow"
        env["WANDB_NAME"] = name
        for key, default in (("WANDB_MODE", "offline"), ("WANDB_PROJECT", "llmft")):
            if not environ.get(key):
                env[key] = default
    return env


def check_installed(backends: list[str]) -> None:
    """Fail before training when a backend's package is missing (the Trainer would only warn)."""
    import importlib.util

    missing = [b for b in backends if importlib.util.find_spec(MODULES[b]) is None]
    if missing:
        names = ", ".join(f"{b} (package {MODULES[b]})" for b in missing)
        raise TrackingError(
            f"config key sft.tracking asks for {names}, not installed on this node: install it in "
            "the training environment, or leave it out of sft.tracking"
        )


def mlflow_run(work: Path, env: dict[str, str], run_name: str) -> tuple[str, bool]:
    """The MLflow run of this training job: made by the first attempt, reattached by a requeued one.
    Returns (run id, resumed)."""
    stamp = work / RUN_ID_FILE
    if stamp.exists():
        return json.loads(stamp.read_text())["run_id"], True
    from mlflow.tracking import MlflowClient

    os.environ.update({k: v for k, v in env.items() if k.startswith("MLFLOW_")})
    client = MlflowClient(tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"))
    name = env.get("MLFLOW_EXPERIMENT_NAME") or "llmft"
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
    run = client.create_run(experiment_id, run_name=run_name, tags={"llmft.work_dir": str(work)})
    tmp = stamp.with_name(stamp.name + ".tmp")
    tmp.write_text(json.dumps({"run_id": run.info.run_id, "experiment_id": experiment_id}))
    tmp.replace(stamp)
    return run.info.run_id, False


def set_up(tracking: dict, work: Path, rank: int) -> None:
    """Called in every training process before the Trainer starts: check, then point the backends."""
    backends = tracking.get("backends") or []
    if not backends:
        return
    check_installed(backends)
    env = environment(tracking, work)
    os.environ.update(env)
    if "mlflow" in backends and rank == 0:
        import mlflow

        run_id, resumed = mlflow_run(work, env, f"{tracking.get('run', 'llmft')}/{work.name}")
        if resumed:
            # The Trainer logs its arguments at every start; a resumed one differs (the checkpoint it
            # resumes from) and MLflow refuses changed parameters: the first attempt's stand.
            os.environ["MLFLOW_MAX_LOG_PARAMS"] = "0"
        # Started here, the run is the Trainer's active run, which it neither restarts nor ends at
        # the end of training: the held-out evaluation after training logs into it too (a run the
        # Trainer ended would make MLflow open a new one), and flush() ends it.
        mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
        mlflow.start_run(run_id=run_id)


def flush(code: int) -> None:
    """Before a training process leaves without interpreter teardown: close the writers and end
    the tracked run so that what the backends still queue (both log asynchronously) reaches disk.
    A run that stopped for a requeue or diverged is marked so, not finished."""
    import gc
    import sys

    board = sys.modules.get("tensorboardX")
    if board is not None:
        # tensorboardX queues events for a writer thread and its flush() does not wait for the
        # queue; the Trainer closes its writer only when training ends, not on a preemption stop.
        for obj in gc.get_objects():
            if isinstance(obj, board.SummaryWriter):
                obj.close()
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and mlflow.active_run() is not None:
        if hasattr(mlflow, "flush_async_logging"):
            mlflow.flush_async_logging()
        mlflow.end_run(status="FINISHED" if code == 0 else "KILLED")
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish(exit_code=code)
