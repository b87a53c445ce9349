"""Rewards: the built-in rules by ``data_source``, your functions from files, and the guarded scoring of both."""

from rlcore.rewards.rule import RULES, compute_score, extract_gsm8k_answer

__all__ = ["RULES", "compute_score", "extract_gsm8k_answer"]
