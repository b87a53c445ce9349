"""rlcore.compare without DVC: the grid, reading a cell's results, the aggregation over seeds and the differences
against a baseline (worked out by hand; the statistics themselves: tests/test_compare_stats.py), the report, the
report written again from stored results through the command, and the loop over cells against a fake repository
(a failing cell, an invalid one, one read back from an earlier run). The real thing, `dvc exp run` on a tiny
pipeline, is in tests/test_e2e_experiments.py."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from rlcore.compare.grid import Cell, CompareSpec, check_keys, grid_cells, parse_grid
from rlcore.compare.publish import (choose_baseline, current_key, default_baseline, grid_labels,
                                   report_from_results)
from rlcore.compare.report import against_baseline, plot_curves, render_markdown, summarize
from rlcore.compare.results import CellResult, PipelinePaths, cell_metrics, cell_problems
from rlcore.compare.run import run_cells
from rlcore.config import parse_config
from rlcore.errors import ConfigError

from .conftest import REPO_ROOT

PATHS = PipelinePaths(eval_metrics="metrics/eval.json", round_metrics="metrics/ppo_{round}.json",
                      round_plots="plots/ppo_{round}.csv", eval_problems="metrics/eval_problems.csv")


def result(values: dict[str, str], gain: float, pass_k: float, reward: float, s_step: float,
           curve: list[tuple[int, float]], ok: bool = True) -> CellResult:
    r = CellResult(" ".join(f"{k}={v}" for k, v in values.items()), values, "exp")
    if ok:
        r.metrics = {"gain": gain, "pass_at_k": pass_k, "reward": reward, "s_per_step": s_step}
        r.curve = curve
    else:
        r.error = "dvc exp run exited with 2; the last lines:\nppo@r1: error: boom"
    return r


# ----------------------------------------------------------------------------------------------- the grid


def test_parse_grid_and_its_errors():
    assert parse_grid(["algorithm.adv_estimator=grpo, rloo", "seed=1,2,3"]) == {
        "algorithm.adv_estimator": ["grpo", "rloo"], "seed": ["1", "2", "3"]}
    for items, needle in ((["seed"], "expected KEY=V1,V2"), (["seed=1", "seed=2"], "given twice"),
                          (["seed=1,,2"], "an empty value"), (["seed=1,1"], "repeated"), ([], "at least one --grid")):
        with pytest.raises(ConfigError, match=needle):
            parse_grid(items)


def test_cells_put_the_seeds_outermost_and_names_do_not_depend_on_the_grid_order():
    cells = grid_cells({"a.b": ["x", "y"], "seed": ["1", "2"]}, "seed")
    assert [c.label() for c in cells] == ["seed=1 a.b=x", "seed=1 a.b=y", "seed=2 a.b=x", "seed=2 a.b=y"]
    reordered = grid_cells({"seed": ["2", "1"], "a.b": ["y", "x"]}, "seed")
    assert {c.name("cmp") for c in cells} == {c.name("cmp") for c in reordered}
    assert len({c.name("cmp") for c in cells}) == 4 and all(c.name("cmp").startswith("cmp-") for c in cells)


def test_unknown_keys_stop_the_comparison_naming_the_key():
    base = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    check_keys(base, ["algorithm.adv_estimator", "seed", "ppo.rounds.r1.steps", "actor.loss", "ppo.async.max_staleness"])
    with pytest.raises(ConfigError, match="algorithm.adv_estimatr: not a params key; did you mean "
                                          "algorithm.adv_estimator"):
        check_keys(base, ["algorithm.adv_estimatr"])


def test_pipeline_paths_come_from_dvc_yaml():
    assert PipelinePaths.from_dvc_yaml(REPO_ROOT / "dvc.yaml") == PATHS


# ----------------------------------------------------------------------------------------- a cell's results


def test_cell_metrics_read_the_evaluate_and_round_files():
    """Two rounds (3 and 2 steps, validation every 2): the curve starts at r1's initial value, counts steps on
    across rounds; seconds per step is the mean over all five steps; the final round's reward."""
    cfg = parse_config({"ppo": {"rounds": {"r1": {"init": "models/sft", "steps": 3},
                                           "r2": {"init": "models/ppo/r1", "steps": 2}}, "val_every": 2},
                        "evaluate": {"final_round": "r2", "k": 4, "n_samples": 4}})
    files = {
        "metrics/eval.json": json.dumps({"gain/greedy_pass@1": 0.125, "final/pass@4": 0.75, "final/pass@1": 0.5}),
        "metrics/ppo_r1.json": json.dumps({"ppo/val_greedy_pass@1_first": 0.25, "ppo/reward_last10": 0.1}),
        "metrics/ppo_r2.json": json.dumps({"ppo/reward_last10": 0.6}),
        "plots/ppo_r1.csv": "step,timing_s/step,val/greedy_pass@1\n0,1.0,\n1,2.0,0.3\n2,3.0,0.35\n",
        "plots/ppo_r2.csv": "step,timing_s/step,val/greedy_pass@1\n0,4.0,\n1,5.0,0.5\n",
    }
    metrics, curve = cell_metrics(files.__getitem__, PATHS, cfg)
    assert metrics == {"gain": 0.125, "pass_at_k": 0.75, "reward": 0.6, "s_per_step": 3.0}
    assert curve == [(0, 0.25), (2, 0.3), (3, 0.35), (5, 0.5)]


