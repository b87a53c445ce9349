"""Reward functions of the scoring-cost benchmark (``bench.reward_cost``), as a user writes them in a file."""

from __future__ import annotations

import asyncio
import re
import time

_NUMBER = re.compile(r"\s*-?[0-9]+\s*")


def format_ok(data_source, solution_str, ground_truth, extra_info):
    """1 when the answer is a bare integer: a format reward."""
    return 1.0 if _NUMBER.fullmatch(solution_str) else 0.0


def brevity(data_source, solution_str, ground_truth, extra_info, limit=4):
    """A length penalty with an extra value logged."""
    return {"score": -max(0, len(solution_str) - limit) / 10, "chars": len(solution_str)}


def slow(data_source, solution_str, ground_truth, extra_info):
    """A function that waits 2 ms per sample (a remote check, a sandbox): what parallel processes are for."""
    time.sleep(0.002)
    return 1.0


async def slow_async(data_source, solution_str, ground_truth, extra_info):
    """The same wait, awaited: the scoring process runs many at once."""
    await asyncio.sleep(0.002)
    return 1.0
