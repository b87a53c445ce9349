import re

import numpy as np
import pytest

from rlcore.data import arithmetic
from rlcore.data.arithmetic import arithmetic_rows, count_problems, make_problem
from rlcore.data.schema import validate_rows
from rlcore.data.splits import build_splits

CONFIG = {"min_digits": 1, "max_digits": 2, "ops": ("+", "-", "*")}
QUESTION = re.compile(r"(\d+)([+\-*])(\d+)")


def _questions(rows):
    return [r["extra_info"]["question"] for r in rows]


def _hand_eval(question):
    """Evaluates 'a<op>b' without sharing code with the generator."""
    a, op, b = QUESTION.fullmatch(question).groups()
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_same_seed_same_rows_and_different_seed_differs():
    first = arithmetic_rows(50, seed=7, split="train", **CONFIG)
    again = arithmetic_rows(50, seed=7, split="train", **CONFIG)
    other = arithmetic_rows(50, seed=8, split="train", **CONFIG)
    assert first == again
    assert _questions(first) != _questions(other)


def test_rows_follow_schema_and_answers_are_correct():
    rows = arithmetic_rows(200, seed=0, split="train", **CONFIG)
    validate_rows(rows, "generated")
    for i, row in enumerate(rows):
        question = row["extra_info"]["question"]
        assert row["prompt"] == [{"role": "user", "content": question}]
        assert row["reward_model"]["ground_truth"] == str(_hand_eval(question))
        assert row["extra_info"]["answer"] == row["reward_model"]["ground_truth"]
        assert row["extra_info"]["index"] == i
        assert row["extra_info"]["split"] == "train"
        assert row["data_source"] == "arithmetic" and row["ability"] == "math"


def test_make_problem_known_values():
    question, answer = make_problem(np.random.default_rng(3), min_digits=2, max_digits=2, ops=("*",))
    a, b = question.split("*")
    assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
    assert answer == int(a) * int(b)


def test_no_duplicates_even_when_space_is_exhausted():
    # 1-digit "+" has exactly 10 * 10 = 100 problems; ask for all of them.
    rows = arithmetic_rows(100, seed=1, split="train", min_digits=1, max_digits=1, ops=("+",))
    questions = _questions(rows)
    assert len(set(questions)) == 100
    assert set(questions) == {f"{a}+{b}" for a in range(10) for b in range(10)}


def test_enumeration_fallback_is_seeded_and_distinct(monkeypatch):
    # With no sampling budget every problem comes from the shuffled enumeration.
    monkeypatch.setattr(arithmetic, "_DRAWS_PER_PROBLEM", 0)
    first = arithmetic_rows(30, seed=9, split="train", min_digits=1, max_digits=1, ops=("-",))
    again = arithmetic_rows(30, seed=9, split="train", min_digits=1, max_digits=1, ops=("-",))
    assert first == again
    assert len(set(_questions(first))) == 30
    for row in first:
        assert row["reward_model"]["ground_truth"] == str(_hand_eval(row["extra_info"]["question"]))


def test_exclude_is_respected():
    excluded = frozenset(f"{a}+{b}" for a in range(10) for b in range(5))
    rows = arithmetic_rows(
        50, seed=2, split="train", min_digits=1, max_digits=1, ops=("+",), exclude=excluded
    )
    assert set(_questions(rows)) == {f"{a}+{b}" for a in range(10) for b in range(5, 10)}


def test_subtraction_never_negative():
    rows = arithmetic_rows(300, seed=4, split="train", min_digits=1, max_digits=3, ops=("-",))
    for row in rows:
        a, b = row["extra_info"]["question"].split("-")
        assert int(a) >= int(b)
        assert int(row["reward_model"]["ground_truth"]) >= 0


def test_count_problems_by_hand():
    # 1-digit operands: 0..9 -> 10 values; "+": 100 ordered pairs, "-": 55 pairs with a >= b.
    assert count_problems(min_digits=1, max_digits=1, ops=("+", "-")) == 155
    # 2-digit only: 10..99 -> 90 values; "*": 8100.
    assert count_problems(min_digits=2, max_digits=2, ops=("*",)) == 8100


def test_impossible_count_raises_with_the_count():
    with pytest.raises(ValueError, match=r"cannot make 101 .*only 100 exist"):
        arithmetic_rows(101, seed=0, split="train", min_digits=1, max_digits=1, ops=("+",))


def test_bad_ops_rejected():
    with pytest.raises(ValueError, match="ops must be"):
        arithmetic_rows(1, seed=0, split="train", min_digits=1, max_digits=1, ops=("/",))


def test_splits_disjoint_and_indexed():
    splits = build_splits(task="arithmetic", seed=0, n_sft=300, n_rl=300, n_test=100, **CONFIG)
    sft, rl, test = (set(_questions(splits[k])) for k in ("sft_train", "rl_train", "test"))
    assert (len(sft), len(rl), len(test)) == (300, 300, 100)
    assert not sft & test and not rl & test and not sft & rl
    for name, rows in splits.items():
        assert [r["extra_info"]["split"] for r in rows] == [name] * len(rows)
        assert [r["extra_info"]["index"] for r in rows] == list(range(len(rows)))


def test_small_space_allows_sft_rl_overlap_but_never_test():
    # 100 problems in all: 30 test + 60 sft + 60 rl cannot be disjoint.
    splits = build_splits(
        task="arithmetic", seed=5, n_sft=60, n_rl=60, n_test=30, min_digits=1, max_digits=1, ops=("+",)
    )
    sft, rl, test = (set(_questions(splits[k])) for k in ("sft_train", "rl_train", "test"))
    assert (len(sft), len(rl), len(test)) == (60, 60, 30)
    assert not sft & test and not rl & test
    assert sft & rl


def test_splits_reproducible():
    kwargs = dict(task="arithmetic", n_sft=20, n_rl=20, n_test=20, **CONFIG)
    assert build_splits(seed=3, **kwargs) == build_splits(seed=3, **kwargs)
    assert build_splits(seed=3, **kwargs) != build_splits(seed=4, **kwargs)


def test_unknown_task_lists_allowed():
    with pytest.raises(KeyError, match="allowed: arithmetic, calculator, file, gsm8k"):
        build_splits(task="mnist", seed=0, n_sft=1, n_rl=1, n_test=1, **CONFIG)
