"""A training that keeps producing non-finite losses stops: after ``max_nonfinite_steps`` consecutive skipped
optimizer steps the loop raises TrainingDiverged naming the step and the last finite metrics, the rows so far
are kept, and the stage exits with code 3. (The skip itself, on one rank and on two, under ddp and fsdp, is
tested in tests/workers/test_optim.py, tests/workers/test_actor.py, tests/engine/test_data_parallel.py and
tests/trainer/test_ppo_estimators.py.)"""

from __future__ import annotations

import contextlib
import csv
from types import SimpleNamespace

import pytest
import torch

import rlcore.trainer.sft as sft_loop
from rlcore.trainer.loop import job
from rlcore.stage.frame import EXIT_DIVERGED, stage_errors
from rlcore.config import parse_config
from rlcore.controller.decorator import Dispatch, RankPlacement, register
from rlcore.data.arithmetic import arithmetic_rows
from rlcore.data.schema import write_rows
from rlcore.errors import TrainingDiverged
from rlcore.protocol import Batch, Metrics
from rlcore.tracking import NullTracker
from rlcore.trainer.loop.step_log import stop_if_diverged
from rlcore.workers.sft import SFTStepSpec, SFTWorker

SHOWN = ("actor/pg_loss", "actor/grad_norm")
HINT = "lower actor.lr or check the rewards"


def rows(*counts: float | None) -> list[dict[str, float]]:
    """Step rows with ``actor/nonfinite_steps`` = each count (None: the actor did not train that step)."""
    out = []
    for step, n in enumerate(counts):
        row = {"step": step, "rollout/acc": 0.5}
        if n is not None:
            row.update({"actor/nonfinite_steps": n, "actor/pg_loss": -0.125 * (step + 1),
                        "actor/grad_norm": 1.5 if not n else float("nan")})
        out.append(row)
    return out


def test_the_stop_names_the_step_the_count_and_the_last_finite_metrics():
    with pytest.raises(TrainingDiverged) as info:
        stop_if_diverged(rows(0, 0, 2, 1), "actor", 3, SHOWN, HINT)
    assert str(info.value) == (
        "step 3: 3 consecutive optimizer steps skipped for a non-finite loss or gradient norm "
        "(actor.max_nonfinite_steps: 3; last finite at step 1: actor/pg_loss=-0.25, actor/grad_norm=1.5); "
        "lower actor.lr or check the rewards")
    stop_if_diverged(rows(0, 0, 2, 1), "actor", 4, SHOWN, HINT)  # one short of 4


@pytest.mark.parametrize("counts, limit, stops", [
    ((2, 0, 1), 2, False),  # a step that skipped nothing ends the run of skipped steps
    ((1, None, 1), 2, True),  # a step where the actor did not train (critic warm-up) neither counts nor ends it
    ((5, 5, 5), 0, False),  # 0: never stop
    ((0, 1), 1, True),
])
def test_only_consecutive_skipped_steps_count(counts, limit, stops):
    if stops:
        with pytest.raises(TrainingDiverged):
            stop_if_diverged(rows(*counts), "actor", limit, SHOWN, HINT)
    else:
        stop_if_diverged(rows(*counts), "actor", limit, SHOWN, HINT)


def test_without_a_finite_step_before_the_message_says_so():
    with pytest.raises(TrainingDiverged, match=r"^step 1: 2 consecutive .*: 2; no step before them was finite\); "):
        stop_if_diverged(rows(1, 1), "actor", 2, SHOWN, HINT)


def test_a_diverged_stage_is_one_line_and_exit_code_3(capsys):
    with pytest.raises(SystemExit) as info:
        with stage_errors("ppo@r1"):
            raise TrainingDiverged("step 3: 3 consecutive optimizer steps skipped")
    assert info.value.code == EXIT_DIVERGED == 3
    assert capsys.readouterr().err == "ppo@r1: error: step 3: 3 consecutive optimizer steps skipped\n"


