"""The weight-version actor of asynchronous rounds, in a module of its own: Ray's worker process for an actor imports
the module that defines its class, and this one imports nothing heavy (the generator pool's module imports torch
through ``rlcore.protocol``, 3-4 CPU-seconds for a process that only keeps a version number and a reference)."""

from __future__ import annotations


class WeightVersions:
    """The newest published policy: its version and a one-element list holding its object reference (a list,
    so the reference is passed along rather than resolved)."""

    def __init__(self) -> None:
        self.version = -1
        self.ref: list = []

    def publish(self, version: int, ref: list) -> None:
        if version > self.version:
            self.version, self.ref = version, ref

    def newer_than(self, version: int) -> tuple[int, list] | None:
        """``(version, [ref])`` of the newest policy if it is newer than ``version``, else None."""
        return (self.version, self.ref) if self.version > version else None

    def current(self) -> int:
        return self.version
