"""The imperfect demonstrator: carry-free SFT answers, never touching the ground truth."""

import pytest

from rlcore.data.arithmetic import add_demonstrator_errors, arithmetic_rows, carry_free_sum
from rlcore.data.splits import build_splits

CONFIG = {"min_digits": 1, "max_digits": 2, "ops": ("+",)}


@pytest.mark.parametrize("a, b, want", [(58, 67, 15), (99, 1, 90), (5, 5, 0), (12, 34, 46), (8, 3, 1), (0, 0, 0),
                                        (95, 15, 0), (47, 6, 43)])
def test_carry_free_sum_by_hand(a, b, want):
    assert carry_free_sum(a, b) == want


def test_carry_free_sum_is_the_sum_exactly_when_no_column_carries():
    for a in range(100):
        for b in range(100):
            carries = a % 10 + b % 10 >= 10 or a // 10 + b // 10 >= 10
            assert (carry_free_sum(a, b) == a + b) == (not carries), (a, b)


def _carries(row) -> bool:
    a, b = map(int, row["extra_info"]["question"].split("+"))
    return a % 10 + b % 10 >= 10 or a // 10 + b // 10 >= 10


def test_rate_one_changes_every_carrying_demonstration_and_nothing_else():
    rows = arithmetic_rows(300, seed=1, split="sft_train", **CONFIG)
    out, changed = add_demonstrator_errors(rows, 1.0, seed=0)
    assert changed == sum(map(_carries, rows)) > 0
    for before, after in zip(rows, out):
        a, b = map(int, before["extra_info"]["question"].split("+"))
        want = str(carry_free_sum(a, b)) if _carries(before) else before["extra_info"]["answer"]
        assert after["extra_info"]["answer"] == want
        assert after["reward_model"] == before["reward_model"]  # the reward still checks the truth
    assert all(r["extra_info"]["answer"] == r["reward_model"]["ground_truth"] for r in rows)  # input untouched


def test_rate_is_the_share_of_carrying_rows_and_lower_rates_change_a_subset():
    rows = arithmetic_rows(4000, seed=2, split="sft_train", **CONFIG)
    n_carry = sum(map(_carries, rows))
    low, n_low = add_demonstrator_errors(rows, 0.3, seed=5)
    high, n_high = add_demonstrator_errors(rows, 0.6, seed=5)
    # binomial: 4 standard deviations
    for rate, n in ((0.3, n_low), (0.6, n_high)):
        assert abs(n - rate * n_carry) < 4 * (n_carry * rate * (1 - rate)) ** 0.5
    changed = lambda out: {i for i, (r, o) in enumerate(zip(rows, out)) if r != o}  # noqa: E731
    assert changed(low) < changed(high)
    assert add_demonstrator_errors(rows, 0.0, seed=5) == (rows, 0)


def test_bad_rate_fails():
    with pytest.raises(ValueError, match="rate must be in"):
        add_demonstrator_errors([], 1.5, seed=0)


def test_splits_apply_errors_to_sft_only():
    kw = dict(task="arithmetic", seed=3, n_sft=400, n_rl=100, n_test=100, **CONFIG)
    clean, noisy = build_splits(**kw), build_splits(**kw, sft_carry_error_rate=1.0)
    assert noisy["rl_train"] == clean["rl_train"] and noisy["test"] == clean["test"]
    wrong = [r for r in noisy["sft_train"] if r["extra_info"]["answer"] != r["reward_model"]["ground_truth"]]
    assert len(wrong) == sum(map(_carries, clean["sft_train"])) > 0
