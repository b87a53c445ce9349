"""The step loop every training stage runs in (rlcore.trainer.loop.steps), driven here without Ray: steps and
checkpoints whose results come back in a recorded order, a real StepCheckpoints folder, a stop request, a diverged
optimizer, a resume."""

from __future__ import annotations

import signal

import pytest
import torch

from rlcore.errors import TrainingDiverged
from rlcore.interrupt import STOP, Terminated
from rlcore.tracking import NullTracker
from rlcore.trainer.loop.checkpoint import CONTROLLER_FILE, Resume, StepCheckpoints
from rlcore.trainer.loop.step_log import StepLog
from rlcore.trainer.loop.steps import Divergence, Done, StepLoop


class Call:
    """A call submitted to the ranks: its result is taken later; ``events`` records when each was submitted and
    taken, as the controller sees it."""

    def __init__(self, events: list, name: str, value=None, on_result=None):
        self.events, self.name, self.value, self.on_result = events, name, value, on_result
        events.append(("submit", name))

    def result(self):
        self.events.append(("result", self.name))
        if self.on_result is not None:
            self.on_result()
        return self.value


def checkpoints(tmp_path, save_every: int) -> StepCheckpoints:
    return StepCheckpoints(tmp_path / "ckpt", stage="t", save_every=save_every, keep_last=10, fingerprint={})


def saved_state(ckpt: StepCheckpoints, step: int) -> dict:
    return torch.load(ckpt.folder / f"step_{step:08d}" / CONTROLLER_FILE, weights_only=False)


def test_steps_submitted_ahead_are_logged_in_order_and_a_checkpoint_commits_after_exactly_its_steps(tmp_path):
    events: list = []
    ckpt = checkpoints(tmp_path, save_every=3)
    log = StepLog(NullTracker(), tmp_path / "plot.csv")
    loop = StepLoop("t", 7, log, tracker=NullTracker(), checkpoints=ckpt, ahead=2)
    rows_at_commit = {}

    def save(folder):
        (folder / "weights.bin").write_bytes(b"w")
        return Call(events, f"save{len(events)}", on_result=lambda: rows_at_commit.setdefault(folder.name,
                                                                                              len(log.rows)))

    loop.run(lambda n: Call(events, f"step{n}", {"loss": float(n)}), save=save, state=lambda: {"mine": 1})
    assert [r["step"] for r in log.rows] == list(range(7)) and [r["loss"] for r in log.rows] == list(range(7))
    # never more than two steps (or a step and a checkpoint) queued ahead of the one being taken
    taken = [e[1] for e in events if e[0] == "result"]
    assert taken[:5] == ["step0", "step1", "step2", taken[3], "step3"] and taken[3].startswith("save")
    assert sorted(p.name for p in ckpt.folder.iterdir()) == ["step_00000003", "step_00000006"]
    for step in (3, 6):
        state = saved_state(ckpt, step)
        assert len(state["log_rows"]) == step and state["mine"] == 1 and "weights.bin" in state["files"]
    assert rows_at_commit == {"step_00000003.tmp": 3, "step_00000006.tmp": 6}  # its steps logged, no later one


def test_a_stop_request_finishes_the_queued_steps_checkpoints_the_last_and_stops(tmp_path):
    events: list = []
    ckpt = checkpoints(tmp_path, save_every=100)
    log = StepLog(NullTracker(), None)
    loop = StepLoop("t", 50, log, tracker=NullTracker(), checkpoints=ckpt, ahead=3)

    def step(n):
        if n == 5:
            STOP.signum = signal.SIGTERM  # what the stage's handler does on SIGTERM inside the loop
        return Call(events, f"step{n}", {"loss": 1.0})

    with pytest.raises(Terminated):
        loop.run(step, save=lambda folder: Done({"runner": "state"}))
    assert len(log.rows) == 6  # step 5 was submitted before the stop was seen; nothing after it
    assert saved_state(ckpt, 6)["runner"] == "state"
    assert not STOP.armed and STOP.signum is None


def test_a_diverged_optimizer_stops_after_its_row_is_logged_and_before_its_checkpoint(tmp_path):
    ckpt = checkpoints(tmp_path, save_every=2)
    log = StepLog(NullTracker(), None)
    loop = StepLoop("t", 10, log, tracker=NullTracker(), checkpoints=ckpt,
                    divergence=[Divergence("actor", 2, ("actor/loss",), "lower actor.lr")])
    bad = {2: 1.0, 3: 1.0}
    expected = (r"^step 3: 2 consecutive .*\(actor.max_nonfinite_steps: 2; last finite at step 1: actor/loss=0.5\); "
                r"lower actor.lr$")
    with pytest.raises(TrainingDiverged, match=expected):
        loop.run(lambda n: Done({"actor/loss": 0.5, "actor/nonfinite_steps": bad.get(n, 0.0)}),
                 save=lambda folder: Done())
    assert len(log.rows) == 4
    assert sorted(p.name for p in ckpt.folder.iterdir()) == ["step_00000002"]  # none of the diverged step 4


def test_a_resumed_loop_restores_the_log_and_runs_the_remaining_steps(tmp_path):
    log = StepLog(NullTracker(), tmp_path / "plot.csv")
    resume = Resume(3, tmp_path, {"log_rows": [{"step": i, "loss": 9.0} for i in range(3)]})
    loop = StepLoop("t", 5, log, tracker=NullTracker(), resume=resume)
    started = []
    loop.run(lambda n: started.append(n) or Done({"loss": float(n)}))
    assert loop.start == 3 and started == [3, 4]
    assert [(r["step"], r["loss"]) for r in log.rows] == [(0, 9.0), (1, 9.0), (2, 9.0), (3, 3.0), (4, 4.0)]
    assert (tmp_path / "plot.csv").read_text().splitlines() == ["step,loss", "0,9.0", "1,9.0", "2,9.0", "3,3.0",
                                                                "4,4.0"]