NAN_STEPS = (1, 3, 4, 5, 6, 7)  # the SFT steps whose loss the worker below makes NaN


class NanLossSFTWorker(SFTWorker):
    """The real SFT worker, whose token embeddings come out NaN on the steps in NAN_STEPS: the loss and
    every gradient are NaN there."""

    @register(Dispatch.DP_UPDATE)
    def train_step(self, batch: Batch, spec: SFTStepSpec) -> Metrics:
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls - 1 not in NAN_STEPS:
            return super().train_step(batch, spec)
        embeddings = self.model.module.get_input_embeddings()
        hook = embeddings.register_forward_hook(lambda module, inputs, out: torch.full_like(out, float("nan")))
        try:
            return super().train_step(batch, spec)
        finally:
            hook.remove()


class InProcessGroup:
    """A one-rank stand-in for WorkerGroup: the worker lives in this process (no Ray, no process group) and
    each call runs when it is submitted."""

    def __init__(self, worker_cls, pool, *, name: str, timeout_s: float, **kwargs):
        self.worker = worker_cls(RankPlacement(0, 1, torch.get_num_threads()), **kwargs)

    def call(self, method, *args):
        return method(self.worker, *args)

    def submit(self, method, *args):
        result = self.call(method, *args)
        return SimpleNamespace(result=lambda: result)

    def shutdown(self) -> None: ...


def test_sft_stops_at_the_second_consecutive_nan_step_and_keeps_every_row_so_far(
        tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch):
    """NaN at steps 1, 3, 4, ...: step 1 is skipped, step 2 trains and ends that run, steps 3 and 4 are the
    second run of 2 (sft.max_nonfinite_steps): the loop stops at step 4, naming step 2's metrics, and the plot
    CSV holds steps 0 to 4. (The real SFT loop and worker, on one rank in this process.)"""
    monkeypatch.setattr(sft_loop, "SFTWorker", NanLossSFTWorker)
    monkeypatch.setattr(job, "WorkerGroup", InProcessGroup)
    monkeypatch.setattr(job, "start_pool", lambda cfg: contextlib.nullcontext())
    data = tmp_path / "sft.parquet"
    write_rows(arithmetic_rows(n=16, seed=3, split="sft", min_digits=1, max_digits=2, ops=("+",)), data)
    cfg = parse_config({"resources": {"n_workers": 1},
                        "sft": {"steps": 12, "batch_size": 4, "micro_batch_size": 4, "warmup_steps": 3,
                                "max_nonfinite_steps": 2, "save_every": 0}})
    plot = tmp_path / "sft.csv"
    with pytest.raises(TrainingDiverged) as info:
        sft_loop.run_sft(cfg, base_model=tiny_model_dir, tokenizer=tiny_tokenizer, data_path=str(data),
                         out_dir=str(tmp_path / "out"), tracker=NullTracker(), plot_csv=str(plot))
    logged = list(csv.DictReader(plot.open()))
    assert [int(r["step"]) for r in logged] == [0, 1, 2, 3, 4]
    assert [float(r["sft/nonfinite_steps"]) for r in logged] == [0, 1, 0, 1, 1]
    # the skipped step left the warm-up alone: step 2 trains at the learning rate step 1 would have had
    lr = cfg.sft.lr
    assert [float(r["sft/lr"]) for r in logged] == pytest.approx([lr / 3, 2 * lr / 3, 2 * lr / 3, lr, lr])
    last = logged[2]
    assert str(info.value) == (
        f"step 4: 2 consecutive optimizer steps skipped for a non-finite loss or gradient norm "
        f"(sft.max_nonfinite_steps: 2; last finite at step 2: sft/loss={float(last['sft/loss']):.4g}, "
        f"sft/grad_norm={float(last['sft/grad_norm']):.4g}); lower sft.lr or raise sft.warmup_steps")
    assert not (tmp_path / "out").exists()  # no model saved