# ---------------------------------------------------------------------------------------------- aggregation


def test_cell_problems_read_the_per_problem_file_and_runs_without_one_give_none():
    files = {"metrics/eval_problems.csv": "problem,sft,final\n0,1,1\n1,0,1\n2,1,0\n"}
    assert cell_problems(files.__getitem__, PATHS) == {"sft": [1, 0, 1], "final": [1, 1, 0]}

    def older_run(path):
        raise FileNotFoundError(path)

    assert cell_problems(older_run, PATHS) is None
    assert cell_problems(files.__getitem__, PipelinePaths("a", "b", "c")) is None


def test_summarize_groups_by_the_non_seed_keys_over_successful_seeds():
    """grpo: seeds 1-3 finished, gains 0.10, 0.20, 0.30 (mean 0.2, std 0.1); rloo: seed 2 failed, gains 0.0 and
    0.4 (mean 0.2, std sqrt(0.08) = 0.2828). Curves: the mean and std at the steps all successful seeds have."""
    results = [
        result({"seed": "1", "alg": "grpo"}, 0.1, 0.5, 0.2, 1.0, [(0, 0.2), (50, 0.3)]),
        result({"seed": "1", "alg": "rloo"}, 0.0, 0.4, 0.1, 2.0, [(0, 0.2), (50, 0.1)]),
        result({"seed": "2", "alg": "grpo"}, 0.2, 0.6, 0.4, 1.2, [(0, 0.2), (50, 0.5)]),
        result({"seed": "2", "alg": "rloo"}, 0, 0, 0, 0, [], ok=False),
        result({"seed": "3", "alg": "grpo"}, 0.3, 0.7, 0.6, 1.4, [(0, 0.2), (50, 0.7), (100, 0.9)]),
        result({"seed": "3", "alg": "rloo"}, 0.4, 0.8, 0.5, 2.2, [(0, 0.2), (50, 0.3)]),
    ]
    groups = summarize(results, ("alg",))
    assert [g.label for g in groups] == ["alg=grpo", "alg=rloo"]
    grpo, rloo = groups
    assert (grpo.ok, len(grpo.cells), rloo.ok, len(rloo.cells)) == (3, 3, 2, 3)
    assert grpo.stats["gain"].mean == pytest.approx(0.2) and grpo.stats["gain"].sd == pytest.approx(0.1)
    assert grpo.stats["s_per_step"].mean == pytest.approx(1.2) and grpo.stats["s_per_step"].sd == pytest.approx(0.2)
    assert rloo.stats["gain"].mean == pytest.approx(0.2) and rloo.stats["gain"].sd == pytest.approx(math.sqrt(0.08))
    # grpo's 95% interval: 0.2 ± t(0.975, 2) 0.1 / sqrt(3) = 0.2 ± 4.3027 * 0.057735 = 0.2 ± 0.2484
    assert grpo.stats["gain"].low == pytest.approx(0.2 - 0.2484, abs=1e-4)
    assert rloo.stats["reward"].n == 2
    # step 100 only in one grpo seed: left out; at step 50 grpo's (0.3, 0.5, 0.7): mean 0.5, std 0.2
    assert [p[0] for p in grpo.curve] == [0, 50]
    assert grpo.curve[1][1] == pytest.approx(0.5) and grpo.curve[1][2] == pytest.approx(0.2) and grpo.curve[1][3] == 3
    assert grpo.curve[0][2] == pytest.approx(0.0)


