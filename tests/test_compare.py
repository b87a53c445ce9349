"""rlcore.compare without DVC: the grid, reading a cell's results, the aggregation over seeds (worked out by
hand), the report, and the loop over cells against a fake repository (a failing cell, an invalid one, one read
back from an earlier run). The real thing, `dvc exp run` on a tiny pipeline, is in tests/test_e2e_pipeline.py."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from rlcore.compare.grid import Cell, CompareSpec, check_keys, grid_cells, parse_grid
from rlcore.compare.report import mean_std, plot_curves, render_markdown, summarize
from rlcore.compare.results import CellResult, PipelinePaths, cell_metrics
from rlcore.compare.run import run_cells
from rlcore.config import parse_config
from rlcore.errors import ConfigError

from .conftest import REPO_ROOT

PATHS = PipelinePaths(eval_metrics="metrics/eval.json", round_metrics="metrics/ppo_{round}.json",
                      round_plots="plots/ppo_{round}.csv")


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


def test_mean_and_sample_std_by_hand():
    s = mean_std([0.1, 0.2, 0.6])  # mean 0.3; deviations -0.2, -0.1, 0.3: (0.04 + 0.01 + 0.09) / 2 = 0.07
    assert s.mean == pytest.approx(0.3) and s.std == pytest.approx(math.sqrt(0.07)) and s.n == 3
    one = mean_std([0.4])
    assert (one.mean, one.std, one.n) == (0.4, None, 1)
    assert mean_std([]) is None


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
    assert grpo.stats["gain"].mean == pytest.approx(0.2) and grpo.stats["gain"].std == pytest.approx(0.1)
    assert grpo.stats["s_per_step"].mean == pytest.approx(1.2) and grpo.stats["s_per_step"].std == pytest.approx(0.2)
    assert rloo.stats["gain"].mean == pytest.approx(0.2) and rloo.stats["gain"].std == pytest.approx(math.sqrt(0.08))
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
    # gains 0.1, 0.2: mean 0.15, std sqrt(0.005) = 0.0707
    assert "| alg=grpo | 2/2 | +0.150 ± 0.071 | 0.550 ± 0.071 | 0.300 ± 0.141 | 1.100 ± 0.141 |" in page
    assert "| alg=x | 0/1 | n/a | n/a | n/a | n/a |" in page
    assert "sampled pass@8" in page and "![held-out greedy pass@1 over RL steps](cmp.png)" in page
    assert "## Failed cells" in page and "ppo@r1: error: boom" in page


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
        return self.files[path]


def tiny_files():
    return {"metrics/eval.json": json.dumps({"gain/greedy_pass@1": 0.25, "final/pass@8": 0.5}),
            "metrics/ppo_r1.json": json.dumps({"ppo/reward_last10": 0.75}),
            "plots/ppo_r1.csv": "step,timing_s/step,val/greedy_pass@1\n0,0.5,0.4\n"}


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
