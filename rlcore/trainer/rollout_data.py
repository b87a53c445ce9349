"""What a PPO step does to its rollout batch on the controller, besides calling workers: prompt
sampling, reward shaping (outcome scores on the last token, DAPO's overlong penalty), DAPO's
dynamic-sampling filter, and the samples kept for inspection (``ppo.log_samples``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlcore.agents.batch import transcript
from rlcore.data.collate import decode_responses
from rlcore.engine.sequence import response_attention
from rlcore.protocol import Batch


@dataclass
class PromptSampler:
    """Epoch-shuffled prompt indices, seeded: the same params give the same prompt order."""

    size: int
    seed: int
    order: np.ndarray = field(init=False)
    pos: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.order = self.rng.permutation(self.size)

    def take(self, n: int) -> np.ndarray:
        out: list[int] = []
        while len(out) < n:
            if self.pos == self.size:
                self.order, self.pos = self.rng.permutation(self.size), 0
            step = min(n - len(out), self.size - self.pos)
            out.extend(self.order[self.pos : self.pos + step])
            self.pos += step
        return np.asarray(out)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO soft overlong punishment: 0 up to ``max_len - buffer``, then linear down to ``-factor``."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    exceed = lengths.float() - (max_len - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0)


def place_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Sequence scores ``[batch]`` onto the last valid response token (the model's last token of a multi-turn
    trajectory, whose mask has gaps at the observations): ``[batch, response_len]``."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    columns = torch.arange(1, response_mask.shape[1] + 1)
    last = (response_mask.long() * columns).argmax(-1)  # 0 for a row without a valid token (then masked out)
    out[torch.arange(len(scores)), last] = scores.float()
    return out * response_mask


def keep_informative_groups(batch: Batch, n: int) -> Batch:
    """DAPO dynamic sampling: drop groups whose ``scores`` are all equal."""
    acc = batch["scores"].view(-1, n)
    keep = (acc.max(-1).values > acc.min(-1).values).nonzero().squeeze(-1)
    rows = (keep[:, None] * n + torch.arange(n)).reshape(-1)
    return batch.select(rows)


def sample_rows(batch: Batch, tokenizer, step: int, k: int, policy_version: int) -> list[dict[str, Any]]:
    """``k`` rows of a step's batch, spread evenly over it (so over its prompts), as records with the columns
    of the rollouts file (:data:`rlcore.viewer.ROLLOUT_COLUMNS`): the prompt's question, the response text,
    the reward (``scores``) and rule reward (``acc``), the mean advantage over the response, its length and
    summed log-prob. ``policy_version`` is the caller's count of policy updates behind the weights that
    generated the batch."""
    if k <= 0 or len(batch) == 0:
        return []
    rows = np.unique(np.linspace(0, len(batch) - 1, min(k, len(batch))).round().astype(int))
    part = batch.select(rows)
    mask = part["response_mask"].float()
    lengths = response_attention(part).sum(-1)
    adv = (part["advantages"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    logp = (part["rollout_log_probs"] * mask).sum(-1)
    agent = "agent_messages" in part
    # a trajectory's text shows every turn, assistant or tool (and rlcore view shows them one by one: turns)
    texts = [transcript(m) for m in part["agent_messages"]] if agent else decode_responses(
        tokenizer, part["responses"], part["response_mask"])
    out = [{"step": step, "policy_version": policy_version, "uid": str(part["uid"][i]),
            "prompt": str(part["question"][i]), "response": texts[i], "ground_truth": str(part["ground_truth"][i]),
            "reward": float(part["scores"][i]), "acc": float(part["acc"][i]), "advantage": float(adv[i]),
            "response_length": int(lengths[i]), "log_prob": float(logp[i])} for i in range(len(rows))]
    if agent:
        for row, messages in zip(out, part["agent_messages"]):
            row["turns"] = json.dumps(list(messages), ensure_ascii=False)
    return out
