"""The rewards of the openai loop's trajectories: what an agent returned is its trajectory's reward; the reward
functions score only the trajectories whose agent returned None (their last completion, as ``solution_str``).

A returned number is the training reward (``total``) and, unless the agent returned ``{"score": ..., "acc": ...}``,
also the accuracy score (``acc``: rollout/acc, pass@k count ``acc >= 1``). A failed trajectory's reward is
``rollout.agent.failure_reward`` (put in its ``agent_reward`` by the loop) and its accuracy 0. The reward functions'
values are ``NaN`` (not applicable) on the trajectories the agent scored, so ``reward/<name>/mean`` is over the ones
they scored. Light: numpy (``rlcore eval`` scores a generations file with it, without torch).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from rlcore.rewards.guard import NOT_APPLICABLE
from rlcore.rewards.scoring import Rewards


def with_agent_rewards(returned: Sequence[float | None], failures: Sequence[str], extras: Sequence[dict],
                       score: Callable[[np.ndarray], Rewards], weights: dict[str, float]) -> Rewards:
    """The rewards of ``n`` samples: ``returned[i]`` where the agent gave one (or its failure did: ``failures[i]``
    non-empty; ``extras[i]`` the rest of a returned dict, whose ``acc`` is the accuracy), ``score(index)`` (the
    reward functions on the samples at ``index``) for the others; ``weights``: every component's weight (for
    samples all scored by their agents)."""
    n = len(returned)
    mine = np.array([r is not None for r in returned], bool)
    rest = np.flatnonzero(~mine)
    scored = score(rest) if len(rest) else None
    names = list(scored.values) if scored is not None else list(weights)
    values = {k: np.full(n, np.nan) for k in names}
    status = {k: np.full(n, NOT_APPLICABLE, np.int8) for k in names}
    extra_values: dict[str, dict[str, np.ndarray]] = {k: {} for k in names}
    total, acc = np.zeros(n), np.zeros(n)
    if scored is not None:
        total[rest], acc[rest] = scored.total, scored.acc
        for k in names:
            values[k][rest], status[k][rest] = scored.values[k], scored.status[k]
            extra_values[k] = {e: _spread(c, rest, n) for e, c in scored.extras.get(k, {}).items()}
    for i in np.flatnonzero(mine):
        total[i] = float(returned[i])
        given = None if failures[i] else (extras[i] or {}).get("acc")
        acc[i] = 0.0 if failures[i] else float(given) if isinstance(given, (int, float)) else total[i]
    rm_raw = None if scored is None or scored.rm_raw is None else _spread(scored.rm_raw, rest, n)
    return Rewards(total, acc, values, status, extra_values, dict(scored.weights) if scored is not None else weights,
                   rm_raw)


def _spread(column: np.ndarray, index: np.ndarray, n: int) -> np.ndarray:
    out = np.full(n, np.nan)
    out[index] = column
    return out


def model_subset(model, index: np.ndarray):
    """A reward model's scores (``ModelScores``, or a callable returning them once its forward is done) of the samples
    at ``index`` only."""
    if model is None:
        return None

    def pick(scores):
        return type(scores)(scores.raw[index], scores.value[index], scores.weight)

    return (lambda: pick(model())) if callable(model) else pick(model)
