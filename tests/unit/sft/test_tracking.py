"""Where each tracker writes, and that a missing tracker stops the run before training."""

import pytest
from llmft.sft import tracking


def test_each_backend_writes_under_the_runs_tracking_folder(tmp_path):
    work = tmp_path / "results/r/work/sft-abc"
    block = tracking.settings(["tensorboard", "mlflow", "wandb"], str(tmp_path / "results/r/tracking"), "r")
    env = tracking.environment(block, work, environ={})
    root = (tmp_path / "results/r/tracking").resolve()
    assert env["TENSORBOARD_LOGGING_DIR"] == str(root / "tensorboard/sft-abc")
    assert env["MLFLOW_TRACKING_URI"] == (root / "mlruns").as_uri()
    assert env["WANDB_MODE"] == "offline" and env["WANDB_DIR"] == str(root)
    # a requeued attempt of the same work folder continues the same W&B run
    again = tracking.environment(block, work, environ={})
    assert env["WANDB_RUN_ID"] == again["WANDB_RUN_ID"] and env["WANDB_RESUME"] == "allow"
    other = tracking.environment(block, work.with_name("sft-def"), environ={})
    assert other["WANDB_RUN_ID"] != env["WANDB_RUN_ID"]


def test_the_users_own_tracking_server_wins(tmp_path):
    block = tracking.settings(["mlflow", "wandb"], str(tmp_path), "r")
    env = tracking.environment(
        block, tmp_path / "w", environ={"MLFLOW_TRACKING_URI": "http://mlflow:5000", "WANDB_MODE": "online"}
    )
    assert "MLFLOW_TRACKING_URI" not in env and "WANDB_MODE" not in env


def test_none_asked_sets_nothing(tmp_path):
    assert tracking.environment(tracking.settings([], str(tmp_path), "r"), tmp_path, environ={}) == {}
    assert tracking.report_to([]) == "none" and tracking.report_to(["tensorboard"]) == ["tensorboard"]


def test_a_missing_package_is_named_with_its_config_key(monkeypatch):
    monkeypatch.setitem(tracking.MODULES, "wandb", "llmft_no_such_package")
    with pytest.raises(
        tracking.TrackingError, match=r"sft\.tracking asks for wandb \(package llmft_no_such_package\)"
    ):
        tracking.check_installed(["tensorboard", "wandb"])


def test_mlflow_run_is_made_once_and_reattached(tmp_path, monkeypatch):
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(key, raising=False)
    work = tmp_path / "work"
    work.mkdir()
    env = tracking.environment(
        tracking.settings(["mlflow"], str(tmp_path / "tracking"), "r"), work, environ={}
    )
    first, resumed = tracking.mlflow_run(work, env, "r/work")
    again, resumed_again = tracking.mlflow_run(work, env, "r/work")
    assert not resumed and resumed_again and first == again and (work / tracking.RUN_ID_FILE).exists()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    assert len(client.search_runs([client.get_experiment_by_name("llmft").experiment_id])) == 1
