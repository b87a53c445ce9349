"""What a round needs of where its batches come from: a batch source, and the scored batch it hands over.

A source's :meth:`~BatchSource.next` gives the scored batch of a step and the policy version that generated it; the
round (:class:`~rlcore.trainer.round.runner.RoundRunner`) trains on it (:class:`~rlcore.trainer.round.ppo_step.PPOStep`)
and then tells the source the new version (:meth:`~BatchSource.updated`). ``ppo.mode`` picks the source
(:mod:`rlcore.trainer.round.modes`): ``sync``'s is :class:`~rlcore.trainer.round.sync_source.SyncSource` (the
trainer's ranks generate each step's batch with the weights they train), ``async``'s
:class:`~rlcore.trainer.round.async_source.AsyncSource` (generators fill a bounded queue while the trainer trains).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rlcore.controller.worker_group import Pending
from rlcore.protocol import Batch, Metrics


@dataclass
class ScoredBatch:
    """A step's scored batch, the metrics of making it, and the policy version whose weights generated it."""

    batch: Batch
    metrics: Metrics
    version: int
    gen_s: float | None = None
    """Seconds a generator spent on it (asynchronous rounds; the synchronous step's ``timing_s/gen`` says it)."""


class BatchSource(Protocol):
    """What a round needs of its batches' source."""

    prompts: Batch

    def next(self, step: int, version: int, t: Metrics) -> ScoredBatch:
        """The scored batch of ``step`` for a trainer at policy ``version`` (timings into ``t``)."""

    def during_update(self, step: int, pending: Pending) -> None:
        """Runs on the controller while ``step``'s actor update runs on the ranks."""

    def updated(self, step: int, version: int, t: Metrics) -> None:
        """After ``step``'s update: the trainer is at ``version`` now."""

    def step_metrics(self, scored: ScoredBatch, batch: Batch, t: Metrics) -> Metrics:
        """The source's own metrics of a finished step (``t`` holds its timings)."""

    def save_state(self, folder: Path) -> dict[str, Any]: ...

    def load_state(self, folder: Path, state: dict[str, Any]) -> None: ...
