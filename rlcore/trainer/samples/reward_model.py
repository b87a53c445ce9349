"""The reward model of ``reward.model`` on its worker group: started beside a stage's other groups, it scores each
response at its last token while the controller's scoring processes run the reward functions, and its scores
enter the training reward standardised (``normalize``) and weighted.

Placement: ``colocate`` (default) puts one rank on each bundle of the stage's resource pool, sharing its CPUs (or
GPU) with the actor or rollout ranks; ``separate`` gives it one bundle of its own (``reward.model.cpus``), so a big
reward model does not take memory from the policy's ranks.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Callable

import numpy as np

from rlcore.config import Config
from rlcore.controller.resource_pool import ResourcePool
from rlcore.controller.worker_group import Pending, WorkerGroup
from rlcore.engine.reward_model import read_stats
from rlcore.engine.sequence import SEQUENCE_KEYS
from rlcore.protocol import Batch
from rlcore.rewards.scoring import ModelScores
from rlcore.trainer.loop.model_specs import model_spec
from rlcore.workers.reward_model import RewardModelWorker, ScoreSpec


class RewardModelGroup:
    """``reward.model`` on a worker group; ``pending = group.submit(batch)``, then ``group.scores(pending)``."""

    def __init__(self, cfg: Config, pool: ResourcePool, *, share: int = 1):
        rm = cfg.reward.model
        assert rm is not None
        self.weight, self.micro = rm.weight, rm.micro_batch_size
        self.stats = read_stats(rm.path) if rm.normalize else None
        self._own = ExitStack()
        if rm.placement == "separate":
            r = cfg.resources
            pool = self._own.enter_context(ResourcePool(1, rm.cpus, r.use_gpu, cfg.ray.timeout_s, r.placement))
            share = 1
        try:
            self.group = WorkerGroup(RewardModelWorker, pool, name="reward_model", share=share,
                                     timeout_s=cfg.ray.timeout_s, model=model_spec(cfg, rm.path), seed=cfg.seed)
            self.group.call(RewardModelWorker.init_model)
        except BaseException:
            self._own.close()
            raise

    def submit(self, batch: Batch) -> Callable[[], ModelScores]:
        """Start scoring ``batch``'s responses on the ranks; the returned function waits for the scores."""
        seqs = batch.only(*SEQUENCE_KEYS)
        pad = -len(seqs) % self.group.world_size
        if pad:
            seqs = Batch.concat([seqs, seqs.select(np.arange(pad) % len(seqs))])
        pending: Pending[Batch] = self.group.submit(RewardModelWorker.compute_scores, seqs, ScoreSpec(self.micro))
        return lambda: self._scores(pending, len(batch))

    def _scores(self, pending: Pending[Batch], n: int) -> ModelScores:
        raw = pending.result()["rm_scores"].numpy()[:n].astype(np.float64)
        value = (raw - self.stats["mean"]) / self.stats["std"] if self.stats is not None else raw
        return ModelScores(raw=raw, value=value, weight=self.weight)

    def shutdown(self) -> None:
        self.group.shutdown()
        self._own.close()


def start_reward_model(cfg: Config, pool: ResourcePool, *, share: int) -> RewardModelGroup | None:
    """The stage's reward-model group when ``reward.model`` is set (``share``: groups colocated on ``pool``)."""
    return RewardModelGroup(cfg, pool, share=share) if cfg.reward.model is not None else None


def colocated(cfg: Config) -> int:
    """1 when ``reward.model`` shares the stage's pool (one more group on its bundles), else 0."""
    rm = cfg.reward.model
    return int(rm is not None and rm.placement == "colocate")
