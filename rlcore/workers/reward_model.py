"""The reward-model worker (one rank): a frozen reward model scoring responses in PPO rounds, score and evaluate
(``reward.model``). Training one is ``rlcore.workers.rm_training``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.controller.decorator import Dispatch, RankPlacement, register
from rlcore.engine.model import ModelSpec
from rlcore.engine.reward_model import load_reward_model, sequence_scores
from rlcore.engine.sequence import sequences
from rlcore.protocol import Batch
from rlcore.workers.rank import RankWorker


@dataclass(frozen=True)
class ScoreSpec:
    """A no-grad scoring forward."""

    micro_batch_size: int
    """Sequences per forward on a rank."""


def sequence_batch_scores(model, part: Batch, device: torch.device) -> torch.Tensor:
    """``[rows]`` scores of a Batch with ``prompts``/``prompt_mask`` and ``responses``/``response_mask``."""
    ids, mask = sequences(part)
    return sequence_scores(model, ids.to(device), mask.to(device))


class RewardModelWorker(RankWorker):
    """A frozen reward model that scores responses at their last token."""

    def __init__(self, placement: RankPlacement, *, model: ModelSpec, seed: int = 0):
        super().__init__(placement, seed)
        self.model_spec = model

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.model = load_reward_model(self.model_spec, self.device, frozen=True)

    @register(Dispatch.DP_COMPUTE)
    def compute_scores(self, batch: Batch, spec: ScoreSpec) -> Batch:
        """``rm_scores`` ``[batch]``: each (prompt ; response)'s score at its last response token."""
        scores = []
        with torch.no_grad():
            for part in batch.split(spec.micro_batch_size):
                scores.append(sequence_batch_scores(self.model, part, self.device).cpu())
        return Batch({"rm_scores": torch.cat(scores)})