def test_report_page_and_png():
    results = [result({"seed": "1", "alg": "grpo"}, 0.1, 0.5, 0.2, 1.0, [(0, 0.2), (50, 0.3)]),
               result({"seed": "2", "alg": "grpo"}, 0.2, 0.6, 0.4, 1.2, [(0, 0.2), (50, 0.5)]),
               result({"seed": "1", "alg": "x"}, 0, 0, 0, 0, [], ok=False)]
    groups = summarize(results, ("alg",))
    page = render_markdown("cmp", groups, header={"grid": "alg"}, png="cmp.png", k=8)
    # gains 0.1, 0.2: mean 0.15, sd sqrt(0.005); t(0.975, 1) = 12.7062: ± 12.7062 * sqrt(0.005) / sqrt(2) = 0.6353
    assert "| alg=grpo | 2/2 | +0.150 [-0.485, +0.785] | 0.550 [-0.085, 1.185] | 0.300 [-0.971, 1.571] | " in page
    assert "| alg=x | 0/1 | n/a | n/a | n/a | n/a |" in page
    assert "sampled pass@8" in page and "![held-out greedy pass@1 over RL steps](cmp.png)" in page
    assert "## Failed cells" in page and "ppo@r1: error: boom" in page


def versus_cells() -> list[CellResult]:
    """Four problems per seed. grpo (the baseline): gains 0.25, 0.25, 0; rloo: 1.0, 0.25, 0.25 (differences 0.75,
    0, 0.25); worse: 0.25 below grpo on every seed; one: a single seed finished; none: no seed did. Per-problem
    results for grpo and rloo: the SFT model wrong everywhere, the final models right where the lists say."""
    cells = []
    finals = {"grpo": ([1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]), "rloo": ([1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 1, 0])}
    gains = {"grpo": (0.25, 0.25, 0.0), "rloo": (1.0, 0.25, 0.25), "worse": (0.0, 0.0, -0.25), "one": (0.5, 0, 0),
             "none": (0, 0, 0)}
    for seed in range(3):
        for alg, gain in gains.items():
            ok = alg != "none" and (alg != "one" or seed == 0)
            c = result({"seed": str(seed + 1), "alg": alg}, gain[seed], 0.5, 0.5, 1.0, [], ok=ok)
            if alg in finals:
                c.problems = {"sft": [0, 0, 0, 0], "final": finals[alg][seed]}
            cells.append(c)
    return cells


