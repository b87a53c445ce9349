"""The rewards of the openai loop's trajectories: what an agent returned is its trajectory's reward; the reward
functions score only the trajectories whose agent returned None (their last completion, as ``solution_str``).

A returned number is the training reward (``total``) and, unless the agent returned ``{"score": ..., "acc": ...}``,
also the accuracy score (``acc``: rollout/acc, pass@k count ``acc >= 1``). A failed trajectory's reward is
``rollout.agent.failure_reward`` (put in its ``agent_reward`` by the loop) and its accuracy 0. The reward functions'
values are ``NaN`` (not applicable) on the trajectories the agent scored, so ``reward/<name>/mean`` is over the ones
they scored.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from rlcore.protocol import Batch
from rlcore.rewards.guard import NOT_APPLICABLE
from rlcore.rewards.scoring import Rewards


def agent_scored(batch: Batch) -> np.ndarray:
    """``[n]`` bool: the samples whose reward the agent gave (or its failure did)."""
    if "agent_reward" not in batch:
        return np.zeros(len(batch), bool)
    return np.array([r is not None for r in batch["agent_reward"]], bool)


def with_agent_rewards(batch: Batch, score: Callable[[np.ndarray], Rewards], weights: dict[str, float]) -> Rewards:
    """The rewards of ``batch``: the agents' where they gave one, ``score(index)`` (the reward functions on the
    samples at ``index``) for the others; ``weights``: every component's weight (for an all-agent batch)."""
    mine = agent_scored(batch)
    n = len(batch)
    rest = np.flatnonzero(~mine)
    scored = score(rest) if len(rest) else None
    names = list(scored.values) if scored is not None else list(weights)
    values = {k: np.full(n, np.nan) for k in names}
    status = {k: np.full(n, NOT_APPLICABLE, np.int8) for k in names}
    extras: dict[str, dict[str, np.ndarray]] = {k: {} for k in names}
    total, acc = np.zeros(n), np.zeros(n)
    if scored is not None:
        total[rest], acc[rest] = scored.total, scored.acc
        for k in names:
            values[k][rest], status[k][rest] = scored.values[k], scored.status[k]
            extras[k] = {e: _spread(c, rest, n) for e, c in scored.extras.get(k, {}).items()}
    for i in np.flatnonzero(mine):
        total[i] = float(batch["agent_reward"][i])
        failed = bool(batch["agent_failure"][i])
        given = batch["agent_reward_extras"][i].get("acc") if not failed else None
        acc[i] = 0.0 if failed else float(given) if isinstance(given, (int, float)) else total[i]
    rm_raw = None if scored is None or scored.rm_raw is None else _spread(scored.rm_raw, rest, n)
    return Rewards(total, acc, values, status, extras, dict(scored.weights) if scored is not None else weights, rm_raw)


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
