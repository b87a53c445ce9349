"""Tests for rlcore.tracking against a real sqlite MLflow store in a temporary folder."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from rlcore.stage.frame import write_json
from rlcore.config import TrackingConfig
from rlcore.tracking import MlflowTracker, NullTracker, git_commit, open_run, resolve_uri

from .conftest import REPO_ROOT

PARAMS = {"sft": {"lr": 0.003, "steps": 3}, "seed": 42}


@pytest.fixture(autouse=True)
def no_active_run():
    """Each test leaves no MLflow run active in this process (a broken tracker skips end_run)."""
    yield
    while mlflow.active_run() is not None:
        mlflow.end_run()


def head_commit(repo: Path) -> str:
    """HEAD's commit read from the .git folder directly (no git process). In a worktree ``.git`` is a file naming
    the worktree's own git folder (its HEAD), whose ``commondir`` holds the branches."""
    git = repo / ".git"
    if git.is_file():
        git = (repo / git.read_text().strip().removeprefix("gitdir: ")).resolve()
    common = (git / (git / "commondir").read_text().strip()).resolve() if (git / "commondir").is_file() else git
    head = (git / "HEAD").read_text().strip()
    if not head.startswith("ref: "):
        return head
    ref = head[len("ref: "):]
    loose = common / ref
    if loose.is_file():
        return loose.read_text().strip()
    for line in (common / "packed-refs").read_text().splitlines():
        if line.endswith(" " + ref):
            return line.split()[0]
    raise AssertionError(f"cannot resolve {ref}")


@pytest.fixture(scope="module")
def store_root(mlflow_store_dir) -> Path:
    """The session's sqlite store (creating its schema is the slow part)."""
    return mlflow_store_dir


@pytest.fixture(scope="module")
def logged_run(store_root):
    """A run logged to a relative sqlite URI resolved against a temporary root."""
    root = store_root
    tracker = open_run(TrackingConfig(uri="sqlite:///runs.db", experiment="unit"), stage="sft", params=PARAMS,
                       root=root, round_name="r1")
    assert isinstance(tracker, MlflowTracker)
    tracker.log_metrics({"sft/loss": 1.5, "eval/pass@8": 0.25}, step=3)
    tracker.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'runs.db'}")
    return root, client, client.get_run(tracker.run_id)


def test_relative_sqlite_uri_lands_under_the_root(logged_run):
    root, _, _ = logged_run
    assert (root / "runs.db").is_file()


def test_run_is_tagged_with_stage_round_params_hash_and_commit(logged_run):
    root, client, run = logged_run
    tags = run.data.tags
    expected_hash = hashlib.sha256(json.dumps(PARAMS, sort_keys=True).encode()).hexdigest()[:12]
    assert tags["rlcore.stage"] == "sft"
    assert tags["rlcore.round"] == "r1"
    assert tags["rlcore.params_hash"] == expected_hash
    assert tags["mlflow.source.git.commit"] == "unknown"  # the temporary root is not a repository
    assert run.info.run_name == "sft-r1" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "unit"


def test_params_are_logged_flat_and_metrics_with_safe_names(logged_run):
    _, client, run = logged_run
    assert run.data.params == {"sft.lr": "0.003", "sft.steps": "3", "seed": "42"}
    assert run.data.metrics == {"sft/loss": 1.5, "eval/pass_at_8": 0.25}
    assert [m.step for m in client.get_metric_history(run.info.run_id, "sft/loss")] == [3]


def test_params_hash_ignores_key_order_and_sees_values():
    from rlcore.config import params_hash

    assert params_hash({"a": 1, "b": {"c": 2}}) == params_hash({"b": {"c": 2}, "a": 1})
    assert params_hash({"a": 1}) != params_hash({"a": 2})


def test_commit_of_the_repository():
    assert git_commit(REPO_ROOT) == head_commit(REPO_ROOT)


def test_commit_of_a_repository_without_commits_is_unknown(tmp_path):
    # What `make run` creates in a fresh export: `git init` and no commit yet.
    git = tmp_path / ".git"
    (git / "objects").mkdir(parents=True)
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    assert git_commit(tmp_path) == "unknown"


def test_a_failing_backend_never_stops_the_stage(logged_run, store_root, tmp_path, monkeypatch, capsys):
    tracker = open_run(TrackingConfig(uri="sqlite:///runs.db", experiment="unit"), stage="ppo",
                       params=PARAMS, root=store_root)
    assert isinstance(tracker, MlflowTracker)
    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise ConnectionError("tracking server went away")

    monkeypatch.setattr(tracker._client, "log_batch", broken)
    monkeypatch.setattr(mlflow, "log_params", broken)
    for step in range(3):  # the training loop keeps logging
        tracker.log_metrics({"actor/pg_loss": 0.1 * step}, step=step)
        tracker.flush()
    tracker.log_params({"extra": 1})
    tracker.log_table([{"prompt": "1+1=", "response": "2"}], "samples.json")
    tracker.log_artifact(store_root / "runs.db")
    tracker.close()
    result = {"rollout/acc": 0.5}
    write_json(tmp_path / "metrics.json", result)  # the stage's declared output, written after
    assert json.loads((tmp_path / "metrics.json").read_text()) == result
    assert len(calls) == 1  # after the first failure the tracker stops calling MLflow
    err = capsys.readouterr().err
    assert err.count("warning: MLflow") == 1 and "tracking server went away" in err


