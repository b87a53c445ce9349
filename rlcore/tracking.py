"""MLflow tracking with a null tracker, so a logging failure never costs a training result.

Every stage opens one run (``open_run``), tagged with its stage, round, git commit,
a hash of the params it uses and the DVC experiment name, and nested under its pipeline's
parent run (``rlcore.pipeline_run``: one per ``dvc repro`` or ``dvc exp run``, which carries
every param and each stage's final metrics). Every MLflow call is guarded: the first failure
is reported once on stderr and the tracker turns into a null tracker for the rest of the
stage, which carries on and writes its outputs.

A tracker is a context manager: the run ends FINISHED when the block completes, KILLED on
Ctrl-C or SIGTERM, FAILED on any other exception; never left RUNNING::

    with open_run(cfg.tracking, stage="sft", params=params, root=root) as tracker:
        ...
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from rlcore.config import flatten, load_config, params_hash
from rlcore.heap import long_lived
from rlcore.pipeline_run import KEY_TAG, PipelineId, find_or_create, identify, ui_url, update_experiment


def end_status(exc_type: type[BaseException] | None) -> str:
    """The MLflow status of a run whose block ended with ``exc_type`` (None: no exception)."""
    if exc_type is None:
        return "FINISHED"
    return "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"


class _RunContext:
    """``with tracker:`` closes the run with the status the block ended with."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(end_status(exc_type))

    def close(self, status: str = "FINISHED") -> None: ...


class NullTracker(_RunContext):
    """Logs nothing; stands in when tracking is off or broken."""

    run_id: str | None = None
    parent_id: str | None = None
    resumed = False

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def log_final(self, metrics: dict[str, float], prefix: str = "") -> None: ...
    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None: ...
    def log_artifact(self, path: str | Path) -> None: ...
    def close(self, status: str = "FINISHED") -> None: ...


# A tracking server that is down must cost seconds, not minutes: MLflow's defaults (7 retries with exponential
# backoff, a 120 s timeout) held a stage for 250 s before its first step against a closed port.
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


