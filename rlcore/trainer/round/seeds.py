"""The seeds of a round: the round's own, from its name, and each step's sampling seed, which a synchronous step
and an asynchronous generator's batch for the same step share."""

from __future__ import annotations

import zlib


def round_seed(seed: int, round_name: str) -> int:
    """A round's seed from params.yaml's ``seed`` and its own name only, so adding a round leaves earlier ones
    cached."""
    return seed + zlib.crc32(round_name.encode()) % 100_000


def step_seed(seed: int, step: int, attempt: int = 0) -> int:
    """The sampling seed of a step's batch (``attempt``: DAPO's later tries at the same step) in a round seeded
    ``seed``: the same for the synchronous round and for the asynchronous generators, so ``max_staleness: 0`` gives
    the synchronous round's batches."""
    return seed * 100003 + step * 101 + attempt
