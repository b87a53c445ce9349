"""The frame of a job on Ray, the same for every stage that trains (SFT, a reward model, a PPO round):

    with training_job(cfg, resume) as job:
        sft = job.start(trained_group(SFTWorker, job.pool, name="sft", timeout_s=..., model=..., optim=...))
        loop.run(...)
        job.save(lambda: sft.group.call(SFTWorker.save, out_dir), f"the SFT model to {out_dir}")

* Ray started (or joined) and the resource pool of the ranks placed (:func:`~rlcore.trainer.loop.pool.start_pool`);
* the job's worker groups started and initialised on the pool (:meth:`TrainingJob.start` of a context manager that
  stops them), and a resumed step checkpoint's state loaded into them;
* the trained model saved (:meth:`TrainingJob.save`): a filesystem error is one line naming the path, a bug keeps
  its traceback (:func:`~rlcore.trainer.loop.checkpoint.write_error`);
* on the way out, whatever happens, the worker groups stopped, then the pool released.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from rlcore.config import Config
from rlcore.controller.resource_pool import ResourcePool
from rlcore.controller.worker_group import WorkerGroup
from rlcore.trainer.loop.checkpoint import Resume, write_error
from rlcore.trainer.loop.pool import start_pool

OUTPUTS_INTACT = "the step checkpoints and the metrics and plots so far are intact"


class Trainee(Protocol):
    """What a job trains, as its worker groups hold it: it continues from a step checkpoint's state (the folder its
    workers wrote into, and the controller's state the step loop saved)."""

    def load_state(self, folder: Path, state: dict[str, Any]) -> None: ...


T = TypeVar("T", bound=Trainee)


@dataclass
class TrainingJob:
    """A stage's job on Ray (module docstring): its resource pool, and what was started on it."""

    pool: ResourcePool
    resume: Resume | None
    _started: ExitStack

    def start(self, trainee: AbstractContextManager[T]) -> T:
        """Enter ``trainee`` (its worker groups started and initialised on :attr:`pool`, stopped when the job ends)
        and, when the stage resumes, load the checkpoint's state into it."""
        started = self._started.enter_context(trainee)
        if self.resume is not None:
            started.load_state(self.resume.folder, self.resume.state)
        return started

    def save(self, save: Callable[[], object], what: str, intact: str = OUTPUTS_INTACT) -> None:
        """Run ``save`` (the workers write the trained model); a filesystem error is one line, ``cannot write
        <what>: <reason> (<intact>)``."""
        try:
            save()
        except Exception as err:
            raise write_error(err, f"cannot write {what}", intact) from err


@contextmanager
def training_job(cfg: Config, resume: Resume | None = None) -> Iterator[TrainingJob]:
    """The job frame (module docstring): what it starts is stopped on the way out, the pool last."""
    with start_pool(cfg) as pool, ExitStack() as started:
        yield TrainingJob(pool, resume, started)


class TrainedWorker(Protocol):
    """A worker class whose ranks train one model and keep its training state (``rlcore.workers.state``)."""

    def init_model(self) -> None: ...

    def load_state(self, folder: str) -> None: ...


W = TypeVar("W", bound=TrainedWorker)


@dataclass
class TrainedGroup(Generic[W]):
    """One worker group that trains one model (SFT, a reward model): its ranks restore a checkpoint's state."""

    group: WorkerGroup[W]

    def load_state(self, folder: Path, state: dict[str, Any]) -> None:
        self.group.call(self.group.worker_cls.load_state, str(folder))


@contextmanager
def trained_group(worker_cls: type[W], pool: ResourcePool, *, name: str, timeout_s: float,
                  **options: Any) -> Iterator[TrainedGroup[W]]:
    """A worker group of ``worker_cls`` on ``pool`` (``options``: its ranks' constructor arguments), its model
    initialised, stopped on the way out."""
    group = WorkerGroup(worker_cls, pool, name=name, timeout_s=timeout_s, **options)
    try:
        group.call(worker_cls.init_model)
        yield TrainedGroup(group)
    finally:
        group.shutdown()