class MlflowTracker(_RunContext):
    """One MLflow run; each call is guarded and degrades to a no-op after a failure.

    Step metrics are buffered and written in batches (``log_batch``) at most every ``flush_s``
    seconds, on 1000 buffered values (MLflow's batch limit) and when the run ends: one sqlite
    write per step cost about 15 ms, a quarter of an SFT step on the default model."""

    MAX_BATCH = 1000

    def __init__(self, uri: str, experiment: str, run_name: str, tags: dict[str, str], flush_s: float = 5.0,
                 run_id: str | None = None, pipeline: tuple[PipelineId, dict[str, Any]] | None = None):
        for key, value in HTTP_LIMITS.items():  # the user's own settings win
            os.environ.setdefault(key, value)
        with long_lived():  # MLflow and its store (for sqlite: SQLAlchemy's models) stay loaded to the end
            import mlflow
            from mlflow.entities import Metric

            mlflow.set_tracking_uri(uri)
            self.experiment_id = mlflow.set_experiment(experiment).experiment_id
        self._mlflow = mlflow
        self._metric = Metric
        self._broken = False
        self._closed = False
        self._buffer: list = []
        self._flush_s = flush_s
        self._last_flush = time.monotonic()
        self._client = mlflow.MlflowClient()
        self.resumed = False
        self.parent_id = None
        if pipeline is not None:
            ident, all_params = pipeline
            self.parent_id = self._join_pipeline(ident, all_params, uri)
            if self.parent_id:
                tags = {**tags, "mlflow.parentRunId": self.parent_id, KEY_TAG: ident.key}
        if run_id is not None:  # a stage resuming from a step checkpoint continues its run
            try:
                self.run_id = mlflow.start_run(run_id=run_id).info.run_id
                self.resumed = True
                return
            except Exception as err:
                print(f"warning: MLflow run {run_id} cannot be continued ({type(err).__name__}: {err}); "
                      "starting a new run", file=sys.stderr)
        self.run_id = mlflow.start_run(run_name=run_name, tags=tags).info.run_id

    def _join_pipeline(self, ident: PipelineId, params: dict[str, Any], uri: str) -> str | None:
        """The pipeline's parent run (created by the first stage that runs), set RUNNING; None if that fails."""
        try:
            parent, created = find_or_create(self._client, self.experiment_id, ident, params)
            if created:
                update_experiment(self._client, self.experiment_id)
                print(f"mlflow: this pipeline's runs are under {ident.name!r}: "
                      f"{ui_url(uri, self.experiment_id)}" + ("" if uri.startswith("http") else " (make mlflow-ui)"))
            else:
                self._client.update_run(parent, status="RUNNING")
            return parent
        except Exception as err:  # the stage's own run still logs
            print(f"warning: MLflow pipeline run unavailable ({type(err).__name__}: {err}); this stage's run is not "
                  "nested under it", file=sys.stderr)
            return None

    def _parent_call(self, what: str, fn: Callable[[], Any]) -> None:
        if self.parent_id is None:
            return
        try:
            fn()
        except Exception as err:
            self.parent_id = None
            print(f"warning: MLflow {what} on the pipeline run failed ({type(err).__name__}: {err})", file=sys.stderr)

    def _guard(self, what: str, fn: Callable[[], Any]) -> None:
        if self._broken:
            return
        try:
            fn()
        except Exception as err:  # tracking must never take training down
            self._broken = True
            print(f"warning: MLflow {what} failed ({type(err).__name__}: {err}); tracking is off for this stage",
                  file=sys.stderr)

    def log_params(self, params: dict[str, Any]) -> None:
        flat = {k: str(v)[:6000] for k, v in flatten(params).items()}
        items = list(flat.items())
        # MLflow caps a batch at 100 params
        for i in range(0, len(items), 100):
            self._guard("log_params", lambda chunk=dict(items[i : i + 100]): self._mlflow.log_params(chunk))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        now_ms = int(time.time() * 1000)
        self._buffer += [self._metric(k.replace("@", "_at_"), float(v), now_ms, step or 0) for k, v in metrics.items()]
        if len(self._buffer) >= self.MAX_BATCH or time.monotonic() - self._last_flush >= self._flush_s:
            self.flush()

    def log_final(self, metrics: dict[str, float], prefix: str = "") -> None:
        """The stage's final metrics: on its run, and on the pipeline's parent run as ``prefix + key``."""
        self.log_metrics(metrics)
        now_ms = int(time.time() * 1000)
        batch = [self._metric(f"{prefix}{k}".replace("@", "_at_"), float(v), now_ms, 0) for k, v in metrics.items()]
        self._parent_call("log_metrics", lambda: self._client.log_batch(self.parent_id, metrics=batch))

    def flush(self) -> None:
        """Write the buffered metrics now."""
        while self._buffer:
            batch, self._buffer = self._buffer[: self.MAX_BATCH], self._buffer[self.MAX_BATCH :]
            self._guard("log_metrics", lambda b=batch: self._client.log_batch(self.run_id, metrics=b))
        self._last_flush = time.monotonic()

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        if rows:
            cols = {k: [r.get(k) for r in rows] for k in rows[0]}
            self._guard("log_table", lambda: self._mlflow.log_table(cols, artifact_file=artifact_file))

    def log_artifact(self, path: str | Path) -> None:
        if Path(path).exists():
            self._guard("log_artifact", lambda: self._mlflow.log_artifact(str(path)))

    def close(self, status: str = "FINISHED") -> None:
        if not self._closed:
            self._closed = True
            self.flush()
            self._guard("end_run", lambda: self._mlflow.end_run(status=status))
            # the pipeline's status is its last stage's (RUNNING again when the next stage starts)
            self._parent_call("end", lambda: self._client.set_terminated(self.parent_id, status=status))


