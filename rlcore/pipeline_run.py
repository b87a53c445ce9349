"""The parent run in MLflow that groups one pipeline's stage runs (one per `dvc repro` or `dvc exp run`).

Stages are separate processes, so every stage of one pipeline run computes the same key and looks the parent up:

* under ``dvc exp run`` (workspace, ``--temp`` or the queue) the experiment: DVC sets ``DVC_EXP_NAME`` and
  ``DVC_EXP_BASELINE_REV`` for every stage it runs;
* under ``dvc repro`` the git commit and a hash of the whole params file: the same configuration of the same code.

The first stage that runs creates the parent: named after the experiment and the params changed from the commit
(``awned-leks: adv_estimator=rloo``; under ``dvc repro`` the changed params alone), carrying every param, the
commit and, from each stage as it ends, that stage's final metrics. Later stages find it, and so does a stage run
again after a failure: its new run lands under the same parent. A stage DVC skips (up to date, or restored from
its run cache) adds nothing here; its run is under the pipeline that ran it. The parent's status is the last
stage's: RUNNING while one runs, then FINISHED, FAILED or KILLED.

The experiment gets a saved view of the runs table (``rlcore pipelines``: the parents with the held-out gain and
the params that differ between pipelines as columns) and opens on its training runs at :func:`ui_url`.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlcore.config import ConfigError, flatten, load_config, params_hash, parse_config, read_yaml, section_dict

PIPELINE_STAGE = "pipeline"  # the parent's rlcore.stage tag
KEY_TAG = "rlcore.pipeline"
CHANGED_TAG = "rlcore.changed_params"  # "algorithm.adv_estimator=rloo, seed=2"
VIEW_ID = "rlcore-pipelines"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_ID}"  # MLflow 3's saved views of the runs table are experiment tags
VIEW_METRICS = ("gain/greedy_pass_at_1", "final/greedy_pass_at_1", "sft/greedy_pass_at_1")
VIEW_PARAMS = ("algorithm.adv_estimator",)  # always a column; the params that differ between pipelines follow
MAX_VIEW_PARAMS = 12
NAME_CHARS = 120


def pipeline_params(path: str | Path) -> dict[str, Any]:
    """Every section of the params file as plain data, for the pipeline's parent run: a label for comparing
    pipelines; what a stage computes reads only its own sections (rlcore.stage.frame.stage_config)."""
    cfg = load_config(path)
    return section_dict(cfg, tuple(type(cfg).model_fields))


@dataclass(frozen=True)
class PipelineId:
    """What names and finds one pipeline run's parent."""

    key: str
    name: str
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # flat key -> (before, now)
    tags: dict[str, str] = field(default_factory=dict)


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def committed_params(root: Path, rev: str, params_file: str | Path) -> dict[str, Any] | None:
    """The params file as commit ``rev`` has it, defaults filled in (None: no such commit or file, or it does not
    validate any more)."""
    try:
        rel = Path(params_file).resolve().relative_to(Path(root).resolve())
    except ValueError:
        return None
    text = _git(root, "show", f"{rev}:{rel.as_posix()}")
    if text is None:
        return None
    try:
        cfg = parse_config(read_yaml(text) or {}, f"{rev}:{rel}")
    except (ConfigError, yaml.YAMLError):
        return None
    return section_dict(cfg, tuple(type(cfg).model_fields))


def changed_params(now: dict[str, Any], before: dict[str, Any] | None) -> dict[str, tuple[Any, Any]]:
    """Flat keys whose value differs, ``{key: (before, now)}`` in ``now``'s order (a key new or gone counts)."""
    if before is None:
        return {}
    old, new = flatten(before), flatten(now)
    keys = list(new) + [k for k in old if k not in new]
    return {k: (old.get(k), new.get(k)) for k in keys if json.dumps(old.get(k)) != json.dumps(new.get(k))}


def short_changes(changed: dict[str, tuple[Any, Any]], limit: int = NAME_CHARS) -> str:
    """``adv_estimator=rloo, seed=2``: each key by its last part unless two changed keys share it."""
    lasts = [k.rsplit(".", 1)[-1] for k in changed]
    parts = []
    for key, last in zip(changed, lasts):
        value = changed[key][1]
        shown = value if isinstance(value, str) else json.dumps(value)
        parts.append(f"{last if lasts.count(last) == 1 else key}={shown}")
    text = ", ".join(parts)
    return text if len(text) <= limit else text[: limit - 3].rstrip(", ") + "..."


