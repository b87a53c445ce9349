"""The ``math`` data_source: a final answer checked for mathematical equivalence with ``math-verify``.

The response's answer is its last ``\\boxed{...}``, or else its last LaTeX or plain expression (``The answer is
1/2.``); the ground truth may be written either way (``\\frac{1}{2}``, ``0.5``, ``$\\frac12$``). Equivalent forms
score 1 (``1/2``, ``0.5`` and ``\\frac{1}{2}``; ``x+1`` and ``1+x``), anything else 0.

math-verify is HuggingFace's checker (the one TRL and open-r1 use). Its timeouts arm ``signal.alarm``, which
works only on a process's main thread: here it runs in the reward scoring processes
(``rlcore.rewards.guard``), never in a thread, and the gold answer is parsed first, as its documentation
asks. Each parse and the comparison are bounded by ``TIMEOUT_S`` inside the library (an expression that
would take sympy minutes scores 0), and the scoring process's own ``reward.timeout_s`` bounds the rest.
"""

from __future__ import annotations

DATA_SOURCE = "math"
TIMEOUT_S = 5  # math-verify's own limit per parse and per comparison (whole seconds: signal.alarm)


def _gold(ground_truth: str):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    text = ground_truth.strip()
    if "$" not in text and "\\boxed" not in text and "\\(" not in text:
        parsed = parse(f"${text}$", extraction_config=configs, parsing_timeout=TIMEOUT_S)
        if parsed:
            return parsed
    return parse(text, extraction_config=configs, parsing_timeout=TIMEOUT_S)


def math_reward(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response's final answer equals ``ground_truth`` mathematically, else 0.0 (also when either
    cannot be parsed)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold = _gold(ground_truth)
    if not gold:
        return 0.0
    answer = parse(solution_str, extraction_config=[LatexExtractionConfig(boxed_match_priority=0),
                                                    ExprExtractionConfig()], parsing_timeout=TIMEOUT_S)
    if not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=TIMEOUT_S) else 0.0
