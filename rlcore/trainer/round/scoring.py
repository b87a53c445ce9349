"""The rewards of a round's samples, whichever source generated them: the reward functions (guarded processes),
the reward model's group, and DAPO's soft overlong penalty, into the fields a PPO step trains on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rlcore.config import DAPOConfig, RewardConfig
from rlcore.engine.sequence import response_attention
from rlcore.protocol import Batch
from rlcore.rewards.scoring import Rewards, RewardScorer
from rlcore.trainer.samples.reward_model import RewardModelGroup
from rlcore.trainer.samples.scoring import reward_scorer, score_responses


@dataclass
class RoundScoring:
    """The rewards of a round's samples (params.yaml ``reward``; ``ppo.dapo``'s overlong penalty up to the task's
    ``max_response_length``): the reward functions (guarded processes; they count their errors and timeouts),
    the reward model's group, DAPO's overlong penalty."""

    reward: RewardConfig
    dapo: DAPOConfig
    max_response_length: int
    tokenizer: Any
    reward_model: RewardModelGroup | None = None
    scorer: RewardScorer = field(init=False)

    def __post_init__(self) -> None:
        self.scorer = reward_scorer(self.reward)

    @property
    def weights(self) -> tuple[float, ...]:
        """Each reward component's weight, in the order of the batch's ``reward_components`` (the functions, then
        the reward model)."""
        rm = self.reward.model
        return tuple(f.weight for f in self.scorer.functions) + ((rm.weight,) if rm is not None else ())

    def rewards(self, batch: Batch, what: str) -> Rewards:
        """Every function's (and the reward model's) reward of each sample of ``batch``."""
        return score_responses(self.tokenizer, batch, self.scorer, what=what, reward_model=self.reward_model)

    def score(self, batch: Batch, what: str) -> tuple[Batch, Rewards]:
        """The batch with its accuracy score (``acc``), the shaped training reward (``scores``: the weighted sum plus
        the overlong penalty) and each component unweighted (``reward_components``, for estimators that treat them
        apart); and the batch's :class:`Rewards`."""
        rewards = self.rewards(batch, what)
        d = self.dapo
        lengths = response_attention(batch).sum(-1)  # a trajectory's tokens, observations included: its budget
        pen = overlong_penalty(lengths, self.max_response_length, d.overlong_buffer, d.overlong_penalty)
        components, _ = rewards.components()
        return batch.union(Batch({"acc": torch.as_tensor(rewards.acc, dtype=torch.float32),
                                  "scores": torch.as_tensor(rewards.total, dtype=torch.float32) + pen,
                                  "reward_components": torch.as_tensor(components, dtype=torch.float32)})), rewards


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO soft overlong punishment: 0 up to ``max_len - buffer``, then linear down to ``-factor``."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    exceed = lengths.float() - (max_len - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0)