def identify(params: dict[str, Any], root: Path, params_file: str | Path, commit: str) -> PipelineId:
    """The parent of the pipeline run this stage belongs to (see the module's docstring)."""
    exp = os.environ.get("DVC_EXP_NAME")
    baseline = os.environ.get("DVC_EXP_BASELINE_REV") or commit
    before = committed_params(root, baseline, params_file) if baseline != "unknown" else None
    changed = changed_params(params, before)
    summary = short_changes(changed)
    tags = {"mlflow.source.git.commit": commit, "rlcore.params_hash": params_hash(params),
            CHANGED_TAG: ", ".join(f"{k}={json.dumps(v[1])}" for k, v in changed.items())[:5000]}
    if exp:
        tags.update({"dvc.exp_name": exp, "dvc.baseline_rev": baseline})
        return PipelineId(f"exp:{baseline}:{exp}", f"{exp}: {summary}" if summary else exp, changed, tags)
    if summary:
        name = summary
    elif before is not None:
        name = f"params of {commit[:7]}"
    else:  # no commit to compare with (a fresh `git init`)
        name = f"pipeline {tags['rlcore.params_hash']}"
    return PipelineId(f"repro:{commit}:{tags['rlcore.params_hash']}", name, changed, tags)


def note(ident: PipelineId) -> str:
    """The parent's description (Markdown in the MLflow UI)."""
    exp = ident.tags.get("dvc.exp_name")
    head = (f"DVC experiment `{exp}` from commit `{ident.tags['dvc.baseline_rev'][:7]}`" if exp
            else f"`dvc repro` at commit `{ident.tags['mlflow.source.git.commit'][:7]}`")
    lines = [f"{head}. The stage runs it ran are nested below; stages DVC found up to date (or restored from its "
             "run cache) ran under an earlier pipeline."]
    if ident.changed:
        lines += ["", "Params changed from the commit:", ""]
        lines += [f"* `{k}`: `{json.dumps(a)}` -> `{json.dumps(b)}`" for k, (a, b) in ident.changed.items()]
    return "\n".join(lines)


def find_or_create(client, experiment_id: str, ident: PipelineId, params: dict[str, Any]) -> tuple[str, bool]:
    """The parent's run id, and whether this call created it (then with every param, tag and the note)."""
    key = ident.key.replace("'", "\\'")
    found = client.search_runs([experiment_id], filter_string=f"tags.`{KEY_TAG}` = '{key}' and "
                               f"tags.`rlcore.stage` = '{PIPELINE_STAGE}'", max_results=1,
                               order_by=["attributes.start_time DESC"])
    if found:
        return found[0].info.run_id, False
    from mlflow.entities import Param

    tags = {**ident.tags, KEY_TAG: ident.key, "rlcore.stage": PIPELINE_STAGE, "mlflow.note.content": note(ident)}
    run_id = client.create_run(experiment_id, run_name=ident.name, tags=tags).info.run_id
    items = [Param(k, str(v)[:6000]) for k, v in flatten(params).items()]
    for i in range(0, len(items), 100):  # MLflow's batch limit
        client.log_batch(run_id, params=items[i : i + 100])
    return run_id, True


def view_state(changed_keys: list[str]) -> dict[str, Any]:
    """The saved view's state: the runs table with the gain and the params that differ as columns."""
    params = list(dict.fromkeys([*VIEW_PARAMS, *changed_keys]))[:MAX_VIEW_PARAMS]
    columns = [f"metrics.`{m}`" for m in VIEW_METRICS] + [f"params.`{p}`" for p in params]
    return {"searchFilter": "", "orderByKey": "attributes.start_time", "orderByAsc": False, "selectedColumns": columns}


def update_experiment(client, experiment_id: str) -> None:
    """Tag the experiment as model training (MLflow versions that read the tag open it on its runs) and write the
    ``rlcore pipelines`` view with the params every pipeline so far changed."""
    client.set_experiment_tag(experiment_id, "mlflow.experimentKind", "custom_model_development")
    parents = client.search_runs([experiment_id], filter_string=f"tags.`rlcore.stage` = '{PIPELINE_STAGE}'",
                                 max_results=200)
    keys: list[str] = []
    for run in parents:
        keys += [part.split("=", 1)[0] for part in run.data.tags.get(CHANGED_TAG, "").split(", ") if "=" in part]
    created = int(time.time() * 1000)
    old = client.get_experiment(experiment_id).tags.get(VIEW_TAG)
    if old:
        try:
            created = int(json.loads(old)["createdAt"])
        except (ValueError, KeyError, TypeError):
            pass
    envelope = {"name": "rlcore pipelines", "createdAt": created, "updatedAt": int(time.time() * 1000),
                "state": json.dumps(view_state(sorted(set(keys))))}
    client.set_experiment_tag(experiment_id, VIEW_TAG, json.dumps(envelope))


def ui_url(tracking_uri: str, experiment_id: str, run_id: str | None = None,
           base: str = "http://127.0.0.1:5000") -> str:
    """Where the MLflow UI shows the experiment's training runs (``make mlflow-ui`` serves a sqlite store at
    ``base``; a tracking server serves its own UI). MLflow 3.17 opens an experiment on its GenAI overview unless
    the address asks for ``workflowType=machine_learning``; ``viewStateShareKey`` opens the saved view."""
    if tracking_uri.startswith(("http://", "https://")):
        base = tracking_uri.rstrip("/")
    if run_id:
        return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_ID}"

