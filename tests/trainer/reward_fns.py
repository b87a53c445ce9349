"""Reward functions of the PPO trainer tests, in a module of their own: the reward scoring process
(rlcore.rewards.guard) imports the module of each function it runs, and this one imports only zlib
(the test modules import torch, Ray and transformers: seconds in every scoring process)."""

from __future__ import annotations

import zlib


def hash_reward(text: str, gt: str) -> float:
    """A deterministic, almost tie-free reward of the text."""
    return (zlib.crc32(text.encode()) % 1000) / 1000


def flaky_reward(text: str, gt: str) -> float:
    """The hash reward, but raising on about a quarter of the texts."""
    if zlib.crc32(text.encode()) % 4 == 0:
        raise ValueError(f"cannot score {text!r}")
    return hash_reward(text, gt)
