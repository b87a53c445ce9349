"""rlcore.compare.stats against values worked out by hand, published tables and a coverage simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlcore.compare.stats import holm, paired_difference, seeds_needed, split_variance, t_interval


def test_t_interval_by_hand():
    """0.1, 0.2, 0.6: mean 0.3, sd sqrt(0.07); t(0.975, 2 df) = 4.3027 (any t table), half-width
    4.3027 * sqrt(0.07) / sqrt(3) = 0.6572."""
    s = t_interval([0.1, 0.2, 0.6])
    assert s.mean == pytest.approx(0.3) and s.sd == pytest.approx(math.sqrt(0.07)) and s.n == 3
    assert s.low == pytest.approx(0.3 - 0.6572, abs=1e-4) and s.high == pytest.approx(0.3 + 0.6572, abs=1e-4)
    wider = t_interval([0.1, 0.2, 0.6], level=0.99)  # t(0.995, 2) = 9.9248
    assert wider.high - wider.mean == pytest.approx(9.9248 * math.sqrt(0.07 / 3), abs=1e-4)
    one = t_interval([0.4])
    assert (one.mean, one.low, one.high, one.sd, one.n) == (0.4, None, None, None, 1)
    assert t_interval([]) is None


def test_paired_difference_by_hand():
    """Differences 0.05, 0.00, 0.10 (seed 4 only in the group: left out): mean 0.05, sd 0.05, t = sqrt(3) with 2
    degrees of freedom, whose tail has the closed form P(T > t) = (1 - t / sqrt(t^2 + 2)) / 2: two-sided
    p = 1 - sqrt(3 / 5) = 0.2254."""
    d = paired_difference({"1": 0.30, "2": 0.25, "3": 0.20, "4": 0.9}, {"1": 0.25, "2": 0.25, "3": 0.10})
    assert d.seeds == ("1", "2", "3")
    assert d.interval.mean == pytest.approx(0.05) and d.interval.sd == pytest.approx(0.05)
    assert d.p == pytest.approx(1 - math.sqrt(3 / 5))
    assert d.interval.low == pytest.approx(0.05 - 4.3027 * 0.05 / math.sqrt(3), abs=1e-4)


def test_paired_difference_without_spread_or_shared_seeds():
    same = paired_difference({"1": 0.25, "2": 0.5}, {"1": 0.25, "2": 0.5})  # the same figures: nothing to find
    assert same.p == 1.0 and same.interval.mean == 0.0
    shifted = paired_difference({"1": 0.3, "2": 0.6}, {"1": 0.25, "2": 0.55})  # 0.05 on every seed
    assert shifted.p == 0.0
    assert paired_difference({"1": 0.3}, {"1": 0.2}).p is None  # one seed: no test
    assert paired_difference({"1": 0.3}, {"2": 0.2}) is None


def test_holm_on_a_hand_worked_list():
    """Sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04 -> running maximum 0.02, 0.03,
    0.06, 0.06; back in the given order."""
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.6]) == [1.0, 1.0]  # 0.5 * 2 = 1.0 caps the larger one too
    assert holm([0.2]) == [0.2]


def test_seeds_needed_matches_published_power_tables():
    """A one-sample (paired) t test, two-sided, alpha 0.05, power 0.8 (G*Power's table; Cohen 1988): effect sizes
    0.2, 0.5, 0.8, 1.0 standard deviations need 199, 34, 15 and 10."""
    assert [seeds_needed(d, 1.0) for d in (0.2, 0.5, 0.8, 1.0)] == [199, 34, 15, 10]
    assert seeds_needed(-0.05, 0.1) == seeds_needed(0.05, 0.1) == 34  # the size, not the sign, and in units of sd
    assert seeds_needed(0.01, 1.0) == 1001  # more than the search goes
    assert seeds_needed(0.0, 0.1) is None and seeds_needed(0.1, None) is None
    assert seeds_needed(0.1, 0.0) == 2


def test_t_interval_covers_at_its_level_with_three_seeds_where_a_seed_bootstrap_does_not():
    """4000 synthetic comparisons of 3 seeds (differences normal around 0.01, sd 0.02, fixed seed): the 95% t
    interval holds the true difference in 95% of them (binomial sd 0.0034); a percentile bootstrap over the same
    3 seeds in about 75%, which is why the report's tests are t tests over seeds."""
    rng = np.random.default_rng(0)
    d = rng.normal(0.01, 0.02, size=(4000, 3))
    covered = [(s.low <= 0.01 <= s.high) for s in (t_interval(row) for row in d)]
    assert np.mean(covered) == pytest.approx(0.95, abs=0.012)
    boot = d[np.arange(4000)[:, None, None], rng.integers(0, 3, size=(4000, 1000, 3))].mean(axis=2)
    low, high = np.percentile(boot, [2.5, 97.5], axis=1)
    assert 0.70 < np.mean((low <= 0.01) & (0.01 <= high)) < 0.82


def test_split_variance_by_hand():
    """Seed 1: per-problem differences 1, 0, 0, -1 (mean 0, sample variance 2/3, over 4 problems: 1/6); seed 2:
    1, 1, 0, 0 (mean 0.5, variance 1/3, over 4: 1/12); their mean 1/8."""
    group = [[1, 0, 1, 0], [1, 1, 0, 0]]
    base = [[0, 0, 1, 1], [0, 0, 0, 0]]
    assert split_variance(group, base) == pytest.approx(1 / 8)
    for mine, theirs in (([[1, 0]], [[1]]), ([[1]], [[0]])):
        with pytest.raises(ValueError, match="expected the same problems, at least two"):
            split_variance(mine, theirs)