def test_differences_against_the_baseline_by_hand():
    """rloo - grpo: 0.75, 0, 0.25: mean 1/3, variance 21/144, t = (1/3) / sqrt(21/144 / 3) with 2 degrees of
    freedom, p = 1 - t / sqrt(t^2 + 2); worse: -0.25 on every seed, p = 0. Holm over the two: 0 * 2 and then
    max(0, p * 1): p unchanged. The test split's share for rloo: the per-problem differences (0,1,1,1), (-1,1,0,0),
    (0,0,1,0) have variances 1/4, 2/3, 1/4 over 4 problems: 9/144, 24/144, 9/144, mean 14/144, against the
    variance between seeds 21/144: 2/3."""
    groups = summarize(versus_cells(), ("alg",))
    b = against_baseline(groups, "alg=grpo", "seed", alpha=0.05)
    rows = {v.label: v for v in b.rows}
    assert list(rows) == ["alg=rloo", "alg=worse", "alg=one", "alg=none"]
    t = (1 / 3) / math.sqrt(21 / 144 / 3)
    rloo = rows["alg=rloo"]
    assert rloo.difference.interval.mean == pytest.approx(1 / 3) and rloo.difference.p == pytest.approx(
        1 - t / math.sqrt(t * t + 2))
    assert rloo.p_holm == pytest.approx(rloo.difference.p) and rloo.test_share == pytest.approx(2 / 3)
    worse = rows["alg=worse"]
    assert (worse.difference.p, worse.p_holm, worse.seeds_needed, worse.test_share) == (0.0, 0.0, 2, None)
    assert rows["alg=one"].difference.p is None and rows["alg=one"].p_holm is None
    assert rows["alg=none"].difference is None
    assert [v.label for v in b.significant()] == ["alg=worse"]
    page = render_markdown("cmp", groups, header={}, png=None, k=8, baseline=b)
    assert "## Against `alg=grpo`" in page and "adjusted for the 2 tests by Holm's step-down method" in page
    assert "| alg=worse | 3 | -0.250 [-0.250, -0.250] | < 0.001 | < 0.001 | yes | 2 | n/a |" in page
    assert "| alg=one | 1 | +0.250 | n/a | n/a | n/a | n/a (one seed) | n/a |" in page
    assert "| alg=none | 0 | no seed finished in both |" in page
    assert "**Significant at 0.05 after Holm's correction**: `alg=worse` (-0.250): 1 of 2." in page
    assert "![held-out" not in page  # no curves, no figure


