"""`rlcore compare` and `dvc exp run` end to end at tiny size, in a scratch copy of the repo after the session's first
`dvc repro` (tests/test_e2e_pipeline.py's, copied): a comparison of two cells, one an example's change and one made to
fail, each experiment one parent row in the MLflow UI with its estimator and gain.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path

import mlflow
import pytest

from tests.test_e2e_pipeline import REPO, first_run, ran_stages, run, stale_stages, workdir  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class RunsTable(HTMLParser):
    """MLflow's runs table (ag-grid) as Chromium left it: {run id: {column id: cell text}} for the rows shown. A
    row's pinned part (name, date) and its scrolled part (metrics, params) are two elements with the same row-id."""

    def __init__(self, html: str):
        super().__init__()
        self.rows: dict[str, dict[str, str]] = {}
        self._depth, self._row, self._cell = 0, None, None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        if tag in VOID_TAGS:
            return
        self._depth += 1
        a = dict(attrs)
        if a.get("role") == "row" and a.get("row-id"):
            self._row = (a["row-id"], self._depth)
            self.rows.setdefault(a["row-id"], {})
        elif a.get("role") == "gridcell" and self._row:
            self._cell = (a.get("col-id"), self._depth)
            self.rows[self._row[0]][self._cell[0]] = ""

    def handle_endtag(self, tag):
        if tag in VOID_TAGS:
            return
        if self._cell and self._cell[1] == self._depth:
            self._cell = None
        if self._row and self._row[1] == self._depth:
            self._row = None
        self._depth -= 1

    def handle_data(self, data):
        if self._cell:
            self.rows[self._row[0]][self._cell[0]] += data


def example_overrides(name: str) -> dict[str, str]:
    """``-S`` values that turn the repository's params.yaml into examples/<name>.yaml (every key it changes)."""
    from rlcore.commands.config import entries, render
    from rlcore.config import Config, load_config

    base = {r["key"]: r["value"] for r in entries(load_config(REPO / "params.yaml"), Config())}
    rows = entries(load_config(REPO / "examples" / f"{name}.yaml"), Config())
    return {r["key"]: render(r["value"]) for r in rows if r["value"] != base[r["key"]]}


@contextmanager
def mlflow_ui(store: Path):
    """`mlflow server` on the store (the UI `make mlflow-ui` serves), on a free port, stopped afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri",
                               f"sqlite:///{store}", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def first_pipeline(client, experiment_id: str) -> tuple:
    """The first `dvc repro`'s parent run in MLflow, holding its five stage runs (returned with it)."""
    first_eval = client.search_runs([experiment_id], "tags.`rlcore.stage` = 'evaluate'",
                                    order_by=["attributes.start_time ASC"])[0]
    first = client.get_run(first_eval.data.tags["mlflow.parentRunId"])
    nested = client.search_runs([experiment_id], f"tags.mlflow.parentRunId = '{first.info.run_id}'")
    assert sorted(r.info.run_name for r in nested) == ["evaluate", "ppo-r1", "ppo-r2", "score", "sft"]
    assert first.info.run_name.startswith("pipeline ") and first.data.params["sft.steps"] == "4"
    return first, nested


