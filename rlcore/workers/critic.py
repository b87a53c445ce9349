"""The critic worker (one rank): a value model for GAE, FSDP2-sharded or replicated like the actor, every parameter
trained or a LoRA adapter and the value head (``critic.lora``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.algos.aggregation import AggScale
from rlcore.algos.value_loss import value_loss
from rlcore.controller.decorator import Dispatch, register
from rlcore.engine import distributed
from rlcore.engine.model import load_critic, save_pretrained
from rlcore.engine.sequence import eval_mode, sequences
from rlcore.protocol import Batch, Metrics
from rlcore.workers.minibatch import MicroResult, minibatch_updates
from rlcore.workers.optim import clipped_step, make_optimizer, update_metrics
from rlcore.workers.rank import TrainingRank
from rlcore.workers.state import TrainedModelState


@dataclass(frozen=True)
class ValuesSpec:
    """A no-grad value forward."""

    micro_batch_size: int
    """Rows per forward on a rank (``critic.micro_batch_size``)."""


@dataclass(frozen=True)
class CriticUpdateSpec:
    """One critic update (params.yaml ``critic``)."""

    epochs: int
    mini_batch_size: int
    """Rows of this rank per optimizer step."""
    micro_batch_size: int
    grad_clip: float
    cliprange_value: float
    seed: int
    """Seeds the mini-batch shuffle."""
    loss_agg_mode: str = "token-mean"


class CriticWorker(TrainedModelState, TrainingRank):
    state_name, state_model = "critic", "critic"

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        torch.manual_seed(self.seed)  # the same fresh value head on every rank (ddp also broadcasts rank 0's)
        self.critic = load_critic(self.model_spec, self.device)
        self.opt, self.sched = make_optimizer(self.critic.module, self.optim_spec)

    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: Batch, spec: ValuesSpec) -> Batch:
        """``values`` ``[batch, response_len]`` of the states before each response token (0 at padding)."""
        values = []
        with torch.no_grad(), eval_mode(self.critic.module):
            for part in batch.split(spec.micro_batch_size):
                ids, mask = sequences(part)
                v = self.critic.response_values(ids.to(self.device), mask.to(self.device), part["responses"].shape[1])
                values.append((v * part["response_mask"].to(self.device)).cpu())
        return Batch({"values": torch.cat(values)})

    def _critic_loss(self, part: Batch, spec: CriticUpdateSpec, scale: AggScale) -> MicroResult:
        ids, mask = sequences(part)
        rmask = part["response_mask"].to(self.device)
        vpreds = self.critic.response_values(ids.to(self.device), mask.to(self.device), rmask.shape[1])
        loss, clipfrac = value_loss(vpreds, part["returns"].to(self.device), part["values"].to(self.device), rmask,
                                    cliprange_value=spec.cliprange_value, loss_agg_mode=spec.loss_agg_mode,
                                    agg_scale=scale)
        vmean = (vpreds.detach() * rmask).sum() / rmask.sum().clamp(min=1)
        return MicroResult(loss, {"critic/vf_loss": float(loss.detach())},
                           {"critic/vf_clipfrac": float(clipfrac), "critic/vpred_mean": float(vmean)})

    @register(Dispatch.DP_UPDATE)
    def update_critic(self, batch: Batch, spec: CriticUpdateSpec) -> Metrics:
        """Clipped value regression on ``returns``, in mini-batches of this rank's shard."""
        def optimizer_step(loss: float) -> Metrics:
            norm, skipped = clipped_step(self.critic, self.opt, self.sched, spec.grad_clip, loss,
                                         offload=self.optim_spec.offload)
            return {"critic/grad_norm": norm, "critic/nonfinite_steps": float(skipped)}

        rows = minibatch_updates(
            batch, epochs=spec.epochs, mini_batch_size=spec.mini_batch_size, micro_batch_size=spec.micro_batch_size,
            generator=torch.Generator().manual_seed(spec.seed * 104729 + self.rank), device=self.device,
            micro_loss=lambda part, scale, first: self._critic_loss(part, spec, scale), optimizer_step=optimizer_step)
        return distributed.all_reduce_mean(update_metrics(rows, "critic"), self.device)

    @register(Dispatch.ONE_TO_ALL)
    def save(self, path: str) -> str:
        """Write the value model's folder from rank 0 (with LoRA, its adapter merged in: the next round's critic starts
        from it, with a fresh adapter)."""
        save_pretrained(self.critic, path, rank=self.rank, merge=True)
        return path
