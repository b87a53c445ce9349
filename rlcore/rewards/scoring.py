"""Scoring a batch with every reward function, guarded, and combining them into the training reward.

    scorer = RewardScorer.from_config(cfg.reward)
    rewards = scorer.score(samples, what="ppo step 3", model=model_scores)
    rewards.total      # [n] the weighted sum: the training reward
    rewards.acc        # [n] the accuracy score (reward.accuracy): rollout/acc, pass@k
    rewards.metrics()  # reward/<name>/mean, std, errors, timeouts, extras; reward/errors, timeouts, unscored

A function that fails on a sample (raised, returned a non-score, timed out, killed its process) contributes
``reward.error_score`` instead of its score there and is counted; the first failure of each function is
printed once with its traceback. A batch where every applicable (function, sample) pair failed stops the
stage (:class:`~rlcore.rewards.guard.RewardError`), naming the first failure.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rlcore.rewards import functions as fns
from rlcore.rewards.guard import (
    DIED,
    NOT_APPLICABLE,
    OK,
    RAISED,
    TIMED_OUT,
    Outcome,
    RewardError,
    pool_of,
)

RESERVED = ("mean", "std", "errors", "timeouts", "raw_mean")  # per-function metric names extras must not take


@dataclass
class ModelScores:
    """A reward model's scores of a batch: ``raw`` and, as they enter the reward, ``value`` (normalised)."""

    raw: np.ndarray
    value: np.ndarray
    weight: float


@dataclass
class Rewards:
    """A scored batch of ``n`` samples.

    ``total`` is the training reward and ``acc`` the accuracy score, both ``[n]``. Per component (each function,
    and ``rm`` for a reward model): ``values[name]`` ``[n]``, what it contributed before its weight (its score,
    ``error_score`` where it failed, NaN where it did not apply); ``status[name]`` ``[n]`` (``guard.OK``, ...; a
    reward model's are all OK); ``extras[name][key]`` ``[n]`` (NaN where a sample gave none); ``weights[name]``.
    """

    total: np.ndarray
    acc: np.ndarray
    values: dict[str, np.ndarray]
    status: dict[str, np.ndarray]
    extras: dict[str, dict[str, np.ndarray]]
    weights: dict[str, float]
    rm_raw: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.total)

    @staticmethod
    def concat(parts: Sequence["Rewards"]) -> "Rewards":
        """The samples of ``parts`` in order (an extra value missing from a part is NaN there)."""
        first = parts[0]
        cat = np.concatenate
        extras = {}
        for name in first.values:
            keys = dict.fromkeys(k for p in parts for k in p.extras.get(name, {}))
            extras[name] = {k: cat([p.extras.get(name, {}).get(k, np.full(len(p), np.nan)) for p in parts])
                            for k in keys}
        return Rewards(cat([p.total for p in parts]), cat([p.acc for p in parts]),
                       {k: cat([p.values[k] for p in parts]) for k in first.values},
                       {k: cat([p.status[k] for p in parts]) for k in first.status}, extras, dict(first.weights),
                       None if first.rm_raw is None else cat([p.rm_raw for p in parts]))

    def select(self, index: np.ndarray) -> "Rewards":
        """The samples at ``index``."""
        return Rewards(self.total[index], self.acc[index], {k: v[index] for k, v in self.values.items()},
                       {k: v[index] for k, v in self.status.items()},
                       {k: {e: c[index] for e, c in d.items()} for k, d in self.extras.items()}, dict(self.weights),
                       None if self.rm_raw is None else self.rm_raw[index])

    def components(self) -> tuple[np.ndarray, tuple[float, ...]]:
        """``[n, components]`` unweighted values (0 where a component did not apply) and their weights, in order:
        what an estimator that treats each reward apart (GDPO) reads."""
        names = list(self.values)
        return (np.stack([np.nan_to_num(self.values[k], nan=0.0) for k in names], axis=1),
                tuple(self.weights[k] for k in names))

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """``{prefix}/<name>/mean`` and ``std`` (over the samples it applied to), ``errors``, ``timeouts`` and the
        mean of each extra value; ``{prefix}/errors``, ``timeouts`` (every function) and ``unscored`` (samples no
        component applied to); ``{prefix}/rm/raw_mean`` with a reward model."""
        m: dict[str, float] = {}
        errors = timeouts = 0
        applied = np.zeros(len(self), bool)
        for name, value in self.values.items():
            status = self.status[name]
            used = status != NOT_APPLICABLE
            applied |= used
            if used.any():
                m[f"{prefix}/{name}/mean"] = float(value[used].mean())
                m[f"{prefix}/{name}/std"] = float(value[used].std())
            if name == "rm":
                continue
            e, t = int(np.isin(status, (RAISED, DIED)).sum()), int((status == TIMED_OUT).sum())
            m[f"{prefix}/{name}/errors"], m[f"{prefix}/{name}/timeouts"] = e, t
            errors, timeouts = errors + e, timeouts + t
            for key, column in self.extras.get(name, {}).items():
                if np.isfinite(column).any():
                    m[f"{prefix}/{name}/{'extra_' + key if key in RESERVED else key}"] = float(np.nanmean(column))
        if self.rm_raw is not None and len(self):
            m[f"{prefix}/rm/raw_mean"] = float(self.rm_raw.mean())
        m[f"{prefix}/errors"], m[f"{prefix}/timeouts"] = errors, timeouts
        m[f"{prefix}/unscored"] = int((~applied).sum())
        return m


