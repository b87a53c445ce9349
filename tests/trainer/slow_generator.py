"""Generators that take a known extra time, for the idle-fraction and partial-rollout tests of asynchronous rounds. In
a module of its own: Ray's generator processes import it by name (the test module would drag pytest along)."""

from __future__ import annotations

import time

from rlcore.workers.generator import GeneratorWorker, InFlightWeights

DELAY_S = 0.4
STEP_DELAY_S = 0.1


class SlowGenerator(GeneratorWorker):
    """Sleeps ``DELAY_S`` before each batch, inside the time ``generate_item`` reports as busy."""

    def _pull_weights(self, version: int | None = None) -> None:
        time.sleep(DELAY_S)
        super()._pull_weights(version)


class SlowPolls(InFlightWeights):
    """Sleeps ``STEP_DELAY_S`` at each look for newer weights: once per decode step."""

    def poll(self) -> bool:
        time.sleep(STEP_DELAY_S)
        return super().poll()


class SlowStepsGenerator(GeneratorWorker):
    """Decode steps of at least ``STEP_DELAY_S`` (partial rollouts): a batch spans the trainer's update, so a newer
    version comes while it is generated."""

    def init_model(self) -> None:
        super().init_model()
        self.inflight = SlowPolls(self)
