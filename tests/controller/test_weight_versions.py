"""The weight-version actor's bookkeeping, as plain asyncio (Ray runs the same coroutines in the actor's loop)."""

from __future__ import annotations

import asyncio

import pytest

from rlcore.controller.weight_versions import WeightVersions


def test_the_newest_version_is_kept_and_older_ones_only_from_keep_from():
    async def run():
        w = WeightVersions()
        assert await w.newer_than(-1) is None and await w.current() == -1
        await w.publish(0, ["v0"])
        await w.publish(1, ["v1"], keep_from=0)
        await w.publish(2, ["v2"], keep_from=1)
        found = [await w.at(v) for v in range(3)], await w.newer_than(0), await w.newer_than(2)
        await w.publish(3, ["v3"])  # keep_from defaults to the new version: the others are let go
        return found, [await w.at(v) for v in range(4)]

    (at, newer, none), after = asyncio.run(run())
    assert at == [None, (1, ["v1"]), (2, ["v2"])]
    assert newer == (2, ["v2"]) and none is None
    assert after == [None, None, None, (3, ["v3"])]


def test_publishing_an_older_version_than_the_newest_is_refused():
    async def run():
        w = WeightVersions()
        await w.publish(4, ["v4"])
        await w.publish(3, ["v3"])

    with pytest.raises(ValueError, match="policy version 3 published after version 4"):
        asyncio.run(run())


def test_a_waiter_wakes_on_the_first_newer_version_and_not_before():
    async def run():
        w = WeightVersions()
        await w.publish(0, ["v0"])
        waiter = asyncio.ensure_future(w.wait_newer(0))
        await asyncio.sleep(0.01)
        early = waiter.done()
        await w.publish(1, ["v1"])
        got = await asyncio.wait_for(waiter, 5)
        return early, got, await asyncio.wait_for(w.wait_newer(-1), 5)

    early, got, at_once = asyncio.run(run())
    assert not early and got == (1, ["v1"]) and at_once == (1, ["v1"])