def agreement(scores: np.ndarray, correct: np.ndarray, group: int) -> float | None:
    """Within each group of ``group`` consecutive samples (one prompt's), the share of (correct, incorrect) sample
    pairs that ``scores`` rank correct first; None when no group has both. With a reward model's scores and the
    rule's correctness: how often the reward model agrees with the truth on the policy's own samples (falling during
    a round: the policy has found what the reward model gets wrong)."""
    right = total = 0
    for s, c in zip(scores.reshape(-1, group), correct.reshape(-1, group)):
        diff = s[c][:, None] - s[~c][None, :]
        right += int((diff > 0).sum())
        total += diff.size
    return right / total if total else None


def samples_of(data_sources: Sequence[str], texts: Sequence[str], ground_truths: Sequence[Any],
               extra_infos: Sequence[Mapping[str, Any]] | None = None) -> list[tuple]:
    """The ``(data_source, solution_str, ground_truth, extra_info)`` tuples the functions are called with."""
    extras = extra_infos if extra_infos is not None else [{}] * len(texts)
    return [(str(ds), t, gt, dict(e) if e is not None else {})
            for ds, t, gt, e in zip(data_sources, texts, ground_truths, extras)]


class RewardScorer:
    """The stage's reward functions and its counts of their failures (``errors``, ``timeouts``, in total and per
    function)."""

    def __init__(self, functions: Sequence[fns.RewardFunction] | None = None, *, timeout_s: float = 10.0,
                 error_score: float = 0.0, processes: int = 1, accuracy: str = "auto"):
        self.functions = list(functions) if functions is not None else fns.components(_RuleOnly())
        self.timeout_s, self.error_score, self.accuracy = timeout_s, error_score, accuracy
        self.pool = pool_of(processes)
        self.errors = self.timeouts = 0
        self.by_function: dict[str, list[int]] = {f.label: [0, 0] for f in self.functions}
        self._warned: set[str] = set()

    @classmethod
    def from_config(cls, reward: Any) -> "RewardScorer":
        """From params.yaml's ``reward`` section."""
        return cls(fns.components(reward), timeout_s=reward.timeout_s, error_score=reward.error_score,
                   processes=reward.processes, accuracy=reward.accuracy)

    def counts(self) -> tuple[int, int]:
        """``(errors, timeouts)`` so far."""
        return self.errors, self.timeouts

    def score(self, samples: Sequence[tuple], *, what: str,
              model: ModelScores | Callable[[], ModelScores] | None = None) -> Rewards:
        """Score ``samples`` (:func:`samples_of`) with every function, and combine them with a reward model's
        scores: ``model``, or what ``model()`` returns once the functions are done (so a reward model's forward,
        started before, runs on the workers while the functions run here). ``what`` names the batch in messages
        (``"ppo step 3"``)."""
        data_sources = [s[0] for s in samples]
        specs = [f.spec_for(data_sources) for f in self.functions]
        out = self.pool.run(samples, specs, self.timeout_s)
        if callable(model):
            model = model()
        self._count_and_warn(out, samples, what, model)
        return self._combine(out, model)

    def _count_and_warn(self, out: Outcome, samples: Sequence[tuple], what: str, model: ModelScores | None) -> None:
        failed = np.isin(out.status, (RAISED, DIED, TIMED_OUT))
        if not failed.any():
            return
        for c, f in enumerate(self.functions):
            errors = int(np.isin(out.status[c], (RAISED, DIED)).sum())
            timeouts = int((out.status[c] == TIMED_OUT).sum())
            self.by_function[f.label][0] += errors
            self.by_function[f.label][1] += timeouts
            self.errors, self.timeouts = self.errors + errors, self.timeouts + timeouts
            if (errors or timeouts) and f.label not in self._warned:
                self._warned.add(f.label)
                summary, detail = self._first_failure(out, c)
                print(f"warning: reward: function {f.label!r} ({f.source}) failed on {errors + timeouts} of "
                      f"{len(samples)} samples of {what} ({errors} errors, {timeouts} timeouts) and scored "
                      f"reward.error_score {self.error_score:g} there; later failures are only counted "
                      f"(reward/{f.label}/errors, /timeouts). The first:\n{detail}", file=sys.stderr, flush=True)
        applicable = out.status != NOT_APPLICABLE
        if model is None and applicable.any() and failed[applicable].all():
            c = int(np.flatnonzero(failed.any(axis=1))[0])
            summary, _ = self._first_failure(out, c)
            raise RewardError(f"all {len(samples)} samples of {what} failed in every reward function (the first: "
                              f"function {self.functions[c].label!r} ({self.functions[c].source}): {summary}); "
                              f"{'raise reward.timeout_s or fix the function' if 'timeout' in summary else 'fix the function'}")

    def _first_failure(self, out: Outcome, c: int) -> tuple[str, str]:
        """The first exception of function ``c`` (its traceback says the most), else its first timeout or death."""
        if c in out.raised:
            _, summary, detail = out.raised[c]
            return summary, detail
        if (out.status[c] == TIMED_OUT).any():
            text = f"ran past reward.timeout_s ({self.timeout_s:g} s) and was stopped"
            return text, text
        text = out.deaths[0] if out.deaths else "the scoring process died"
        return text, text

    def _combine(self, out: Outcome, model: ModelScores | None) -> Rewards:
        n = out.status.shape[1]
        values, status, extras, weights = {}, {}, {}, {}
        total, applied = np.zeros(n), np.zeros(n, bool)
        for c, f in enumerate(self.functions):
            value = np.where(out.status[c] == OK, out.scores[c], self.error_score)
            used = out.status[c] != NOT_APPLICABLE
            value[~used] = np.nan
            total[used] += f.weight * value[used]
            applied |= used
            values[f.label], status[f.label], extras[f.label], weights[f.label] = (value, out.status[c].copy(),
                                                                                  out.extras[c], f.weight)
        rm_raw = None
        if model is not None:
            values["rm"], status["rm"], extras["rm"], weights["rm"] = (model.value, np.full(n, OK, np.int8), {},
                                                                       model.weight)
            total += model.weight * model.value
            applied[:] = True
            rm_raw = model.raw
        total[~applied] = self.error_score
        return Rewards(total, self._accuracy(values, n), values, status, extras, weights, rm_raw)

    def _accuracy(self, values: dict[str, np.ndarray], n: int) -> np.ndarray:
        """``reward.accuracy``: one function's value, or (auto) the rule's where it applies, else the first of the
        user's functions that applies; 0 where none does."""
        labels = [f.label for f in self.functions if f.label != "rule"]
        order = ["rule", *labels] if self.accuracy == "auto" else [self.accuracy]
        acc = np.full(n, np.nan)
        for label in order:
            if label in values:
                acc = np.where(np.isnan(acc), values[label], acc)
        return np.nan_to_num(acc, nan=0.0)


class _RuleOnly:
    """The ``reward`` settings of a scorer made without any: the built-in rule alone."""

    rule_weight = 1.0
    functions: list = []


def probe(scorer: RewardScorer, sample: tuple, *, where: str) -> None:
    """Call every function once on ``sample`` (a row of the task, its ground truth as the answer): a file that
    does not import, a missing function, a wrong signature, an exception, a timeout or a wrong return type is
    one line naming the function (:class:`RewardError`). ``where`` names the row."""
    specs = [f.spec_for([sample[0]]) for f in scorer.functions]
    out = scorer.pool.run([sample], specs, scorer.timeout_s)
    for c, f in enumerate(scorer.functions):
        status = int(out.status[c, 0])
        if status in (OK, NOT_APPLICABLE):
            continue
        if c in out.raised:
            problem = out.raised[c][1]
        elif status == TIMED_OUT:
            problem = f"ran past reward.timeout_s ({scorer.timeout_s:g} s)"
        else:
            problem = out.deaths[0] if out.deaths else "its scoring process died"
        raise RewardError(f"reward function {f.label!r} ({f.source}) fails on {where}: {problem}")
