"""The reward-model training worker (one rank): a Bradley-Terry model on preference pairs (the ``rm`` stage)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlcore.controller.decorator import Dispatch, register
from rlcore.engine import distributed
from rlcore.engine.model import load_tokenizer
from rlcore.engine.reward_model import load_reward_model, save_reward_model
from rlcore.protocol import Batch, Metrics
from rlcore.workers.optim import clipped_step, make_optimizer
from rlcore.workers.rank import TrainingRank
from rlcore.workers.reward_model import ScoreSpec, sequence_batch_scores
from rlcore.workers.state import TrainedModelState


@dataclass(frozen=True)
class RMStepSpec:
    """One reward-model optimizer step."""

    micro_batch_size: int
    """Pairs per forward/backward on a rank (gradient accumulation above it)."""
    grad_clip: float
    center_rewards_coefficient: float


def pair_halves(batch: Batch) -> tuple[Batch, Batch]:
    """A pair batch's chosen and rejected sequences: fields ``prompts``/``prompt_mask`` with
    ``chosen``/``chosen_mask`` or ``rejected``/``rejected_mask`` as the responses."""
    base = {"prompts": batch["prompts"], "prompt_mask": batch["prompt_mask"]}
    return (Batch({**base, "responses": batch["chosen"], "response_mask": batch["chosen_mask"]}),
            Batch({**base, "responses": batch["rejected"], "response_mask": batch["rejected_mask"]}))


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor,
                       center_coef: float) -> torch.Tensor:
    """Mean over pairs of ``-log sigmoid(r_c - r_r - margin) + center_coef * (r_c + r_r)^2`` (Bradley & Terry
    1952; the margin as in Llama 2; the centring term as TRL's ``center_rewards_coefficient``). ``[pairs]`` each."""
    loss = -F.logsigmoid(chosen - rejected - margin)
    if center_coef:
        loss = loss + center_coef * (chosen + rejected) ** 2
    return loss.mean()


class RewardTrainWorker(TrainedModelState, TrainingRank):
    """A reward model and its optimizer, trained on preference pairs (data parallel); step checkpoints hold its
    weights (the score head included), optimizer, schedule and RNG as ``rm.pt``."""

    state_name, state_model = "rm", "model"

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        torch.manual_seed(self.seed)  # the same fresh head on every rank (ddp also broadcasts rank 0's)
        self.tokenizer = load_tokenizer(self.model_spec.path)
        self.model = load_reward_model(self.model_spec, self.device, frozen=False)
        self.opt, self.sched = make_optimizer(self.model.module, self.optim_spec)

    @register(Dispatch.DP_UPDATE)
    def train_step(self, batch: Batch, spec: RMStepSpec) -> Metrics:
        """One optimizer step on the Bradley-Terry loss of this rank's pairs (every rank holds as many, so the
        gradient average is the global mean's gradient). A non-finite loss or gradient norm skips the step."""
        total = correct = margin_sum = 0.0
        n = len(batch)
        for part in batch.split(spec.micro_batch_size):
            chosen, rejected = (sequence_batch_scores(self.model, half, self.device) for half in pair_halves(part))
            loss = bradley_terry_loss(chosen, rejected, part["margin"].to(self.device), spec.center_rewards_coefficient)
            (loss * len(part) / n).backward()
            total += float(loss.detach()) * len(part)
            correct += float((chosen > rejected).sum())
            margin_sum += float((chosen - rejected).detach().sum())
        lr = self.sched.get_last_lr()[0]
        pairs = distributed.all_reduce_sum(float(n), self.device)
        loss = distributed.all_reduce_sum(total, self.device) / pairs
        grad_norm, skipped = clipped_step(self.model, self.opt, self.sched, spec.grad_clip, loss,
                                          offload=self.optim_spec.offload)
        return {"rm/loss": loss, "rm/accuracy": distributed.all_reduce_sum(correct, self.device) / pairs,
                "rm/margin": distributed.all_reduce_sum(margin_sum, self.device) / pairs,
                "rm/grad_norm": grad_norm, "rm/lr": lr, "rm/nonfinite_steps": float(skipped)}

    @register(Dispatch.DP_COMPUTE)
    def score_pairs(self, batch: Batch, spec: ScoreSpec) -> Batch:
        """``chosen_scores`` and ``rejected_scores`` ``[pairs]`` of this rank's pairs (no gradients)."""
        out: dict[str, list[torch.Tensor]] = {"chosen_scores": [], "rejected_scores": []}
        with torch.no_grad():
            for part in batch.split(spec.micro_batch_size):
                chosen, rejected = pair_halves(part)
                out["chosen_scores"].append(sequence_batch_scores(self.model, chosen, self.device).cpu())
                out["rejected_scores"].append(sequence_batch_scores(self.model, rejected, self.device).cpu())
        return Batch({k: torch.cat(v) for k, v in out.items()})

    @register(Dispatch.ONE_TO_ALL)
    def save(self, path: str, stats: dict) -> str:
        """Write the model (a sequence-classification folder), its tokenizer and ``stats`` from rank 0."""
        save_reward_model(self.model, path, rank=self.rank, tokenizer=self.tokenizer, stats=stats)
        return path