def experiment_parent(client, experiment_id: str, exp_name: str, change: tuple[str, str], exp_eval: dict,
                      root: Path, env: dict) -> tuple:
    """The experiment's one parent run in MLflow (named after the experiment and its change, finished, holding
    every param, the commit and the gain evaluate measured) and its stage runs: exactly the stages that ran, the
    evaluate run holding the samples as an MLflow table."""
    key, value = change
    found = client.search_runs([experiment_id], f"tags.`dvc.exp_name` = '{exp_name}' and "
                               "tags.`rlcore.stage` = 'pipeline'")
    assert len(found) == 1
    parent = found[0]
    assert parent.info.run_name == f"{exp_name}: adv_estimator={value}" and parent.info.status == "FINISHED"
    assert parent.data.params[key] == value
    assert parent.data.params["sft.steps"] == "4"  # every param, not only the rounds' own
    assert parent.data.metrics["gain/greedy_pass_at_1"] == pytest.approx(exp_eval["gain/greedy_pass@1"], abs=1e-12)
    assert parent.data.tags["mlflow.source.git.commit"] == run(["git", "rev-parse", "HEAD"], root, env).strip()
    stages = client.search_runs([experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(r.info.run_name for r in stages) == ["evaluate", "ppo-r1", "ppo-r2"]
    evaluate = next(r for r in stages if r.info.run_name == "evaluate")
    logged = json.loads(evaluate.data.tags["mlflow.loggedArtifacts"])
    assert {"path": "eval_samples.json", "type": "table"} in logged
    return parent, stages


def ui_rows(root: Path, experiment_id: str, tmp_path: Path) -> dict[str, dict[str, str]]:
    """The runs table of the view `make mlflow-ui` points at, as headless Chromium renders it (:class:`RunsTable`)."""
    from rlcore.pipeline_run import ui_url

    with mlflow_ui(root / "mlflow.db") as base:
        url = ui_url(f"sqlite:///{root / 'mlflow.db'}", experiment_id, base=base)
        proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                               "--disable-background-networking", "--disable-component-update", "--disable-sync",
                               f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1600,1000",
                               "--virtual-time-budget=20000", "--dump-dom", url],
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return RunsTable(proc.stdout).rows


def test_compare_runs_each_cell_as_an_experiment_one_parent_row_each_in_the_mlflow_ui_and_reports_a_failed_one(
        workdir, first_run, tmp_path):
    """The first `dvc repro` is one parent run holding its five stage runs. Then `rlcore compare` on the tiny
    pipeline, committed as the baseline, runs two cells as `dvc exp run -S ...`:

    * examples/rloo.yaml's one change (``algorithm.adv_estimator: rloo``): DVC finds data, SFT and scoring up to date
      and runs the rounds and evaluate; the report's numbers are its experiment's; in MLflow it is a parent run named
      after the experiment and its change, carrying every param, the commit and the gain evaluate measured, with
      exactly the stages that ran nested under it (the evaluate run holds the samples as an MLflow table);
    * the same with Ray pointed at an address where nothing answers (the baseline's is ``auto``, the session's
      head): DVC re-runs SFT (whose params include ray),
      which stops at once; `dvc exp run` fails and the report names the cell with the last lines of its output.

    `dvc exp show` lists the experiment; the page and PNG land in docs/results; MLflow has the report's run; the
    workspace is the baseline's again, the SFT model the failed cell's run deleted included (nothing for `dvc status`
    to do). The runs table of the view that `make mlflow-ui` points at, opened in headless Chromium, shows both
    pipelines as rows of their own (their stage runs folded under them) with their estimator and gain."""
    root, env = workdir
    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("rlcore")
    first, nested = first_pipeline(client, experiment.experiment_id)

    shutil.copy(REPO / ".gitignore", root / ".gitignore")  # mlflow.db, models, data, checkpoints stay out of git
    git_env = {**env, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@t"}
    run(["git", "add", "-A"], root, git_env)
    run(["git", "commit", "-q", "-m", "baseline"], root, git_env)
    params_before = (root / "params.yaml").read_text()
    overrides = example_overrides("rloo")
    assert overrides == {"algorithm.adv_estimator": "rloo"}
    (key, value), = overrides.items()
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "rlcore", "compare", "--name", "tiny",
                           "--grid", f"{key}={value}", "--grid", "ray.address=auto,127.0.0.1:1"],
                          cwd=root, env=git_env, capture_output=True, text=True, timeout=900)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((root / "compare/tiny/results.json").read_text())
    ok, failed = data["cells"]
    assert ok["error"] is None and ok["values"] == {key: value, "ray.address": "auto"}
    assert "dvc exp run exited with" in failed["error"] and "nothing answers at 127.0.0.1:1" in failed["error"]
    assert ran_stages(Path(ok["log"]).read_text()) == {"check_params", "ppo@r1", "ppo@r2", "evaluate"}
    exp_eval = json.loads(run(["git", "show", f"{ok['rev']}:metrics/eval.json"], root, env))
    exp_r2 = json.loads(run(["git", "show", f"{ok['rev']}:metrics/ppo_r2.json"], root, env))
    assert ok["metrics"]["gain"] == exp_eval["gain/greedy_pass@1"]
    assert ok["metrics"]["pass_at_k"] == exp_eval["final/pass@2"]
    assert ok["metrics"]["reward"] == exp_r2["ppo/reward_last10"]
    assert [p[0] for p in ok["curve"]] == [0, 1, 2, 3]  # r1's initial value, its 2 steps, r2's 1 step
    for model in ("sft", "final"):  # the per-problem results, committed with the experiment
        marks = ok["problems"][model]
        assert len(marks) == exp_eval["test/n_prompts"]
        assert sum(marks) / len(marks) == pytest.approx(exp_eval[f"{model}/greedy_pass@1"])
    shown = run(["dvc", "exp", "show", "--json"], root, env)
    assert ok["experiment"] in shown and failed["experiment"] not in shown
    page = (root / "docs/results/compare-tiny.md").read_text()
    assert "compare-tiny.png" in page and "## Failed cells" in page and "nothing answers at 127.0.0.1:1" in page
    assert (root / "docs/results/compare-tiny.png").read_bytes()[:4] == b"\x89PNG"
    reports = client.search_runs([experiment.experiment_id], "tags.`rlcore.stage` = 'compare'")
    assert [r.data.tags["rlcore.compare"] for r in reports] == ["tiny"]
    assert [r.info.run_name for r in reports] == ["compare-tiny"]
    artifacts = {a.path for a in client.list_artifacts(reports[0].info.run_id)}
    assert {"report.md", "tiny.png", "results.json"} <= artifacts
    assert (root / "params.yaml").read_text() == params_before
    assert run(["git", "status", "--porcelain", "--untracked-files=no"], root, env).strip() == ""
    assert stale_stages(root, env) == set()
    print(f"rlcore compare, 2 cells: {took:.1f} s")

    parent, stages = experiment_parent(client, experiment.experiment_id, ok["experiment"], (key, value), exp_eval,
                                       root, env)
    parents = {first.info.run_id: ("grpo", first.data.metrics["gain/greedy_pass_at_1"], {r.info.run_id for r in nested}),
               parent.info.run_id: (value, exp_eval["gain/greedy_pass@1"], {r.info.run_id for r in stages})}

    if CHROMIUM is None:
        pytest.skip("no chromium binary on PATH (apt-get install chromium): the UI check did not run")
    rows = ui_rows(root, experiment.experiment_id, tmp_path)
    for run_id, (estimator, gain, stage_ids) in parents.items():
        row = rows[run_id]  # a row of its own ...
        assert row["params.`algorithm.adv_estimator`"] == estimator
        assert float(row["metrics.`gain/greedy_pass_at_1`"]) == pytest.approx(gain, abs=5e-4)
        assert not stage_ids & set(rows)  # ... with its stage runs folded under it
