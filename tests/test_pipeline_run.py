"""rlcore.pipeline_run: the parent run that groups one pipeline's stage runs, against a real sqlite MLflow store and a
real git repository with a committed params.yaml (stages are separate processes; here each is one open_run)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import mlflow
import pytest
import yaml
from mlflow import MlflowClient

from rlcore.config import Config, TrackingConfig
from rlcore.pipeline_run import (VIEW_TAG, changed_params, committed_params, identify, pipeline_params,
                                 short_changes, ui_url)
from rlcore.tracking import open_run

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


@pytest.fixture(autouse=True)
def no_active_run():
    yield
    while mlflow.active_run() is not None:
        mlflow.end_run()


def test_changed_params_are_the_flat_keys_that_differ():
    before = {"algorithm": {"adv_estimator": "grpo", "gamma": 1.0}, "seed": 42, "task": {"file": {}}}
    now = {"algorithm": {"adv_estimator": "rloo", "gamma": 1.0}, "seed": 42, "task": {"file": {"train": "a.jsonl"}}}
    assert changed_params(now, before) == {"algorithm.adv_estimator": ("grpo", "rloo"),
                                           "task.file.train": (None, "a.jsonl"), "task.file": ({}, None)}
    assert changed_params(now, None) == {}  # nothing to compare with


def test_short_changes_names_a_key_by_its_last_part_unless_two_share_it():
    changed = {"algorithm.adv_estimator": ("grpo", "rloo"), "actor.lr": (1e-4, 3e-4), "critic.lr": (3e-3, 1e-3),
               "ppo.rounds": ({}, {"r1": {"steps": 5}})}
    assert short_changes(changed) == ('adv_estimator=rloo, actor.lr=0.0003, critic.lr=0.001, '
                                      'rounds={"r1": {"steps": 5}}')
    assert short_changes(changed, limit=30) == "adv_estimator=rloo, actor.l..."


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A git repository whose one commit has the default params.yaml with seed 42."""
    root = tmp_path_factory.mktemp("repo")
    (root / "params.yaml").write_text(yaml.safe_dump({"seed": 42, "algorithm": {"adv_estimator": "grpo"}}))
    env = {**GIT_ENV, "PATH": "/usr/bin:/bin"}
    for cmd in (["git", "init", "-q"], ["git", "add", "params.yaml"], ["git", "commit", "-q", "-m", "base"]):
        subprocess.run(cmd, cwd=root, env=env, check=True)
    return root


def head(root: Path) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()


def write_params(root: Path, name: str, **algorithm) -> tuple[Path, dict]:
    path = root / name
    path.write_text(yaml.safe_dump({"seed": 42, "algorithm": {"adv_estimator": "grpo", **algorithm}}))
    return path, pipeline_params(str(path))


def test_a_dvc_experiment_is_keyed_and_named_by_the_experiment_and_its_changes(repo, monkeypatch):
    commit = head(repo)
    path, params = write_params(repo, "params.yaml", adv_estimator="rloo", norm_adv_by_std_in_grpo=False)
    assert committed_params(repo, commit, path)["algorithm"]["adv_estimator"] == "grpo"
    monkeypatch.setenv("DVC_EXP_NAME", "awned-leks")
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", commit)
    ident = identify(params, repo, path, commit)
    assert ident.key == f"exp:{commit}:awned-leks"
    assert ident.name == "awned-leks: adv_estimator=rloo, norm_adv_by_std_in_grpo=false"
    assert ident.tags["dvc.exp_name"] == "awned-leks" and ident.tags["mlflow.source.git.commit"] == commit
    assert ident.tags["rlcore.changed_params"] == ('algorithm.adv_estimator="rloo", '
                                                   'algorithm.norm_adv_by_std_in_grpo=false')


def test_dvc_repro_is_keyed_by_commit_and_params(repo, monkeypatch):
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    monkeypatch.delenv("DVC_EXP_BASELINE_REV", raising=False)
    commit = head(repo)
    same, params = write_params(repo, "params.yaml")
    ident = identify(params, repo, same, commit)
    assert ident.name == f"params of {commit[:7]}" and ident.changed == {}
    _, other = write_params(repo, "params.yaml", adv_estimator="opo")
    changed = identify(other, repo, same, commit)
    assert changed.name == "adv_estimator=opo" and changed.key != ident.key
    assert changed.key.startswith(f"repro:{commit}:")
    fresh = identify(params, repo, same, "unknown")  # `git init` and no commit yet: nothing to compare with
    assert fresh.name == f"pipeline {fresh.tags['rlcore.params_hash']}"


@pytest.fixture
def store(mlflow_store_dir) -> str:
    return f"sqlite:///{mlflow_store_dir / 'runs.db'}"


def stage(store: str, root: Path, params_file: Path, name: str, params: dict, fail: bool = False, **metrics):
    """One stage process's run: open, log final metrics, close (FAILED when ``fail``)."""
    cfg = TrackingConfig(uri=store, experiment="pipelines")
    tracker = open_run(cfg, stage=name, params={"seed": params["seed"]}, root=root, pipeline=params,
                       params_file=params_file)
    tracker.log_final(metrics, prefix="r1/" if name == "ppo" else "")
    tracker.close("FAILED" if fail else "FINISHED")
    return tracker


