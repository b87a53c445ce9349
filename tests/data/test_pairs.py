"""Preference pairs (rlcore.data.pairs): files in the plain and TRL's conversational forms, a bad pair is one line
naming file, row and field, and the arithmetic task's built-in pairs are a true answer against a typical wrong one."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlcore.data.arithmetic import carry_free_sum
from rlcore.data.pairs import Pair, arithmetic_pairs, read_pairs, typical_wrong
from rlcore.errors import DataError

USER = [{"role": "user", "content": "2+2"}]


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_pairs_as_text_as_messages_and_with_an_implicit_prompt(tmp_path):
    path = jsonl(tmp_path / "p.jsonl", [
        {"prompt": "2+2", "chosen": "4", "rejected": "5", "margin": 2},
        {"prompt": USER, "chosen": [{"role": "assistant", "content": "4"}], "rejected": "22"},
        {"chosen": USER + [{"role": "assistant", "content": "4"}], "rejected": USER + [{"role": "assistant",
                                                                                        "content": "3"}]},
    ])
    assert read_pairs(path) == [Pair(USER, "4", "5", 2.0), Pair(USER, "4", "22", 0.0), Pair(USER, "4", "3", 0.0)]


@pytest.mark.parametrize("record, needle", [
    ({"prompt": "2+2", "chosen": "4"}, "missing field 'rejected'"),
    ({"chosen": "4", "rejected": "5"}, "missing field 'prompt'"),
    ({"chosen": USER + [{"role": "assistant", "content": "4"}],
      "rejected": [{"role": "user", "content": "3+3"}, {"role": "assistant", "content": "6"}]}, "differ only in their last"),
    ({"prompt": "2+2", "chosen": "4", "rejected": "4"}, "are the same answer"),
    ({"prompt": "2+2", "chosen": "4", "rejected": "5", "margin": "big"}, "field 'margin' should be a finite number"),
    ({"prompt": "2+2", "chosen": 4, "rejected": "5"}, "field 'chosen' should be the demonstration text"),
])
def test_a_bad_pair_is_one_line_naming_file_row_and_field(tmp_path, record, needle):
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1", "chosen": "2", "rejected": "3"}, record])
    with pytest.raises(DataError) as info:
        read_pairs(path)
    assert str(info.value).startswith(f"{path}: row 1 (line 2): ") and needle in str(info.value), info.value


def test_typical_wrong_answers_are_never_right_and_usually_the_carry_error_when_there_is_one():
    rng = np.random.default_rng(0)
    carry_free = 0
    for _ in range(2000):
        a, b = (int(x) for x in rng.integers(0, 100, 2))
        wrong = typical_wrong(a, "+", b, rng)
        assert wrong != a + b and wrong >= 0
        if carry_free_sum(a, b) != a + b:
            carry_free += wrong == carry_free_sum(a, b)
    carries = sum(carry_free_sum(a, b) != a + b for a in range(100) for b in range(100)) / 10_000
    assert 0.4 < carry_free / (2000 * carries) < 0.65  # half of the carrying problems (plus chance hits)


def test_built_in_pairs_flip_the_asked_share():
    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}"}], "reward_model": {"ground_truth": str(2 * i)},
             "extra_info": {"question": f"{i}+{i}"}} for i in range(10, 90)] * 25
    config = {"min_digits": 1, "max_digits": 2, "ops": ("+",)}
    pairs = arithmetic_pairs(rows, seed=1, flip_rate=0.25, config=config)
    flipped = np.mean([p["rejected"] == r["reward_model"]["ground_truth"] for p, r in zip(pairs, rows)])
    assert abs(flipped - 0.25) < 0.03 and all(p["chosen"] != p["rejected"] for p in pairs)
