"""Rule-based rewards, one function per ``data_source``: the built-in ``rule`` reward function.

Every rule takes ``(solution_str, ground_truth)`` and returns a float in [0, 1];
``compute_score`` picks the rule from the row's ``data_source`` the way verl's
``default_compute_score`` does. The pipeline scores with them through the ``rule`` entry of
``rlcore.rewards.functions.REWARD_FUNCTIONS`` (weight ``reward.rule_weight``), beside your own functions.
"""

from __future__ import annotations

import re
from typing import Callable

from rlcore.data.arithmetic import DATA_SOURCE as ARITHMETIC
from rlcore.data.arithmetic import FILLER as ARITHMETIC_FILLER
from rlcore.data.gsm8k import DATA_SOURCE as GSM8K
from rlcore.registry import Registry
from rlcore.rewards.math_answer import DATA_SOURCE as MATH
from rlcore.rewards.math_answer import math_reward

RewardFn = Callable[[str, str], float]
RULES: Registry[RewardFn] = Registry("data_source rule")

# ASCII digits only: int() would also accept "4_6", "+46" and non-ASCII digits.
_INTEGER_RE = re.compile(r"-?[0-9]+")
_GSM8K_ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
# verl only searches the tail of long responses (the final answer comes last); doing the
# same keeps scores comparable with verl's and bounds regex time on runaway generations.
_GSM8K_TAIL_CHARS = 300


@RULES.register(ARITHMETIC)
def arithmetic_reward(solution_str: str, ground_truth: str) -> float:
    """Scores a bare-integer response, or one with a leading run of filler (long-tailed answers).

    A leading run of the task's filler character (``rlcore.data.arithmetic.FILLER``, ".") is
    dropped before the check, whatever its length and whether or not the problem asked for a
    long answer (the reward cannot tell): ``"....46"`` scores like ``"46"``. Any other prefix,
    or filler mixed with something else, still fails.

    Args:
        solution_str: The model response.
        ground_truth: The correct integer as text.

    Returns:
        1.0 if the stripped response, after its leading filler run, is exactly an integer equal
        to ``ground_truth`` (``"46"``, ``" 46 "`` and ``"...46"`` pass; ``"46abc"``, ``""``,
        ``".#.46"`` and ``". 46"`` do not), else 0.0.
    """
    text = solution_str.strip().lstrip(ARITHMETIC_FILLER)
    if not _INTEGER_RE.fullmatch(text):
        return 0.0
    return 1.0 if int(text) == int(ground_truth) else 0.0


def extract_gsm8k_answer(text: str) -> str | None:
    """Extracts the final answer the strict GSM8K way.

    Args:
        text: A model response.

    Returns:
        The last ``#### N`` match within the final 300 characters, with commas
        removed, or None when there is none.
    """
    matches = _GSM8K_ANSWER_RE.findall(text[-_GSM8K_TAIL_CHARS:])
    return matches[-1].replace(",", "") if matches else None


@RULES.register(GSM8K)
def gsm8k_reward(solution_str: str, ground_truth: str) -> float:
    """Scores a GSM8K response by its ``#### N`` answer.

    Args:
        solution_str: The model response.
        ground_truth: The reference number, commas already removed.

    Returns:
        1.0 if the extracted answer equals ``ground_truth``, else 0.0 (a well-formed
        but wrong answer also gets 0.0, like verl's default ``format_score``).
    """
    return 1.0 if extract_gsm8k_answer(solution_str) == ground_truth else 0.0


RULES.add(MATH, math_reward)


def compute_score(data_source: str, solution_str: str, ground_truth: str) -> float:
    """Scores a response with the reward function registered for ``data_source``.

    Args:
        data_source: The row's ``data_source``.
        solution_str: The model response.
        ground_truth: The row's ``reward_model.ground_truth``.

    Returns:
        The reward.

    Raises:
        KeyError: For an unknown ``data_source``, listing the allowed ones.
    """
    return float(RULES.get(data_source)(solution_str, ground_truth))
