"""A seeded synthetic arithmetic task with exactly checkable answers.

Problems look like ``"37+85"``; the expected response is the bare integer ``"122"``.
Each operand first draws its digit count uniformly from ``[min_digits, max_digits]``
and then a value uniformly among the numbers with that many digits (0-9 count as
1-digit numbers), so short and long operands are equally common whatever the range.

Long-tailed responses (``add_long_tail``): a share of the problems ask for a long answer.
Their question ends with ``LONG_MARKER`` (``"37+85="``) and their demonstration is a run
of ``FILLER`` characters before the number (``"........................122"``); the
ground truth stays the number.
"""

from __future__ import annotations

import re
from typing import Any, Collection

import numpy as np

from rlcore.data.schema import make_row
from rlcore.errors import ConfigError

DATA_SOURCE = "arithmetic"
ABILITY = "math"
ALLOWED_OPS = ("+", "-", "*")

# Marks the question of a problem that asks for a long answer; both characters are in the
# built-in char tokenizer (rlcore.engine.tiny_model) and never occur in a short question.
LONG_MARKER = "="
FILLER = "."

# An optional trailing LONG_MARKER (group 4) marks a long-answer question.
_QUESTION_RE = re.compile(r"(\d+)([+\-*])(\d+)(" + re.escape(LONG_MARKER) + r")?")
# Rejection sampling gives up after this many draws per wanted problem and falls back
# to enumerating what is left; only near-exhausted problem spaces ever get there.
_DRAWS_PER_PROBLEM = 20
# Enumerating more candidates than this would use too much memory to be worth it.
_MAX_ENUMERATION = 5_000_000


def base_question(question: str) -> str:
    """The question without its long-answer marker (``"37+85="`` -> ``"37+85"``); others unchanged."""
    return question.removesuffix(LONG_MARKER)


def _check_config(min_digits: int, max_digits: int, ops: tuple[str, ...]) -> None:
    if min_digits < 1 or max_digits < min_digits:
        raise ValueError(
            f"need 1 <= min_digits <= max_digits, got min_digits={min_digits}, max_digits={max_digits}"
        )
    if not ops or len(set(ops)) != len(ops) or not set(ops) <= set(ALLOWED_OPS):
        raise ValueError(f"ops must be distinct values from {ALLOWED_OPS}, got {tuple(ops)!r}")


def _value_range(digits: int) -> tuple[int, int]:
    """Returns the inclusive range of numbers with ``digits`` digits (0 counts as 1-digit)."""
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return low, 10**digits - 1


def _operand_count(min_digits: int, max_digits: int) -> int:
    low, _ = _value_range(min_digits)
    _, high = _value_range(max_digits)
    return high - low + 1


