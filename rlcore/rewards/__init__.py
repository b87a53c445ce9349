"""Reward functions keyed by a row's ``data_source``."""

from rlcore.rewards.rule import REWARD_FNS, compute_score, extract_gsm8k_answer

__all__ = ["REWARD_FNS", "compute_score", "extract_gsm8k_answer"]
