"""Preference pairs for a reward model: reading them from files, and the built-in pairs of the arithmetic task.

A pairs file (``.jsonl`` or ``.parquet``) has, per row:

* ``prompt``: text (one user message) or chat messages;
* ``chosen`` and ``rejected``: the preferred and the other answer, as text or as chat messages ending with the
  assistant's (TRL's conversational form; without a ``prompt`` column, the messages before the last are the
  prompt, and they must be the same in both);
* ``margin`` (optional): how much better chosen is, subtracted inside the Bradley-Terry loss (Llama 2).

:func:`arithmetic_pairs` writes the default task's: a question, its true sum (chosen) and a typical wrong answer
(rejected): on a problem that carries, usually the carry-free sum the imperfect demonstrator teaches, otherwise
an answer one or ten off, with its digits reversed, or a random number of the same length (:func:`typical_wrong`). A share of the
training pairs (``task.pairs.flip_rate``) have chosen and rejected swapped (label noise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from rlcore.data.arithmetic import carry_free_sum, parse_question
from rlcore.data.files import _demonstration, _messages, _prompt
from rlcore.data.tables import read_records
from rlcore.errors import DataError

PAIR_COLUMNS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    prompt: list[dict[str, str]]
    chosen: str
    rejected: str
    margin: float = 0.0


def _answer(value: Any, where: str, field: str) -> str:
    return _demonstration(value, where, field)


def pair_from(record: Mapping[str, Any], where: str) -> Pair:
    """One :class:`Pair` from a file record, or a :class:`DataError` naming the row and field."""
    for key in ("chosen", "rejected"):
        if record.get(key) is None:
            raise DataError(f"{where}: missing field {key!r}; a pair needs prompt, chosen and rejected")
    if record.get("prompt") is not None:
        prompt = _prompt(record["prompt"], where, "prompt")
    else:  # TRL's implicit prompt: the conversation before each answer
        chosen, rejected = (_messages(record[k], where, k) for k in ("chosen", "rejected"))
        if chosen is None or rejected is None:
            raise DataError(f"{where}: missing field 'prompt' (or give chosen and rejected as chat messages)")
        if chosen[:-1] != rejected[:-1] or len(chosen) < 2:
            raise DataError(f"{where}: without a 'prompt' field, chosen and rejected must be conversations that differ "
                            "only in their last (assistant) message")
        prompt = _prompt(chosen[:-1], where, "chosen")
    margin = record.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or not math.isfinite(margin)):
        raise DataError(f"{where}: field 'margin' should be a finite number, got {margin!r:.40}")
    chosen, rejected = _answer(record["chosen"], where, "chosen"), _answer(record["rejected"], where, "rejected")
    if chosen == rejected:
        raise DataError(f"{where}: fields 'chosen' and 'rejected' are the same answer {chosen!r:.40}")
    return Pair(prompt, chosen, rejected, float(margin or 0.0))


def read_pairs(path: str) -> list[Pair]:
    """Every pair of a ``.jsonl``/``.parquet`` file (see the module docstring)."""
    return [pair_from(record, where) for where, record in read_records(path, what="preference pairs file")]


def typical_wrong(a: int, op: str, b: int, rng: np.random.Generator) -> int:
    """A wrong answer to ``a op b`` of the kind a learner gives (see the module docstring); never the truth: on half
    the problems that carry, the carry-free sum; otherwise, with equal chances, one off, ten off, the digits
    reversed, or a random number of the same length (those that differ from the truth)."""
    truth = {"+": a + b, "-": a - b, "*": a * b}[op]
    if op == "+" and carry_free_sum(a, b) != truth and rng.random() < 0.5:
        return carry_free_sum(a, b)
    digits = str(truth)
    candidates = {truth + 1, truth - 1, truth + 10, truth - 10}
    if len(digits) > 1:
        candidates.add(int(digits[::-1].lstrip("0") or "0"))
    low, high = (0, 9) if len(digits) == 1 else (10 ** (len(digits) - 1), 10 ** len(digits) - 1)
    candidates.add(int(rng.integers(low, high + 1)))
    options = sorted(c for c in candidates if c != truth and c >= 0)
    return options[int(rng.integers(len(options)))]


def arithmetic_pairs(rows: list[dict[str, Any]], *, seed: int, flip_rate: float, config: dict[str, Any]) -> list[dict]:
    """One pair per arithmetic row (its prompt, its true answer, a :func:`typical_wrong` one), as records of a
    pairs file; ``flip_rate`` of them swapped."""
    rng = np.random.default_rng(seed)
    out = []
    for row in rows:
        parsed = parse_question(row["extra_info"]["question"], **config)
        if parsed is None:
            raise ValueError(f"not an arithmetic question of this task: {row['extra_info']['question']!r}")
        truth, wrong = str(row["reward_model"]["ground_truth"]), str(typical_wrong(*parsed, rng))
        chosen, rejected = (wrong, truth) if rng.random() < flip_rate else (truth, wrong)
        out.append({"prompt": row["prompt"], "chosen": chosen, "rejected": rejected})
    return out
