"""Ctrl-C and SIGTERM during a training loop: stop after the current step, with a step checkpoint.

A stage (``rlcore.stage.frame.stage_errors``) routes SIGINT and SIGTERM to :func:`on_signal`. Outside a training
loop a signal stops the stage at once (``KeyboardInterrupt``, or ``Terminated`` for SIGTERM), so every
``finally`` on the way out runs: worker groups and the placement group released, the MLflow run marked
KILLED. Inside one (``with training_loop() as stop:``) the first signal only asks the loop to stop: the loop
finishes the step in flight, writes a step checkpoint when checkpoints are on, and then raises the same
exception (:meth:`StopRequest.stop_now`); a second signal stops at once. Interrupting the workers mid-step
instead would leave the controller's state and the workers' weights a step apart, which no checkpoint
could hold.
"""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from typing import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt, so every ``finally`` and
    context manager on the way out runs (worker groups stopped, the MLflow run marked KILLED)."""


class StopRequest:
    """Whether a signal asked the running loop to stop (and which)."""

    def __init__(self) -> None:
        self.armed = False
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def stop_now(self) -> None:
        """Raise what the signal would have raised (after the loop saved what it could)."""
        raise Terminated("SIGTERM") if self.signum == signal.SIGTERM else KeyboardInterrupt()


STOP = StopRequest()


def on_signal(signum: int, frame: object) -> None:
    """The SIGINT/SIGTERM handler of a stage."""
    if STOP.armed and STOP.signum is None:
        STOP.signum = signum
        print(f"{signal.Signals(signum).name}: stopping after the current step (with a step checkpoint when "
              "they are on); send it again to stop now", file=sys.stderr, flush=True)
        return
    raise Terminated("SIGTERM") if signum == signal.SIGTERM else KeyboardInterrupt()


@contextmanager
def training_loop() -> Iterator[StopRequest]:
    """Signals arriving inside ask the loop to stop at its next step boundary (module docstring)."""
    STOP.armed, STOP.signum = True, None
    try:
        yield STOP
    finally:
        STOP.armed, STOP.signum = False, None