def test_unreachable_store_gives_a_null_tracker(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    uri = f"sqlite:///{blocker}/sub/m.db"  # a folder under a regular file cannot exist
    tracker = open_run(TrackingConfig(uri=uri), stage="sft", params=PARAMS, root=tmp_path)
    assert isinstance(tracker, NullTracker)
    tracker.log_metrics({"a": 1.0})
    tracker.close()
    assert "continuing without tracking" in capsys.readouterr().err


def test_disabled_tracking_is_a_null_tracker_and_writes_nothing(tmp_path):
    tracker = open_run(TrackingConfig(uri="sqlite:///off.db", enabled=False), stage="sft", params=PARAMS,
                       root=tmp_path)
    assert isinstance(tracker, NullTracker) and tracker.run_id is None
    tracker.log_params(PARAMS)
    tracker.log_metrics({"a": 1.0}, step=0)
    tracker.close()
    assert not (tmp_path / "off.db").exists()


@pytest.mark.parametrize(
    "uri, expected",
    [
        ("sqlite:///mlflow.db", "sqlite:////repo/mlflow.db"),
        ("sqlite:///runs/../mlflow.db", "sqlite:////repo/mlflow.db"),
        ("sqlite:////abs/m.db", "sqlite:////abs/m.db"),
        ("http://mlflow:5000", "http://mlflow:5000"),
        ("file:./mlruns", "file:./mlruns"),
    ],
)
def test_resolve_uri(uri, expected):
    assert resolve_uri(uri, Path("/repo")) == expected


@pytest.mark.parametrize("raised, status", [(None, "FINISHED"), (RuntimeError, "FAILED"),
                                            (KeyboardInterrupt, "KILLED")])
def test_a_run_ends_finished_failed_or_killed_never_running(store_root, raised, status):
    """The stage's ``with open_run(...)`` block: a bug marks the run FAILED, Ctrl-C or SIGTERM
    (raised as KeyboardInterrupt by rlcore.stage.frame) KILLED."""
    cfg = TrackingConfig(uri="sqlite:///runs.db", experiment="status")
    try:
        with open_run(cfg, stage="sft", params=PARAMS, root=store_root) as tracker:
            run_id = tracker.run_id
            tracker.log_metrics({"sft/loss": 1.0}, step=0)
            if raised is not None:
                raise raised("stop")
    except (RuntimeError, KeyboardInterrupt):
        pass
    client = MlflowClient(tracking_uri=f"sqlite:///{store_root / 'runs.db'}")
    assert client.get_run(run_id).info.status == status
    assert mlflow.active_run() is None


def test_step_metrics_are_buffered_and_all_written_by_the_end(store_root):
    """Metrics are written in batches, not one sqlite write per step; every step is there after close."""
    with open_run(TrackingConfig(uri="sqlite:///runs.db", experiment="batched"), stage="sft", params=PARAMS,
                  root=store_root) as tracker:
        for step in range(700):  # 1400 values: one full batch of 1000 is written before the end
            tracker.log_metrics({"sft/loss": 1.0 / (step + 1), "sft/lr": 0.5}, step=step)
        assert len(tracker._buffer) == 400
    client = MlflowClient(tracking_uri=f"sqlite:///{store_root / 'runs.db'}")
    history = client.get_metric_history(tracker.run_id, "sft/loss")
    assert sorted(m.step for m in history) == list(range(700))
    assert {m.step: m.value for m in history}[9] == pytest.approx(0.1)


def test_a_tracking_server_that_is_down_costs_seconds_and_one_warning(tmp_path, capsys):
    """Nothing listens on the port: the stage gets a null tracker after a bounded retry (MLflow's own
    defaults waited 250 s here) and trains on; its metrics still go to the JSON and the plot CSV."""
    import socket
    import time

    from rlcore.trainer.loop.step_log import StepLog

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    tracker = open_run(TrackingConfig(uri=f"http://127.0.0.1:{port}"), stage="sft", params=PARAMS, root=tmp_path)
    assert isinstance(tracker, NullTracker)
    assert time.monotonic() - start < 30
    log = StepLog(tracker, tmp_path / "plot.csv")
    for step in range(3):
        log.log(step, {"sft/loss": 1.0 / (step + 1)})
    tracker.close()
    assert (tmp_path / "plot.csv").read_text().splitlines()[1:] == ["0,1.0", "1,0.5", "2,0.3333333333333333"]
    assert capsys.readouterr().err.count("warning: MLflow unavailable") == 1