def test_plot_writes_a_png(tmp_path):
    groups = summarize([result({"seed": "1", "alg": "a"}, 0, 0, 0, 0, [(0, 0.2), (50, 0.3)]),
                        result({"seed": "2", "alg": "a"}, 0, 0, 0, 0, [(0, 0.2), (50, 0.5)])], ("alg",))
    path = plot_curves(groups, tmp_path / "c.png", "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


# ------------------------------------------------------------------------------------- the loop over cells


class FakeRepo:
    """The Repository interface over a dict of experiments; a run whose ``-S`` list holds ``fail_on`` exits 2."""

    def __init__(self, files: dict[str, str], existing: dict[str, str] | None = None, fail_on: str = ""):
        self.files, self.exps, self.fail_on = files, dict(existing or {}), fail_on
        self.ran: list[list[str]] = []
        self.restored = 0
        self.removed: list[str] = []

    def experiments(self):
        return dict(self.exps)

    def remove(self, names):
        self.removed += names
        for n in names:
            self.exps.pop(n)

    def restore(self):
        self.restored += 1

    @contextmanager
    def baseline_kept(self):
        try:
            yield
        finally:
            self.restore()

    def run_experiment(self, name, sets, log: Path):
        self.ran.append(sets)
        if self.fail_on in sets:
            log.write_text("Running stage 'ppo@r1':\n" + "noise\n" * 20 + "ppo@r1: error: the cell failed\n")
            return 2, 1.5
        log.write_text("ok\n")
        self.exps[name] = f"rev-{name}"
        return 0, 2.5

    def read(self, rev, path):
        if path not in self.files:  # as git show of a path the commit lacks
            raise FileNotFoundError(f"{path} is not in experiment commit {rev}")
        return self.files[path]


def tiny_files():
    return {"metrics/eval.json": json.dumps({"gain/greedy_pass@1": 0.25, "final/pass@8": 0.5}),
            "metrics/ppo_r1.json": json.dumps({"ppo/reward_last10": 0.75}),
            "plots/ppo_r1.csv": "step,timing_s/step,val/greedy_pass@1\n0,0.5,0.4\n",
            "metrics/eval_problems.csv": "problem,sft,final\n0,0,1\n1,1,1\n"}


def test_the_loop_reports_a_failing_cell_and_goes_on(tmp_path):
    """Cell 1 fails in DVC (its last lines kept), cell 2 has params that cannot load (reported, never run),
    cell 3 runs, cell 4 was run before (read back, not run again). The workspace is restored before each run
    and once at the end."""
    base = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    spec = CompareSpec(name="t", grid={"actor.loss.clip_ratio_c": ["2.0", "0.5", "4.0", "5.0"]}, fixed={})
    cells = grid_cells(spec.grid, "seed")
    repo = FakeRepo(tiny_files(), existing={cells[3].name("t"): "rev-earlier"}, fail_on="actor.loss.clip_ratio_c=2.0")
    results = run_cells(repo, spec, cells, base, PATHS, tmp_path)
    assert [r.ok for r in results] == [False, False, True, True]
    assert "exited with 2" in results[0].error and "ppo@r1: error: the cell failed" in results[0].error
    assert len(results[0].error.splitlines()) == 13  # the line saying so and the last 12 lines of output
    assert results[1].error.startswith("invalid params:") and "greater than 1" in results[1].error
    assert repo.ran == [["actor.loss.clip_ratio_c=2.0"], ["actor.loss.clip_ratio_c=4.0"]]
    assert results[2].metrics == {"gain": 0.25, "pass_at_k": 0.5, "reward": 0.75, "s_per_step": 0.5}
    assert results[2].wall_s == 2.5 and results[2].rev == f"rev-{cells[2].name('t')}"
    assert results[2].problems == {"sft": [0, 1], "final": [1, 1]}
    assert results[3].wall_s is None and results[3].rev == "rev-earlier" and results[3].ok
    assert repo.restored == 3  # before each of the two runs, and at the end


def test_rerun_removes_the_earlier_experiments_first(tmp_path):
    base = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    spec = CompareSpec(name="t", grid={"seed": ["1", "2"]}, fixed={"actor.lr": "0.001"}, rerun=True)
    cells = grid_cells(spec.grid, "seed")
    repo = FakeRepo(tiny_files(), existing={cells[0].name("t"): "old", "unrelated": "x"})
    results = run_cells(repo, spec, cells, base, PATHS, tmp_path)
    assert repo.removed == [cells[0].name("t")] and all(r.ok for r in results)
    assert repo.ran == [["actor.lr=0.001", "seed=1"], ["actor.lr=0.001", "seed=2"]]


# ------------------------------------------------------------------ the baseline, and a report from stored results


def test_a_grid_without_seeds_gives_each_difference_without_a_test():
    cells = [result({"alg": a}, g, 0, 0, 0, []) for a, g in (("grpo", 0.25), ("rloo", 0.5))]
    b = against_baseline(summarize(cells, ("alg",)), "alg=grpo", "seed")
    (rloo,) = b.rows
    assert rloo.difference.interval.mean == 0.25 and rloo.difference.p is None and b.significant() == []


def test_the_default_baseline_is_the_group_that_runs_the_params_own_values():
    base = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())  # algorithm.adv_estimator: grpo, vanilla loss
    cells = [result({"seed": "1", "algorithm.adv_estimator": a}, 0.1, 0, 0, 0, []) for a in ("rloo", "grpo")]
    groups = summarize(cells, ("algorithm.adv_estimator",))
    assert default_baseline(groups, ("algorithm.adv_estimator",), base, {})[0] == "algorithm.adv_estimator=grpo"
    label, why = default_baseline(groups, ("algorithm.adv_estimator",), base, {"algorithm.adv_estimator": "opo"})
    assert label == "algorithm.adv_estimator=rloo" and why.startswith("the first group: none runs")
    labels = grid_labels({"seed": ["1", "2"], "algorithm.adv_estimator": ["rloo", "grpo"]}, "seed")
    assert labels == [g.label for g in groups]
    assert choose_baseline(labels, "rloo") == choose_baseline(labels, "algorithm.adv_estimator=rloo")
    with pytest.raises(ConfigError, match="--baseline 'gae': no such group; expected one of "
                                          "'algorithm.adv_estimator=rloo', 'algorithm.adv_estimator=grpo'"):
        choose_baseline(labels, "gae")
    assert choose_baseline(grid_labels({"a": ["x", "y"], "b": ["1", "2"]}, "seed"), "y,2") == "a=y b=2"


