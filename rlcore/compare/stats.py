"""What a comparison's seeds can tell: confidence intervals over seeds, paired differences against a baseline with
Holm's correction, and the seeds a difference of the observed size would need.

Every test here is over seeds. A seed's figure (say the held-out gain of one cell) already holds both sources of
noise a reader cares about: the training's randomness (initialisation, sampling) and the test split's (which
problems happen to be in it), so the spread of those figures over seeds is the whole error, and Student's t
turns it into intervals and tests that are exact for normal errors at any number of seeds. A bootstrap that
resamples seeds cannot do that with the three or so seeds a CPU comparison has: its spread is (n - 1) / n of the
sample's and 3 seeds have only 10 distinct resamples, so its 95% intervals cover the true difference about 75% of
the time (tests/test_compare_stats.py measures it beside the t interval's 95%); resampling each resampled seed's
test problems as well counts the test split's noise twice and still falls short where the training's noise
dominates. Per-problem results, where a run stored them, say how much of the spread between seeds the test split's
sampling explains (:func:`split_variance`): whether more seeds or a bigger test split would narrow an interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

MOST_SEEDS = 1000  # seeds_needed's search stops here: a difference that needs more is not worth seeds


@dataclass(frozen=True)
class Interval:
    """A mean over seeds with its two-sided confidence interval (Student's t with n - 1 degrees of freedom)."""

    mean: float
    low: float | None
    """None with one seed (no spread to measure)."""
    high: float | None
    sd: float | None
    """Sample standard deviation over the seeds (n - 1 in the denominator)."""
    n: int


def t_interval(values: Sequence[float], level: float = 0.95) -> Interval | None:
    """The mean of ``values`` and its ``level`` confidence interval, mean ± t_{(1+level)/2, n-1} sd / sqrt(n);
    None for no values."""
    x = np.asarray(values, dtype=float)
    if len(x) == 0:
        return None
    if len(x) < 2:
        return Interval(float(x[0]), None, None, None, 1)
    sd = float(x.std(ddof=1))
    half = float(stats.t.ppf((1 + level) / 2, len(x) - 1)) * sd / math.sqrt(len(x))
    return Interval(float(x.mean()), float(x.mean()) - half, float(x.mean()) + half, sd, len(x))


@dataclass(frozen=True)
class Difference:
    """A group's figure minus the baseline's, paired by seed."""

    interval: Interval
    """The mean difference and its confidence interval."""
    p: float | None
    """Two-sided p-value of the paired t test (None with one seed)."""
    seeds: tuple[str, ...]
    """The seeds both finished, in order."""


def paired_difference(group: dict[str, float], baseline: dict[str, float], level: float = 0.95) -> Difference | None:
    """``group[seed] - baseline[seed]`` over the seeds both have: its mean, confidence interval and the paired t
    test's p-value (scipy's ``ttest_1samp`` on the differences). Differences equal on every seed have no spread:
    p is 1 when they are all zero (the same figures), 0 otherwise. None when no seed is shared."""
    seeds = tuple(s for s in group if s in baseline)
    if not seeds:
        return None
    d = [group[s] - baseline[s] for s in seeds]
    interval = t_interval(d, level)
    assert interval is not None
    if interval.sd is None:
        return Difference(interval, None, seeds)
    if interval.sd <= 1e-12 * max(1.0, abs(interval.mean)):
        return Difference(interval, 1.0 if abs(interval.mean) <= 1e-12 else 0.0, seeds)
    return Difference(interval, float(stats.ttest_1samp(d, 0.0).pvalue), seeds)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment (Holm 1979): the i-th smallest of m p-values times (m - i + 1), each at least
    the one before it, at most 1. Rejecting where the adjusted p is below alpha keeps the chance of any false
    rejection among the m at most alpha."""
    p = np.asarray(pvalues, dtype=float)
    order = np.argsort(p, kind="stable")
    scaled = p[order] * (len(p) - np.arange(len(p)))
    adjusted = np.minimum(np.maximum.accumulate(scaled), 1.0)
    out = np.empty_like(adjusted)
    out[order] = adjusted
    return [float(v) for v in out]


def t_test_power(effect: float, n: int, alpha: float) -> float:
    """Power of a two-sided one-sample (paired) t test with ``n`` seeds when the true mean difference is ``effect``
    standard deviations: P(|T| > t_{1-alpha/2, n-1}) for T noncentral t with noncentrality effect * sqrt(n)."""
    df, nc = n - 1, abs(effect) * math.sqrt(n)
    crit = float(stats.t.ppf(1 - alpha / 2, df))
    return float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))


def seeds_needed(mean: float, sd: float | None, alpha: float = 0.05, power: float = 0.8) -> int | None:
    """The fewest seeds with which a paired t test at level ``alpha`` finds a true difference of ``mean`` with
    probability ``power``, if the spread between seeds is ``sd``. None when it cannot be said (no spread measured,
    or no difference); 2 for a difference without spread; MOST_SEEDS + 1 for more than MOST_SEEDS."""
    if sd is None or abs(mean) <= 1e-12:
        return None
    if sd <= 1e-12 * abs(mean):
        return 2
    effect = mean / sd
    # upwards from 2: power grows with n, and stays where scipy's noncentral t is accurate (it returns nan far out
    # in the tail, at noncentralities a search from above would meet)
    for n in range(2, MOST_SEEDS + 1):
        if t_test_power(effect, n, alpha) >= power:
            return n
    return MOST_SEEDS + 1


def split_variance(group: Sequence[Sequence[float]], baseline: Sequence[Sequence[float]]) -> float:
    """The part of a paired difference's variance between seeds that the test split's sampling explains.

    ``group[k]`` and ``baseline[k]`` are seed k's per-problem figures over the same test problems, whose mean is
    the seed's figure (for the gain: final model right minus SFT model right, 1, 0 or -1 per problem). Per seed,
    the sample variance over the problems of group minus baseline, divided by the number of problems, is the
    variance of that seed's mean difference that comes from which problems the split holds; the result is its
    mean over the seeds, to set against the variance of the differences between seeds."""
    parts = []
    for mine, theirs in zip(group, baseline, strict=True):
        if len(mine) != len(theirs) or len(mine) < 2:
            raise ValueError(f"per-problem results of {len(mine)} and {len(theirs)} problems: expected the same "
                             "problems, at least two")
        x = np.asarray(mine, dtype=float) - np.asarray(theirs, dtype=float)
        parts.append(float(x.var(ddof=1)) / len(x))
    return float(np.mean(parts))
