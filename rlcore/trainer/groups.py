"""The worker groups of a PPO round: the actor (with its rollout copy and reference), a critic when the estimator
needs one, and the reward model of ``reward.model``; started together on one resource pool, stopped together."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlcore.algos.advantage import ESTIMATORS
from rlcore.config import Config
from rlcore.controller.resource_pool import ResourcePool
from rlcore.controller.worker_group import WorkerGroup
from rlcore.rollout import engine_spec
from rlcore.trainer.loop.model_specs import model_spec
from rlcore.trainer.samples.reward_model import RewardModelGroup, colocated, start_reward_model
from rlcore.workers.actor import ActorRolloutRefWorker
from rlcore.workers.critic import CriticWorker
from rlcore.workers.optim import OptimSpec


def needs_reference(cfg: Config) -> bool:
    """A KL term (loss or in-reward penalty) needs the frozen reference."""
    return cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


@dataclass
class RoundGroups:
    """The worker groups of a round: actor/rollout(/ref), and a critic when the estimator needs one."""

    actor: WorkerGroup[ActorRolloutRefWorker]
    critic: WorkerGroup[CriticWorker] | None = None
    reward_model: RewardModelGroup | None = None

    @classmethod
    def start(cls, cfg: Config, pool: ResourcePool, init_dir: str) -> RoundGroups:
        """Start and initialise the groups ``cfg`` needs, from the model at ``init_dir`` (a critic from
        ``init_dir/critic`` if a previous round saved one there; the reward model of ``reward.model``)."""
        use_critic = ESTIMATORS.get(cfg.algorithm.adv_estimator).needs_critic
        share = 1 + int(use_critic) + colocated(cfg)  # colocated groups split each bundle's CPUs
        a, c, timeout = cfg.actor, cfg.critic, cfg.ray.timeout_s
        actor = WorkerGroup(ActorRolloutRefWorker, pool, name="actor", share=share, timeout_s=timeout,
                            model=model_spec(cfg, init_dir, "actor"), engine=engine_spec(cfg.rollout),
                            optim=OptimSpec.of(a, warmup_steps=a.warmup_steps, offload=cfg.resources.offload.optimizer),
                            with_ref=needs_reference(cfg), seed=cfg.seed)
        groups = cls(actor)
        try:
            actor.call(ActorRolloutRefWorker.init_model)
            if use_critic:
                critic_dir = Path(init_dir) / "critic"
                groups.critic = WorkerGroup(CriticWorker, pool, name="critic", share=share, timeout_s=timeout,
                                            model=model_spec(cfg, critic_dir if critic_dir.is_dir() else init_dir,
                                                             "critic"),
                                            optim=OptimSpec.of(c, offload=cfg.resources.offload.optimizer),
                                            seed=cfg.seed)
                groups.critic.call(CriticWorker.init_model)
            groups.reward_model = start_reward_model(cfg, pool, share=share)
        except BaseException:
            groups.shutdown()
            raise
        return groups

    def shutdown(self) -> None:
        for group in (self.actor, self.critic, self.reward_model):
            if group is not None:
                group.shutdown()
