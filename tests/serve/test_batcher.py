"""The batcher's waits for the agent endpoint (``expected_rows``): how a turn's requests are cut into engine calls."""

from __future__ import annotations

import asyncio
import time

import torch

from rlcore.serve.batcher import Batcher, Sampling


class SlowEngine:
    """An engine whose every call takes ``seconds`` and answers one token per row; it keeps each call's row count."""

    def __init__(self, seconds: float):
        self.seconds, self.calls = seconds, []

    def generate(self, ids, mask, params, generator=None, seeds=None):
        self.calls.append(len(ids))
        time.sleep(self.seconds)
        rows = len(ids)
        return {"responses": torch.ones((rows, 1), dtype=torch.long), "response_mask": torch.ones((rows, 1), dtype=torch.long),
                "log_probs": torch.zeros((rows, 1))}


async def two_agents(batcher: Batcher, late_s: float) -> None:
    """Agent A asks twice in a row; agent B's first request comes ``late_s`` after A's (while A's call runs)."""
    sampling = Sampling(1, 1.0)

    async def a():
        await batcher.generate([[1]], sampling, row_seeds=[1])
        await batcher.generate([[1, 1]], sampling, row_seeds=[2])

    async def b():
        await asyncio.sleep(late_s)
        await batcher.generate([[2]], sampling, row_seeds=[3])

    await batcher.start()
    try:
        await asyncio.gather(a(), b())
    finally:
        await batcher.stop()


def test_a_late_agent_joins_the_next_call_of_the_others_instead_of_taking_turns_with_them():
    """Two running agents; B's first request misses A's first call (it comes after the 50 ms quiet window, during
    the call). When that call ends, B's request waits for A's next one (which A sends at once) and both go in one
    call: two calls, not three (B alone, then A alone, each arriving while the other's call runs)."""
    engine = SlowEngine(0.4)
    batcher = Batcher(engine, device=torch.device("cpu"), pad_token_id=0, max_batch_rows=8, wait_s=1.0,
                      expected_rows=lambda: 2, quiet_s=0.05)
    asyncio.run(two_agents(batcher, late_s=0.2))
    assert engine.calls == [1, 2]


def test_without_expected_rows_a_waiting_request_goes_at_once_when_the_engine_frees():
    """rlcore serve's batcher (no count of running clients): a request that waited during a call starts the next
    call without waiting for more, as before."""
    engine = SlowEngine(0.4)
    batcher = Batcher(engine, device=torch.device("cpu"), pad_token_id=0, max_batch_rows=8, wait_s=0.05)
    asyncio.run(two_agents(batcher, late_s=0.2))
    assert engine.calls == [1, 1, 1]
