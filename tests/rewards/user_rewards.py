"""Reward functions as a user writes them: a file the scoring processes import by path (reward.functions).

``faulty`` scores the number a response spells, except for the responses that name a way to fail.
"""

from __future__ import annotations

import asyncio
import os
import time


def faulty(data_source, solution_str, ground_truth, extra_info, bonus=0.0):
    if solution_str == "raise":
        raise ValueError(f"cannot score {solution_str!r}")
    if solution_str == "hang":
        time.sleep(3600)
    if solution_str == "exit":
        os._exit(3)
    if solution_str == "text":
        return "high"
    if solution_str == "nan":
        return float("nan")
    if solution_str == "inf":
        return float("inf")
    if solution_str == "nodict":
        return {"value": 1.0}
    if solution_str == "skip":
        return None
    return {"score": float(solution_str) + bonus, "length": len(solution_str), "label": "ignored: not a number"}


def length(data_source, solution_str, ground_truth, extra_info):
    """Applies to the "words" data_source only."""
    return None if data_source != "words" else len(solution_str) / 10


def lengths_batched(data_sources, solution_strs, ground_truths, extra_infos):
    return [len(s) + (extra["offset"] if "offset" in extra else 0) for s, extra in zip(solution_strs, extra_infos)]


def wrong_length_batched(data_sources, solution_strs, ground_truths, extra_infos):
    return [0.0]


async def slow_async(data_source, solution_str, ground_truth, extra_info):
    await asyncio.sleep(0.3)
    if solution_str == "hang":
        await asyncio.sleep(3600)
    return float(solution_str == ground_truth)


def two_arguments(solution_str, ground_truth):
    return 1.0
