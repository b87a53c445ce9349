"""A generator that takes a known extra time per batch, for the idle-fraction test of asynchronous rounds. In a
module of its own: Ray's generator processes import it by name (the test module would drag pytest along)."""

from __future__ import annotations

import time

from rlcore.workers.generator import GeneratorWorker

DELAY_S = 0.4


class SlowGenerator(GeneratorWorker):
    """Sleeps ``DELAY_S`` before each batch, inside the time ``generate_item`` reports as busy."""

    def _pull_weights(self) -> None:
        time.sleep(DELAY_S)
        super()._pull_weights()