def resolve_uri(uri: str, root: Path) -> str:
    """Make a relative ``sqlite:///file.db`` absolute against ``root`` (the repository)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + str((root / uri[len(prefix):]).resolve())
    return uri


def store_root(root: Path) -> Path:
    """Where a relative store lives: the repository DVC runs the stage for (``DVC_ROOT``; under ``dvc exp run
    --temp`` or the queue the stage runs in a temporary copy that is deleted afterwards), else ``root``."""
    dvc_root = os.environ.get("DVC_ROOT")
    return Path(dvc_root) if dvc_root and Path(dvc_root).is_dir() else root


def git_commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_tags(stage: str, params: dict[str, Any], root: Path, round_name: str | None = None) -> dict[str, str]:
    tags = {
        "rlcore.stage": stage,
        "rlcore.params_hash": params_hash(params),
        "mlflow.source.git.commit": git_commit(root),
    }
    if round_name is not None:
        tags["rlcore.round"] = round_name
    if os.environ.get("DVC_EXP_NAME"):
        tags["dvc.exp_name"] = os.environ["DVC_EXP_NAME"]
    if os.environ.get("DVC_EXP_BASELINE_REV"):
        tags["dvc.baseline_rev"] = os.environ["DVC_EXP_BASELINE_REV"]
    return tags


def open_run(tracking_cfg, *, stage: str, params: dict[str, Any], root: Path,
             round_name: str | None = None, run_id: str | None = None, run_name: str | None = None,
             extra_tags: dict[str, str] | None = None, pipeline: dict[str, Any] | None = None,
             params_file: str | Path = "params.yaml") -> MlflowTracker | NullTracker:
    """Start the stage's run and log its params (or continue run ``run_id``, a resumed stage's, whose params
    are logged already); a null tracker when off or unreachable. ``run_name`` defaults to the stage's name (and
    round's); ``extra_tags`` are set beside the standard ones. ``pipeline``, the whole params file ``params_file``
    as plain data, nests the run under its pipeline's parent run (``rlcore.pipeline_run``)."""
    if not tracking_cfg.enabled:
        return NullTracker()
    run_name = run_name or (f"{stage}-{round_name}" if round_name else stage)
    try:
        tags = {**run_tags(stage, params, root, round_name), **(extra_tags or {})}
        ident = identify(pipeline, root, params_file, tags["mlflow.source.git.commit"]) if pipeline else None
        tracker = MlflowTracker(resolve_uri(tracking_cfg.uri, store_root(root)), tracking_cfg.experiment, run_name,
                                tags, run_id=run_id, pipeline=(ident, pipeline) if ident and pipeline else None)
    except Exception as err:
        print(f"warning: MLflow unavailable at {tracking_cfg.uri} ({type(err).__name__}: {err}); "
              "continuing without tracking", file=sys.stderr)
        return NullTracker()
    if not tracker.resumed:
        tracker.log_params(params)
    return tracker


def print_ui_address(root: str | Path, base: str = "http://127.0.0.1:5000") -> None:
    """``make mlflow-ui``: print where the pipelines' table will be, for the store and experiment params.yaml
    names (nothing when the experiment has no runs yet)."""
    import mlflow

    root = Path(root)
    params = root / "params.yaml"
    tracking = load_config(params).tracking if params.is_file() else None
    uri = resolve_uri(tracking.uri if tracking else "sqlite:///mlflow.db", root)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        print(f"no MLflow store at {uri} yet (make run)")  # opening one would create it
        return
    experiment = mlflow.MlflowClient(uri).get_experiment_by_name(tracking.experiment if tracking else "rlcore")
    if experiment is None:
        print(f"no experiment in {uri} yet (make run)")
    else:
        print(f"the pipelines' runs: {ui_url(uri, experiment.experiment_id, base=base)}")
