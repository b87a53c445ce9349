"""The critic worker (one rank): a value model for GAE, FSDP2-sharded or replicated like the actor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rlcore.algos.losses import value_loss
from rlcore.controller import Dispatch, register
from rlcore.engine import distributed
from rlcore.engine.logprob import response_values
from rlcore.engine.model import DTYPES, load_value_model
from rlcore.protocol import Batch
from rlcore.workers.actor import mean_metrics, sequences
from rlcore.workers.optim import clipped_step, make_optimizer, minibatch_updates
from rlcore.workers.rank import RankWorker


class CriticWorker(RankWorker):
    def __init__(self, rank: int, world_size: int, num_threads: int, *, model_path: str, dtype: str = "float32",
                 attn_implementation: str = "sdpa", packed_forward: bool = False,
                 optim: dict[str, Any] | None = None, seed: int = 0, strategy: str = "ddp",
                 reshard_after_forward: bool = False):
        super().__init__(rank, world_size, num_threads, seed)
        self.model_path = model_path
        self.dtype = dtype
        self.attn = attn_implementation
        self.packed_forward = packed_forward
        self.optim = optim or {}
        self.strategy = strategy
        self.reshard_after_forward = reshard_after_forward

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        torch.manual_seed(self.seed)  # same fresh value head on every rank
        model = load_value_model(self.model_path, dtype="float32", attn_implementation=self.attn,
                                 packed_forward=self.packed_forward).to(self.device)
        mp = DTYPES[self.dtype] if self.dtype != "float32" else None
        self.critic = distributed.wrap(self.strategy, model.train(), self.device, mp,
                                       reshard_after_forward=self.reshard_after_forward)
        self.opt, self.sched = make_optimizer(self.critic, **self.optim)

    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: Batch) -> Batch:
        values = []
        with torch.no_grad():
            for part in batch.split(int(batch.meta["micro_batch_size"])):
                ids, mask = sequences(part)
                v = response_values(self.critic, ids.to(self.device), mask.to(self.device), part["responses"].shape[1])
                values.append((v * part["response_mask"].to(self.device)).cpu())
        return Batch({"values": torch.cat(values)})

    @register(Dispatch.DP_COMPUTE)
    def update_critic(self, batch: Batch) -> Batch:
        """Clipped value regression on ``returns``; meta['critic'] holds the settings."""
        cfg = batch.meta["critic"]

        def micro_loss(part: Batch) -> tuple[torch.Tensor, dict[str, float]]:
            ids, mask = sequences(part)
            rmask = part["response_mask"].to(self.device)
            vpreds = response_values(self.critic, ids.to(self.device), mask.to(self.device), rmask.shape[1])
            loss, clipfrac = value_loss(vpreds, part["returns"].to(self.device), part["values"].to(self.device),
                                        rmask, cliprange_value=cfg["cliprange_value"])
            vmean = (vpreds.detach() * rmask).sum() / rmask.sum().clamp(min=1)
            return loss, {"critic/vf_loss": float(loss.detach()), "critic/vf_clipfrac": float(clipfrac),
                          "critic/vpred_mean": float(vmean)}

        rows = minibatch_updates(
            batch, epochs=cfg["ppo_epochs"], mini_batch_size=cfg["mini_batch_size"],
            micro_batch_size=cfg["micro_batch_size"], agg_mode="token-mean",
            generator=torch.Generator().manual_seed(int(batch.meta["seed"]) * 104729 + self.rank),
            world_size=self.world_size, global_sum=lambda x: distributed.all_reduce_sum(x, self.device),
            micro_loss=micro_loss,
            optimizer_step=lambda: {"critic/grad_norm": clipped_step(self.critic, self.opt, self.sched,
                                                                     cfg["grad_clip"])})
        return Batch(meta={"metrics": distributed.all_reduce_mean(mean_metrics(rows), self.device)})

    @register(Dispatch.ONE_TO_ALL)
    def save(self, path: str) -> str:
        state = distributed.checkpoint_state_dict(self.critic)
        if self.rank == 0:
            Path(path).mkdir(parents=True, exist_ok=True)
            self.critic.save_pretrained(path, state_dict={k: v.cpu().contiguous() for k, v in state.items()},
                                        safe_serialization=True)
        return path
