import pytest

from rlcore.rewards import RULES, compute_score, extract_gsm8k_answer


@pytest.mark.parametrize(
    "response, expected",
    [
        ("46", 1.0),
        (" 46 ", 1.0),
        ("46\n", 1.0),
        ("46abc", 0.0),
        ("", 0.0),
        ("   ", 0.0),
        ("47", 0.0),
        ("4 6", 0.0),
        ("+46", 0.0),
        ("4_6", 0.0),
        ("46.0", 0.0),
        ("The answer is 46", 0.0),
    ],
)
def test_arithmetic_strict(response, expected):
    assert compute_score("arithmetic", response, "46") == expected


def test_arithmetic_negative_and_zero():
    assert compute_score("arithmetic", "-3", "-3") == 1.0
    assert compute_score("arithmetic", "3", "-3") == 0.0
    assert compute_score("arithmetic", "0", "0") == 1.0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the total is 72\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("#### -5", "-5"),
        ("#### 3.5", "3.5"),
        ("first #### 1 then #### 2", "2"),
        ("####72", None),  # verl's strict pattern needs the space
        ("the answer is 72", None),
        ("", None),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


def test_extract_only_looks_at_the_tail():
    # The marker is more than 300 characters from the end, so verl's strict mode misses it.
    assert extract_gsm8k_answer("#### 7" + " filler" * 60) is None
    assert extract_gsm8k_answer("x" * 1000 + "#### 7") == "7"


def test_gsm8k_score():
    assert compute_score("gsm8k", "2 + 3 = 5\n#### 5", "5") == 1.0
    assert compute_score("gsm8k", "#### 1,000", "1000") == 1.0
    assert compute_score("gsm8k", "#### 6", "5") == 0.0
    assert compute_score("gsm8k", "5", "5") == 0.0


def test_unknown_data_source_lists_allowed():
    with pytest.raises(KeyError, match="unknown data_source rule 'mmlu'; allowed: arithmetic, gsm8k, math"):
        compute_score("mmlu", "1", "1")
    assert RULES.names() == ["arithmetic", "gsm8k", "math"]
