"""The weight-version actor of asynchronous rounds, in a module of its own: Ray's worker process for an actor imports
the module that defines its class, and this one imports nothing heavy (the generator pool's module imports torch
through ``rlcore.protocol``, 3-4 CPU-seconds for a process that only keeps version numbers and references).

It is an asyncio actor: a generator that takes new weights in the middle of a batch (``ppo.async.partial_rollout``)
keeps one :meth:`WeightVersions.wait_newer` call pending and looks at it between decode steps, so it learns of a new
version without asking again at every step."""

from __future__ import annotations

import asyncio


class WeightVersions:
    """The published policies: each version's one-element list holding its object reference (a list, so the
    reference is passed along rather than resolved). The newest is kept, and the older ones a fixed schedule still
    generates with (``keep_from``); the others are let go, so the object store frees them."""

    def __init__(self) -> None:
        self.refs: dict[int, list] = {}
        self._published = asyncio.Event()  # set (and replaced) at every publish

    def newest(self) -> int:
        return max(self.refs, default=-1)

    async def publish(self, version: int, ref: list, keep_from: int | None = None) -> None:
        """``ref`` is policy ``version``; versions older than ``keep_from`` (default: this one) are let go. An older
        version than the newest published is refused (a bug in the caller)."""
        if version < self.newest():
            raise ValueError(f"policy version {version} published after version {self.newest()}")
        self.refs[version] = ref
        keep_from = version if keep_from is None else min(keep_from, version)
        self.refs = {v: r for v, r in self.refs.items() if v >= keep_from}
        self._published.set()
        self._published = asyncio.Event()

    async def newer_than(self, version: int) -> tuple[int, list] | None:
        """``(version, [ref])`` of the newest policy if it is newer than ``version``, else None."""
        newest = self.newest()
        return (newest, self.refs[newest]) if newest > version else None

    async def at(self, version: int) -> tuple[int, list] | None:
        """``(version, [ref])`` of exactly that version, or None if it was never published or was let go."""
        return (version, self.refs[version]) if version in self.refs else None

    async def wait_newer(self, version: int) -> tuple[int, list]:
        """``(version, [ref])`` of the newest policy as soon as one newer than ``version`` is published."""
        while self.newest() <= version:
            await self._published.wait()
        return await self.newer_than(version)  # type: ignore[return-value]

    async def current(self) -> int:
        return self.newest()
