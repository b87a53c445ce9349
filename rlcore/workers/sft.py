"""The SFT worker (one rank): the policy and its optimizer, trained on demonstrations."""

from __future__ import annotations

from dataclasses import dataclass

from rlcore.controller.decorator import Dispatch, register
from rlcore.engine import distributed
from rlcore.engine.model import load_policy, load_tokenizer, save_pretrained
from rlcore.engine.sequence import sequences
from rlcore.protocol import Batch, Metrics
from rlcore.workers.optim import clipped_step, make_optimizer
from rlcore.workers.rank import TrainingRank
from rlcore.workers.state import TrainedModelState


@dataclass(frozen=True)
class SFTStepSpec:
    """One SFT optimizer step."""

    micro_batch_size: int
    """Rows per forward/backward on a rank (gradient accumulation above it)."""
    grad_clip: float
    """Max global gradient norm."""


class SFTWorker(TrainedModelState, TrainingRank):
    state_name, state_model = "sft", "model"

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.tokenizer = load_tokenizer(self.model_spec.path)
        self.model = load_policy(self.model_spec, self.device)
        self.opt, self.sched = make_optimizer(self.model.module, self.optim_spec)

    @register(Dispatch.DP_UPDATE)
    def train_step(self, batch: Batch, spec: SFTStepSpec) -> Metrics:
        """One optimizer step on the mean negative log-likelihood of the response tokens of the whole
        global batch: each micro-batch's summed NLL is divided by the global token count (and
        multiplied by the rank count, which the gradient average divides out again). A non-finite loss or
        gradient norm skips the step on every rank (``sft/nonfinite_steps`` 1)."""
        global_tokens = max(distributed.all_reduce_sum(float(batch["response_mask"].sum()), self.device), 1.0)
        world = distributed.world_size()
        total = 0.0
        for part in batch.split(spec.micro_batch_size):
            ids, mask = sequences(part)
            lp, _ = self.model.response_log_probs(ids.to(self.device), mask.to(self.device),
                                                  part["responses"].to(self.device))
            nll_sum = -(lp * part["response_mask"].to(self.device)).sum()
            (nll_sum / global_tokens * world).backward()
            total += float(nll_sum.detach())
        lr = self.sched.get_last_lr()[0]
        loss = distributed.all_reduce_sum(total, self.device) / global_tokens  # non-finite if any rank's is
        grad_norm, skipped = clipped_step(self.model, self.opt, self.sched, spec.grad_clip, loss,
                                         offload=self.optim_spec.offload)
        return {"sft/loss": loss, "sft/grad_norm": grad_norm, "sft/lr": lr, "sft/nonfinite_steps": float(skipped)}

    @register(Dispatch.ONE_TO_ALL)
    def save(self, path: str) -> str:
        """Write a Hugging Face folder (weights + tokenizer; with LoRA an adapter folder over the base) from rank 0."""
        save_pretrained(self.model, path, rank=self.rank, tokenizer=self.tokenizer, base=self.model_spec.base)
        return path