@pytest.mark.parametrize("name", ["estimators", "policy-losses"])
def test_the_committed_comparison_pages_are_what_their_stored_results_write(name, tmp_path, monkeypatch):
    """docs/results/compare-<name>.md and its data, written again by `rlcore compare --from-results` from the
    data as its header says, are the committed files: the policy-loss grid names its key the way rlcore did when it
    ran (actor.policy_loss, today actor.loss.name), and its default baseline is still vanilla, the params' own."""
    monkeypatch.chdir(REPO_ROOT)
    stored = Path("docs/results/data") / f"compare-{name}.json"
    shutil.copy(REPO_ROOT / "docs/results" / f"compare-{name}.png", tmp_path)
    report_from_results(stored, out_dir=tmp_path / "out", docs_dir=tmp_path, params_file=REPO_ROOT / "params.yaml",
                        baseline=None, alpha=0.05)
    page = f"compare-{name}.md"
    assert (tmp_path / page).read_text() == (REPO_ROOT / "docs/results" / page).read_text()
    assert (tmp_path / "data" / stored.name).read_text() == (REPO_ROOT / stored).read_text()
    assert [current_key(k) for k in ("actor.policy_loss", "actor.bypass.rollout_is", "actor.clip_ratio", "actor.lr")] \
        == ["actor.loss.name", "actor.loss.bypass_is", "actor.loss.clip_ratio", "actor.lr"]


def test_rlcore_compare_writes_the_report_again_from_stored_results(tmp_path):
    """`rlcore compare --from-results` on a stored results.json (the cells of the by-hand test above), with
    another baseline: runs nothing, writes the page, its data and the report folder; a file that is not a
    comparison's results stops it in one line."""
    data = {"name": "hand", "command": "rlcore compare ...", "baseline": "abc", "grid": {"seed": ["1", "2", "3"],
            "alg": ["grpo", "rloo", "worse", "one", "none"]}, "fixed": {}, "seed_key": "seed", "wall_s": 1.0, "k": 8,
            "header": {"command": "`rlcore compare ...`"}, "cells": [asdict(c) for c in versus_cells()]}
    stored = tmp_path / "stored.json"
    stored.write_text(json.dumps(data))
    shutil.copy(REPO_ROOT / "params.yaml", tmp_path / "params.yaml")
    cmd = [sys.executable, "-m", "rlcore", "compare", "--from-results", str(stored), "--baseline", "rloo",
           "--docs-dir", "docs"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "docs/compare-hand.md").read_text()
    assert "## Against `alg=rloo`" in page and "(chosen with --baseline)" in page
    assert "| alg=grpo | 3 | -0.333 [" in page  # the by-hand difference, the other way round
    written = json.loads((tmp_path / "docs/data/compare-hand.json").read_text())
    assert written["baseline_group"] == "alg=rloo" and written["cells"] == data["cells"]
    assert (tmp_path / "compare/hand/report.md").read_text() == page
    typo = subprocess.run([sys.executable, "-m", "rlcore", "compare", "--grid", "seed=1,2", "--grid",
                           "algorithm.adv_estimator=grpo,rloo", "--baseline", "gae"], cwd=tmp_path, capture_output=True,
                          text=True)  # stopped before anything runs (this folder is no DVC repository)
    assert typo.returncode == 2 and "--baseline 'gae': no such group" in typo.stderr
    stored.write_text(json.dumps({"name": "x"}))
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 2 and "not a comparison's results.json (no grid, fixed" in proc.stderr
