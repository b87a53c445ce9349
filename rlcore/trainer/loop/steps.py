"""The loop every training stage runs its steps in: SFT, reward-model training and PPO rounds.

:class:`StepLoop` owns what those loops share, so that each stage writes only what its step does:

* resume: the step log of a step checkpoint restored (:meth:`StepLog.restore`) and the steps counted on from it;
* stop on a signal (``rlcore.interrupt.training_loop``): no new step after Ctrl-C/SIGTERM; the steps already
  submitted finish, a checkpoint of the last one is written (when checkpoints are on and it is not the last step
  or saved already), then the stage stops with exit code 130/143;
* step checkpoints (``rlcore.trainer.loop.checkpoint``): ``begin``, the workers' files, the step log flushed to the
  tracker, ``commit`` with the stage's state, in the order of the steps;
* the divergence stop (:func:`~rlcore.trainer.loop.step_log.stop_if_diverged`, one :class:`Divergence` per optimizer the
  step runs), after each step's row is logged and before its checkpoint;
* progress: a bar with the stage's figures of the last step.

A step may be synchronous (a PPO step: its metrics) or submitted ahead (SFT: a :class:`Pending` call on the
ranks, ``ahead`` of them queued while the oldest is logged, each rank running them in order). Checkpoints go into
the same queue, so a checkpoint is committed when the steps before it, and only those, are logged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from rlcore.interrupt import training_loop
from rlcore.protocol import Metrics
from rlcore.trainer.loop.checkpoint import Resume, StepCheckpoints
from rlcore.trainer.loop.step_log import StepLog, stop_if_diverged


class Result(Protocol):
    """What a step or a checkpoint's worker files return: a call on the ranks (``Pending``) or :class:`Done`."""

    def result(self) -> Any: ...


@dataclass(frozen=True)
class Done:
    """A result already computed (a synchronous step's metrics, a checkpoint state written in place)."""

    value: Any = None

    def result(self) -> Any:
        return self.value


@dataclass(frozen=True)
class Divergence:
    """One optimizer's divergence stop: ``{section}/nonfinite_steps`` over ``limit`` in a row ends the stage."""

    section: str
    limit: int
    shown: tuple[str, ...]
    """The metrics the message quotes from the last step that skipped nothing."""
    hint: str


class StepLoop:
    """Steps ``start`` to ``total - 1`` of one stage (module docstring). ``desc`` names the bar; ``postfix`` the
    figures it shows of a step's metrics; ``ahead``: steps submitted before the oldest is logged."""

    def __init__(self, desc: str, total: int, log: StepLog, *, tracker, checkpoints: StepCheckpoints | None = None,
                 resume: Resume | None = None, divergence: Sequence[Divergence] = (), ahead: int = 0,
                 postfix: Callable[[Metrics], dict[str, str]] | None = None):
        self.desc, self.total, self.log, self.tracker = desc, total, log, tracker
        self.checkpoints, self.divergence, self.ahead, self.postfix = checkpoints, divergence, ahead, postfix
        self.start = resume.step if resume is not None else 0
        if resume is not None:
            log.restore(resume.state["log_rows"], to_tracker=not getattr(tracker, "resumed", False))

    def run(self, step: Callable[[int], Result], *, save: Callable[[Path], Result] | None = None,
            state: Callable[[], dict[str, Any]] = dict, on_row: Callable[[], None] | None = None) -> None:
        """Run the steps: ``step(n)`` starts step ``n`` and returns its metrics' :class:`Result`; ``save(folder)``
        writes the workers' part of a checkpoint there (its result: more of the stage's state, or None);
        ``state()``: the stage's own state for a checkpoint besides the step log; ``on_row()`` runs after each
        step's row is logged (before the divergence stop)."""
        log, checkpoints = self.log, self.checkpoints
        queue: deque[tuple[Result, Path | None]] = deque()  # a step (folder None) or a checkpoint
        saved = self.start  # the step of the newest checkpoint
        bar = tqdm(total=self.total, initial=self.start, desc=self.desc, unit="step")

        def checkpoint(done: int) -> None:
            assert checkpoints is not None and save is not None
            folder = checkpoints.begin(done)
            try:
                queue.append((save(folder), folder))
            except Exception as err:
                raise checkpoints.worker_error(folder, err) from err

        def complete(pending: Result, folder: Path | None) -> None:
            nonlocal saved
            if folder is None:
                metrics = pending.result()
                log.log(len(log.rows), metrics)  # (the rows of a resumed checkpoint are its steps before)
                bar.update(1)
                if self.postfix is not None:
                    bar.set_postfix(self.postfix(metrics))
                if on_row is not None:
                    on_row()
                for d in self.divergence:  # after the step's row is kept, before a checkpoint: exit code 3
                    stop_if_diverged(log.rows, d.section, d.limit, d.shown, d.hint)
                return
            assert checkpoints is not None
            try:
                extra = pending.result()
            except Exception as err:
                raise checkpoints.worker_error(folder, err) from err
            log.flush()  # the MLflow run holds every step up to the checkpoint a re-run continues it from
            checkpoints.commit(folder, len(log.rows), {**(extra or {}), **state(), "log_rows": log.rows,
                                                       "run_id": self.tracker.run_id})
            saved = len(log.rows)

        def drain(keep: int) -> None:
            while len(queue) > keep:
                complete(*queue.popleft())

        try:
            with training_loop() as stop:
                for n in range(self.start, self.total):
                    if stop.requested:  # Ctrl-C/SIGTERM: no new steps; the queued ones finish below
                        break
                    queue.append((step(n), None))
                    drain(self.ahead)
                    if checkpoints is not None and save is not None and checkpoints.due(n + 1, self.total):
                        checkpoint(n + 1)  # queued after its step: committed once the steps before it are logged
                        drain(self.ahead)
                drain(0)
                if stop.requested:
                    done = len(log.rows)
                    if (checkpoints is not None and save is not None and checkpoints.save_every > 0
                            and saved < done < self.total):
                        checkpoint(done)
                        drain(0)
                    stop.stop_now()
        finally:
            bar.close()