def test_stages_of_one_pipeline_nest_under_one_parent_with_every_param_and_final_metrics(repo, store, monkeypatch,
                                                                                        capsys):
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    path, grpo = write_params(repo, "params.yaml")
    sft = stage(store, repo, path, "sft", grpo, **{"sft/final_loss": 0.5})
    printed = capsys.readouterr().out
    ppo = stage(store, repo, path, "ppo", grpo, fail=True, **{"ppo/acc_last10": 0.25})
    client = MlflowClient(store)
    parent = client.get_run(sft.parent_id)
    assert ppo.parent_id == sft.parent_id and parent.info.status == "FAILED"  # the last stage's status
    # the failed stage runs again: a new run under the same parent, which ends FINISHED
    again = stage(store, repo, path, "ppo", grpo, **{"ppo/acc_last10": 0.75, "ppo/val_greedy_pass@1_last": 0.5})
    assert again.parent_id == sft.parent_id and again.run_id != ppo.run_id
    evaluate = stage(store, repo, path, "evaluate", grpo, **{"gain/greedy_pass@1": 0.125})
    parent = client.get_run(sft.parent_id)
    assert parent.info.status == "FINISHED" and parent.info.run_name == f"params of {head(repo)[:7]}"
    # every param of the file, defaults filled in, not only the stage's own (seed)
    assert parent.data.params["algorithm.adv_estimator"] == "grpo"
    assert parent.data.params["sft.steps"] == str(Config().sft.steps)
    assert parent.data.params["ppo.rounds.r1.init"] == "models/sft" and len(parent.data.params) > 150
    assert parent.data.metrics == {"sft/final_loss": 0.5, "r1/ppo/acc_last10": 0.75,
                                   "r1/ppo/val_greedy_pass_at_1_last": 0.5, "gain/greedy_pass_at_1": 0.125}
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{sft.parent_id}'")
    assert sorted(r.info.run_id for r in children) == sorted([sft.run_id, ppo.run_id, again.run_id, evaluate.run_id])
    url = ui_url(store, parent.info.experiment_id)
    assert f"this pipeline's runs are under 'params of {head(repo)[:7]}': {url} (make mlflow-ui)" in printed

    # another configuration is another pipeline; the saved view gains its changed key as a column
    _, opo = write_params(repo, "params.yaml", adv_estimator="opo", gamma=0.5)
    other = stage(store, repo, path, "ppo", opo, **{"ppo/acc_last10": 0.5})
    assert other.parent_id != sft.parent_id
    assert client.get_run(other.parent_id).info.run_name == "adv_estimator=opo, gamma=0.5"
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    view = json.loads(experiment.tags[VIEW_TAG])
    assert view["name"] == "rlcore pipelines"
    assert json.loads(view["state"])["selectedColumns"] == [
        "metrics.`gain/greedy_pass_at_1`", "metrics.`final/greedy_pass_at_1`", "metrics.`sft/greedy_pass_at_1`",
        "params.`algorithm.adv_estimator`", "params.`algorithm.gamma`"]


def test_without_a_pipeline_a_run_has_no_parent(repo, store):
    tracker = open_run(TrackingConfig(uri=store, experiment="pipelines"), stage="compare", params={"seed": 1},
                       root=repo)
    tracker.close()
    run = MlflowClient(store).get_run(tracker.run_id)
    assert tracker.parent_id is None and "mlflow.parentRunId" not in run.data.tags


def test_a_relative_store_is_the_dvc_repository_s_even_from_a_temporary_copy(mlflow_store_dir, tmp_path, monkeypatch):
    """`dvc exp run --temp` and the queue run stages in a copy under .dvc/tmp that is deleted afterwards."""
    monkeypatch.setenv("DVC_ROOT", str(mlflow_store_dir))
    tracker = open_run(TrackingConfig(uri="sqlite:///runs.db", experiment="pipelines"), stage="sft",
                       params={"seed": 1}, root=tmp_path)
    tracker.close()
    assert not (tmp_path / "runs.db").exists()
    assert MlflowClient(f"sqlite:///{mlflow_store_dir / 'runs.db'}").get_run(tracker.run_id).info.status == "FINISHED"


def test_make_mlflow_ui_prints_the_pipelines_view_and_creates_no_store(tmp_path, store, capsys):
    from rlcore.tracking import print_ui_address

    print_ui_address(tmp_path)  # no params.yaml, no mlflow.db: nothing to open, and none is created
    assert "no MLflow store at" in capsys.readouterr().out and not (tmp_path / "mlflow.db").exists()
    experiment = MlflowClient(store).get_experiment_by_name("pipelines")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"tracking": {"uri": store, "experiment": "pipelines"}}))
    print_ui_address(tmp_path)
    address = (f"http://127.0.0.1:5000/#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning"
               "&viewStateShareKey=rlcore-pipelines")
    assert capsys.readouterr().out.strip() == f"the pipelines' runs: {address}"
