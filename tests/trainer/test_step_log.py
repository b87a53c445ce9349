"""rlcore.trainer.loop.step_log.StepLog: the stage's plot CSV grows a row per step, columns added as they appear."""

from __future__ import annotations

import csv

from rlcore.trainer.loop.step_log import StepLog


class Recorder:
    def __init__(self):
        self.calls = []

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, dict(metrics)))


def test_rows_are_appended_and_a_new_metric_rewrites_the_header(tmp_path):
    path, tracker = tmp_path / "plots" / "ppo.csv", Recorder()
    log = StepLog(tracker, path)
    log.log(0, {"rollout/acc": 0.25})
    log.log(1, {"rollout/acc": 0.5})
    log.log(2, {"rollout/acc": 0.75, "val/greedy_pass@1": 0.4})  # validation metrics appear at some steps only
    log.log(3, {"rollout/acc": 1.0})
    rows = list(csv.DictReader(path.open()))
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]
    assert [r["rollout/acc"] for r in rows] == ["0.25", "0.5", "0.75", "1.0"]
    assert [r["val/greedy_pass@1"] for r in rows] == ["", "", "0.4", ""]
    assert tracker.calls[2] == (2, {"rollout/acc": 0.75, "val/greedy_pass@1": 0.4})