def count_problems(*, min_digits: int, max_digits: int, ops: tuple[str, ...]) -> int:
    """Counts the distinct questions that can be generated.

    Args:
        min_digits: Fewest digits in an operand.
        max_digits: Most digits in an operand.
        ops: Operators to use.

    Returns:
        The number of distinct question strings: ordered pairs for "+" and "*",
        pairs with ``a >= b`` for "-".
    """
    _check_config(min_digits, max_digits, ops)
    n = _operand_count(min_digits, max_digits)
    per_op = {"+": n * n, "*": n * n, "-": n * (n + 1) // 2}
    return sum(per_op[op] for op in ops)


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def _draw_operand(rng: np.random.Generator, min_digits: int, max_digits: int) -> int:
    digits = int(rng.integers(min_digits, max_digits + 1))
    low, high = _value_range(digits)
    return int(rng.integers(low, high + 1))


def make_problem(
    rng: np.random.Generator, *, min_digits: int, max_digits: int, ops: tuple[str, ...]
) -> tuple[str, int]:
    """Draws one problem.

    Args:
        rng: Source of randomness (``numpy.random.default_rng(seed)``).
        min_digits: Fewest digits in an operand.
        max_digits: Most digits in an operand.
        ops: Operators to choose from uniformly.

    Returns:
        ``(question, answer)``, e.g. ``("37+85", 122)``. For "-" the operands are
        ordered so the answer is never negative.
    """
    _check_config(min_digits, max_digits, ops)
    op = ops[int(rng.integers(len(ops)))]
    a = _draw_operand(rng, min_digits, max_digits)
    b = _draw_operand(rng, min_digits, max_digits)
    if op == "-" and a < b:
        a, b = b, a
    return f"{a}{op}{b}", _apply(a, op, b)


def carry_free_sum(a: int, b: int) -> int:
    """``a + b`` with every carry forgotten: each digit is ``(a_i + b_i) mod 10`` (58+67 -> 15).

    The classic mistake of a learner who adds column by column and never carries; equal
    to ``a + b`` exactly when no column carries."""
    out, place = 0, 1
    while a or b:
        out += (a % 10 + b % 10) % 10 * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def add_demonstrator_errors(rows: list[dict[str, Any]], rate: float, seed: int) -> tuple[list[dict[str, Any]], int]:
    """An imperfect demonstrator: on each "+" problem that carries, with probability ``rate``
    the demonstration (``extra_info.answer``) is the carry-free sum instead of the true sum.

    Only the demonstration changes; ``reward_model.ground_truth`` stays the true answer, so a
    verifiable reward still scores the truth. A long-answer row (``add_long_tail``) keeps its filler
    before the wrong sum. Returns the new rows and how many were changed.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"demonstrator error rate must be in [0, 1], got {rate}")
    rng = np.random.default_rng(seed)
    out, changed = [], 0
    for row in rows:
        parsed = _QUESTION_RE.fullmatch(row["extra_info"]["question"])
        draw = rng.random()  # one draw per row, so the rate does not shift which rows are picked
        if parsed and parsed.group(2) == "+":
            a, b = int(parsed.group(1)), int(parsed.group(3))
            wrong = carry_free_sum(a, b)
            if wrong != a + b and draw < rate:
                answer = row["extra_info"]["answer"]
                filler = answer[: len(answer) - len(answer.lstrip(FILLER))]  # a long demonstration keeps its filler
                row = {**row, "extra_info": {**row["extra_info"], "answer": filler + str(wrong)}}
                changed += 1
        out.append(row)
    return out, changed


def long_answer(answer: str, length: int) -> str:
    """The long demonstration of ``answer``: ``length`` FILLER characters, then the answer."""
    return FILLER * length + answer


def add_long_tail(
    rows: list[dict[str, Any]], frac: float, length: int, seed: int
) -> tuple[list[dict[str, Any]], int]:
    """Long-tailed responses: with probability ``frac`` a row asks for a long answer.

    Such a row's question and prompt get LONG_MARKER appended (``"37+85="``) and its
    demonstration (``extra_info.answer``, whatever it was, e.g. a demonstrator error) becomes
    ``length`` FILLER characters followed by it. ``reward_model.ground_truth`` stays the number.
    One draw per row, so for a given seed a higher ``frac`` marks a superset of the rows.
    Returns the new rows and how many were made long.
    """
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"long-tail fraction must be in [0, 1], got {frac}")
    if length < 1:
        raise ValueError(f"long-tail length must be >= 1, got {length}")
    rng = np.random.default_rng(seed)
    out, changed = [], 0
    for row in rows:
        draw = rng.random()  # one draw per row, so the fraction does not shift which rows are picked
        question = row["extra_info"]["question"]
        if draw < frac and not question.endswith(LONG_MARKER):
            question += LONG_MARKER
            answer = long_answer(row["extra_info"]["answer"], length)
            prompt = [{**m, "content": m["content"] + LONG_MARKER} if m["role"] == "user" else m
                      for m in row["prompt"]]
            row = {**row, "prompt": prompt, "extra_info": {**row["extra_info"], "question": question, "answer": answer}}
            changed += 1
        out.append(row)
    return out, changed


def max_answer_digits(*, max_digits: int, ops: Collection[str]) -> int:
    """Most digits an answer (true or carry-free) can have: ``max_digits`` + 1 for "+",
    2 * ``max_digits`` for "*", ``max_digits`` for "-"."""
    high = 10**max_digits - 1
    return max(len(str(_apply(high, op, 0 if op == "-" else high))) for op in ops)


def parse_question(
    question: str, *, min_digits: int, max_digits: int, ops: tuple[str, ...]
) -> tuple[int, str, int] | None:
    """Parses a question back into ``(a, op, b)`` if this configuration could produce it.

    Args:
        question: Question text such as ``"37+85"`` (or ``"37+85="``: the long-answer marker is ignored).
        min_digits: Fewest digits in an operand.
        max_digits: Most digits in an operand.
        ops: Operators in use.

    Returns:
        ``(a, op, b)``, or None when the text is not a problem of this configuration.
    """
    match = _QUESTION_RE.fullmatch(question)
    if match is None or match.group(2) not in ops:
        return None
    a_text, op, b_text, _ = match.groups()
    low, _ = _value_range(min_digits)
    _, high = _value_range(max_digits)
    for text in (a_text, b_text):
        # A leading zero would make a second spelling of the same number.
        if (len(text) > 1 and text[0] == "0") or not low <= int(text) <= high:
            return None
    a, b = int(a_text), int(b_text)
    if op == "-" and a < b:
        return None
    return a, op, b


def _all_problems(min_digits: int, max_digits: int, ops: tuple[str, ...]):
    """Yields every ``(question, answer)`` of the configuration in a fixed order."""
    low, _ = _value_range(min_digits)
    _, high = _value_range(max_digits)
    for op in ops:
        for a in range(low, high + 1):
            for b in range(low, (a if op == "-" else high) + 1):
                yield f"{a}{op}{b}", _apply(a, op, b)


def _sample_distinct(
    rng: np.random.Generator,
    n: int,
    min_digits: int,
    max_digits: int,
    ops: tuple[str, ...],
    exclude: Collection[str],
) -> dict[str, int]:
    """Draws up to ``n`` distinct problems not in ``exclude`` by rejection sampling."""
    chosen: dict[str, int] = {}
    for _ in range(_DRAWS_PER_PROBLEM * n):
        if len(chosen) == n:
            break
        question, answer = make_problem(rng, min_digits=min_digits, max_digits=max_digits, ops=ops)
        if question not in chosen and question not in exclude:
            chosen[question] = answer
    return chosen


def _fill_by_enumeration(
    rng: np.random.Generator,
    chosen: dict[str, int],
    n: int,
    config: tuple[int, int, tuple[str, ...]],
    exclude: Collection[str],
) -> None:
    """Adds random problems from the full enumeration until ``chosen`` holds ``n``."""
    if count_problems(min_digits=config[0], max_digits=config[1], ops=config[2]) > _MAX_ENUMERATION:
        raise RuntimeError(f"could not draw {n} distinct problems; widen the digit range or ask for fewer")
    rest = [(q, a) for q, a in _all_problems(*config) if q not in chosen and q not in exclude]
    for k in rng.permutation(len(rest))[: n - len(chosen)]:
        question, answer = rest[int(k)]
        chosen[question] = answer


def available_problems(
    *, min_digits: int, max_digits: int, ops: tuple[str, ...], exclude: Collection[str] = frozenset()
) -> int:
    """Counts the problems of a configuration that are not in ``exclude``.

    Args:
        min_digits: Fewest digits in an operand.
        max_digits: Most digits in an operand.
        ops: Operators in use.
        exclude: Questions that may not be produced.

    Returns:
        The number of questions still available.
    """
    total = count_problems(min_digits=min_digits, max_digits=max_digits, ops=ops)
    config = {"min_digits": min_digits, "max_digits": max_digits, "ops": ops}
    # exclude may hold questions of other configurations; only those in this space count.
    # "37+85" and "37+85=" (long-answer marker) are the same problem: count it once.
    taken = len({base_question(q) for q in exclude if parse_question(q, **config) is not None})
    return total - taken


def arithmetic_rows(
    n: int,
    *,
    seed: int,
    min_digits: int,
    max_digits: int,
    ops: tuple[str, ...],
    split: str,
    exclude: Collection[str] = frozenset(),
) -> list[dict[str, Any]]:
    """Generates ``n`` distinct arithmetic problems as schema rows.

    Args:
        n: Number of rows.
        seed: Seed for ``numpy.random.default_rng``; the same seed gives the same rows.
        min_digits: Fewest digits in an operand.
        max_digits: Most digits in an operand.
        ops: Operators, drawn from "+", "-", "*".
        split: Stored in ``extra_info.split``.
        exclude: Questions that must not appear (e.g. the held-out test split); a question with
            the long-answer marker excludes the same problem without it.

    Returns:
        ``n`` rows with distinct questions, none in ``exclude``, indexed 0..n-1.

    Raises:
        ValueError: If the configuration is invalid or fewer than ``n`` problems exist.
    """
    ops = tuple(ops)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    available = available_problems(min_digits=min_digits, max_digits=max_digits, ops=ops, exclude=exclude)
    if n > available:
        total = count_problems(min_digits=min_digits, max_digits=max_digits, ops=ops)
        raise ConfigError(
            f"task: cannot make {n} distinct arithmetic problems with {min_digits}-{max_digits} digit operands "
            f"and ops {ops!r}: only {total} exist, {total - available} of them excluded, {available} left"
        )
    rng = np.random.default_rng(seed)
    exclude = frozenset(base_question(q) for q in exclude)
    chosen = _sample_distinct(rng, n, min_digits, max_digits, ops, exclude)
    if len(chosen) < n:
        _fill_by_enumeration(rng, chosen, n, (min_digits, max_digits, ops), exclude)
    return [_to_row(q, a, split, i) for i, (q, a) in enumerate(chosen.items())]


def _to_row(question: str, answer: int, split: str, index: int) -> dict[str, Any]:
    return make_row(
        data_source=DATA_SOURCE,
        prompt_text=question,
        ability=ABILITY,
        ground_truth=str(answer),
        split=split,
        index=index,
        question=question,
        answer=str(answer),
    )
