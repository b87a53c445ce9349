"""One PPO-family update on a scored batch, as named steps: balance, old log-probs, reference, teacher, values,
advantages, critic update, actor update.

    ppo = PPOStep(cfg, worker_groups, seed=seed, reward_weights=weights)
    batch, metrics = ppo.train(batch, step, timings)

What a step runs follows from the registries and the params: the estimator says whether it needs a critic, old
log-probs, sum pi^2 or a teacher's log-probs; ``algorithm.use_kl_in_reward`` whether the controller needs the
reference log-probs (for the KL loss alone the update computes them on its ranks). Where the old (proximal) log-probs
come from is chosen once, as a type (:func:`proximal_source`): the rollout's, a trainer forward here, or the update's
own first forward; the importance weights, the rollout mismatch and the KL to the reference are measured against them
in the actor update, each by one function (:mod:`rlcore.workers.proximal`). The workers hold the weights; the
controller only moves :class:`~rlcore.protocol.Batch` records with typed specs and does the tensor math of rewards
and advantages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlcore.agents.trajectory_rows import mini_batch_rows, training_rows
from rlcore.algos.advantage import ESTIMATORS, AdvantageOptions, compute_advantage
from rlcore.algos.kl import kl_penalty
from rlcore.algos.kl_control import controller_options, make_kl_controller
from rlcore.algos.losses import POLICY_LOSSES
from rlcore.config import Config, needs_recompute
from rlcore.controller.balance import balance_over_ranks
from rlcore.controller.worker_group import Pending
from rlcore.engine.sequence import SEQUENCE_KEYS
from rlcore.protocol import Batch, Metrics
from rlcore.registry import options_from
from rlcore.trainer.loop.step_log import timer
from rlcore.trainer.round.teacher import teacher_log_probs
from rlcore.trainer.round.worker_groups import RoundWorkerGroups
from rlcore.workers.actor import ActorRolloutRefWorker, ActorUpdateSpec, KLLossSpec, LogProbSpec
from rlcore.workers.critic import CriticUpdateSpec, CriticWorker, ValuesSpec
from rlcore.workers.proximal import (FirstForwardLogProbs, ProximalSource, RecomputedLogProbs,
                                     RolloutLogProbs)

# What each update reads; the rest of the step's Batch (text fields, rewards) stays on the controller.
ACTOR_UPDATE_KEYS = SEQUENCE_KEYS + ("advantages", "rollout_log_probs", "ref_log_probs")
CRITIC_UPDATE_KEYS = SEQUENCE_KEYS + ("values", "returns")
# The Batch field holding each data input an estimator may declare. reward_components (float32 [batch,
# n_components], each reward's unweighted sequence score) comes with several reward functions; a batch without it
# gives gdpo one component, the token rewards' sum (see PPOStep._estimator_input).
ESTIMATOR_FIELDS = {"index": "uid", "values": "values", "reward_baselines": "reward_baselines",
                    "reward_components": "reward_components", "old_log_probs": "old_log_probs",
                    "sum_pi_squared": "sum_pi_squared", "teacher_log_probs": "teacher_log_probs"}


def proximal_in_update(cfg: Config) -> bool:
    """Whether the proximal (old) log-probs, when they are recomputed, can be the actor update's own first forward
    instead of a forward of their own: one epoch of one mini-batch (so no optimizer step comes before any row's
    forward), and nothing on the controller reads them (a KL penalty in the reward does, and an estimator that takes
    them or sum pi^2)."""
    a = cfg.actor
    estimator = ESTIMATORS.get(cfg.algorithm.adv_estimator)
    return (a.ppo_epochs == 1 and a.ppo_mini_batch_size >= cfg.ppo.train_batch_size and not cfg.algorithm.use_kl_in_reward
            and not estimator.reads_old_log_probs and not estimator.needs_sum_pi_squared)


def proximal_source(cfg: Config) -> ProximalSource:
    """Where a round's old log-probs come from (``rlcore.workers.proximal``): the rollout's own unless the round
    recomputes them (:func:`~rlcore.config.needs_recompute`), which a loss whose old policy is the behaviour policy
    (``bypass_mode``) never does; recomputed, by the update's own first forward where it can be
    (:func:`proximal_in_update`), else by a forward of their own."""
    if not needs_recompute(cfg.actor, cfg.ppo) or POLICY_LOSSES.get(cfg.actor.loss.name).old_is_behaviour:
        return RolloutLogProbs()
    return FirstForwardLogProbs() if proximal_in_update(cfg) else RecomputedLogProbs()


def actor_update_spec(cfg: Config, seed: int, proximal: ProximalSource = RolloutLogProbs()) -> ActorUpdateSpec:
    """params.yaml ``actor`` as one update's typed settings; mini-batches in rows per rank; ``proximal``: where the
    old log-probs come from (:func:`proximal_source`), ``actor.off_policy``'s correction only when they are not the
    rollout's."""
    a, n, w = cfg.actor, cfg.rollout.n, cfg.resources.n_workers
    return ActorUpdateSpec(epochs=a.ppo_epochs, mini_batch_size=a.ppo_mini_batch_size * n // w,
                           micro_batch_size=a.micro_batch_size, grad_clip=a.grad_clip,
                           temperature=cfg.rollout.temperature, loss=a.loss.resolved(cfg.task.max_response_length),
                           entropy_coeff=a.entropy_coeff,
                           kl=KLLossSpec(a.kl_loss_type, a.kl_loss_coef) if a.use_kl_loss else None, seed=seed,
                           proximal=proximal,
                           off_policy=None if isinstance(proximal, RolloutLogProbs) else a.off_policy)


def critic_update_spec(cfg: Config, seed: int) -> CriticUpdateSpec:
    """params.yaml ``critic`` as one update's typed settings (its own batch sizes)."""
    c, n, w = cfg.critic, cfg.rollout.n, cfg.resources.n_workers
    mini = c.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size
    return CriticUpdateSpec(epochs=c.ppo_epochs, mini_batch_size=mini * n // w, micro_batch_size=c.micro_batch_size,
                            grad_clip=c.grad_clip, cliprange_value=c.cliprange_value, seed=seed)


def place_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Sequence scores ``[batch]`` onto the last valid response token (the model's last token of a multi-turn
    trajectory, whose mask has gaps at the observations): ``[batch, response_len]``."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    columns = torch.arange(1, response_mask.shape[1] + 1)
    last = (response_mask.long() * columns).argmax(-1)  # 0 for a row without a valid token (then masked out)
    out[torch.arange(len(scores)), last] = scores.float()
    return out * response_mask


class PPOStep:
    """The update half of a round over its worker groups: :meth:`train` turns a scored batch into one policy (and
    critic) update; it keeps the KL controller and counts the policy versions."""

    def __init__(self, cfg: Config, worker_groups: RoundWorkerGroups, *, seed: int, reward_weights: tuple[float, ...],
                 proximal: ProximalSource | None = None):
        """``reward_weights``: each reward component's weight, in the order of the batch's ``reward_components``;
        ``proximal``: where the old log-probs come from (default: :func:`proximal_source` of ``cfg``)."""
        alg = cfg.algorithm
        self.cfg, self.seed = cfg, seed
        self.estimator = ESTIMATORS.get(alg.adv_estimator)
        self.actor = worker_groups.actor
        self.critic = worker_groups.critic if self.estimator.needs_critic else None
        if self.estimator.needs_critic and self.critic is None:
            raise ValueError(f"estimator {alg.adv_estimator!r} needs a critic worker group")
        self.teacher = worker_groups.teacher if self.estimator.needs_teacher else None
        if self.estimator.needs_teacher and self.teacher is None:
            raise ValueError(f"estimator {alg.adv_estimator!r} needs a teacher worker group")
        k = alg.kl_ctrl
        self.kl_ctrl = make_kl_controller(k.type, **options_from(k, controller_options(k.type)))
        self.proximal = proximal_source(cfg) if proximal is None else proximal
        self.log_prob_spec = LogProbSpec(cfg.actor.micro_batch_size, cfg.rollout.temperature)
        self.values_spec = ValuesSpec(cfg.critic.micro_batch_size)
        self.actor_spec, self.critic_spec = actor_update_spec(cfg, seed, self.proximal), critic_update_spec(cfg, seed)
        self.adv_options = AdvantageOptions(gamma=alg.gamma, lam=alg.lam,
                                            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
                                            gdpo_batch_norm=alg.gdpo_batch_norm, handle_zero_tail=alg.handle_zero_tail,
                                            reward_weights=reward_weights,
                                            distill_reward_weight=cfg.distill.reward_weight)
        self.policy_version = 0  # actor updates so far: the version of the weights the next rollouts use
        self.row_scale = 1.0  # the step's rows over its samples (an agent program's trajectories of several rows)

    def train(self, batch: Batch, step: int, t: Metrics,
              during_update: Callable[[Pending], None] | None = None) -> tuple[Batch, Metrics]:
        """One update on ``batch`` (scored rollouts): the batch with what was computed, and the step's metrics;
        timings go into ``t``. ``during_update(pending)`` runs on the controller while the actor update runs on the
        ranks. The policy version goes up by one with each actor update."""
        m: Metrics = {}
        batch = self._balanced(batch, m, t)
        batch, self.row_scale = training_rows(batch, self.cfg.resources.n_workers)  # an agent program's other rows
        batch = self._old_log_probs(batch, t)
        batch = self._reference(batch, t)
        batch = self._teacher(batch, m, t)
        batch = self._values(batch, t)
        with timer(t, "adv"):
            batch = self._advantages(batch, m)
        m.update(self._update_critic(batch, step, t))
        m.update(self._update_actor(batch, step, t, during_update))
        return batch, m

    # ------------------------------------------------------------------ steps
    def _balanced(self, batch: Batch, m: Metrics, t: Metrics) -> Batch:
        """Whole groups reordered so each rank gets about as many tokens (``ppo.balance_batch``)."""
        if not self.cfg.ppo.balance_batch:
            return batch
        with timer(t, "balance"):
            batch, m["perf/dp_token_imbalance"] = balance_over_ranks(batch, self.cfg.rollout.n,
                                                                     self.cfg.resources.n_workers)
        return batch

    def _old_log_probs(self, batch: Batch, t: Metrics) -> Batch:
        """``old_log_probs`` as the proximal source has them on the controller (the rollout's own; a trainer
        forward's; none when the update's own first forward takes them, as nothing here reads them then), with
        ``sum_pi_squared`` from that forward when the estimator reads it."""
        stats = self.estimator.needs_sum_pi_squared
        if self.proximal.forward_before_update or stats:
            with timer(t, "old_log_prob"):
                forward = self.actor.call(ActorRolloutRefWorker.compute_log_prob, batch.only(*SEQUENCE_KEYS),
                                          dataclasses.replace(self.log_prob_spec, sum_pi_squared=stats))
            batch = batch.union(forward.only(*self.proximal.sent, *(("sum_pi_squared",) if stats else ())))
        return self.proximal.on_controller(batch)

    def _reference(self, batch: Batch, t: Metrics) -> Batch:
        """``ref_log_probs`` when the rewards need them here (a KL penalty in the reward); for the KL loss alone the
        update computes them on its ranks."""
        if not self.cfg.algorithm.use_kl_in_reward:
            return batch
        with timer(t, "ref"):
            return batch.union(self.actor.call(ActorRolloutRefWorker.compute_ref_log_prob,
                                               batch.only(*SEQUENCE_KEYS), self.log_prob_spec))

    def _teacher(self, batch: Batch, m: Metrics, t: Metrics) -> Batch:
        """``teacher_log_probs`` when the estimator reads them (on-policy distillation), and the student's reverse KL
        to the teacher on its own samples: ``distill/reverse_kl``, the token mean of ``old - teacher`` log-probs."""
        if self.teacher is None:
            return batch
        with timer(t, "teacher"):
            batch = batch.union(teacher_log_probs(self.teacher, batch.only(*SEQUENCE_KEYS), self.cfg))
        mask = batch["response_mask"].bool()
        m["distill/reverse_kl"] = float((batch["old_log_probs"] - batch["teacher_log_probs"])[mask].mean())
        return batch

    def _values(self, batch: Batch, t: Metrics) -> Batch:
        if self.critic is None:
            return batch
        with timer(t, "values"):
            return batch.union(self.critic.call(CriticWorker.compute_values, batch.only(*SEQUENCE_KEYS),
                                                self.values_spec))

    def _advantages(self, batch: Batch, m: Metrics) -> Batch:
        """Token rewards (less an in-reward KL penalty, which updates the KL controller), then the estimator's
        advantages and returns."""
        alg, mask = self.cfg.algorithm, batch["response_mask"]
        token_rewards = place_scores(batch["scores"], mask)
        if alg.use_kl_in_reward:
            kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], alg.kl_penalty) * mask
            seq_kl = (kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean().item()
            token_rewards = token_rewards - self.kl_ctrl.value * kl
            m.update({"actor/reward_kl_penalty": seq_kl, "actor/reward_kl_coef": self.kl_ctrl.value})
            self.kl_ctrl.update(seq_kl, len(batch))
        inputs = {name: self._estimator_input(batch, name, token_rewards) for name in self.estimator.inputs}
        adv, ret = compute_advantage(alg.adv_estimator, token_level_rewards=token_rewards, response_mask=mask,
                                     **inputs, **options_from(self.adv_options, self.estimator.options))
        fmask = mask.bool()
        m.update({"critic/advantages_mean": adv[fmask].mean().item(),
                  "critic/advantages_std": adv[fmask].std().item() if fmask.sum() > 1 else 0.0,
                  "critic/returns_mean": ret[fmask].mean().item()})
        return batch.union(Batch({"token_level_rewards": token_rewards, "advantages": adv, "returns": ret}))

    @staticmethod
    def _estimator_input(batch: Batch, name: str, token_rewards: torch.Tensor) -> Any:
        """The batch field holding the estimator's data input ``name``. Without ``reward_components`` (one reward
        function), gdpo gets one: the token rewards' sum (the scores, less an in-reward KL penalty), with the
        default weight 1.0, so it is grpo's advantage whitened over the batch (verl's fallback too)."""
        if name == "reward_components" and "reward_components" not in batch:
            return token_rewards.sum(-1, keepdim=True)
        return batch[ESTIMATOR_FIELDS[name]]

    def _update_critic(self, batch: Batch, step: int, t: Metrics) -> Metrics:
        if self.critic is None:
            return {}
        with timer(t, "update_critic"):
            return self.critic.call(CriticWorker.update_critic, batch.only(*CRITIC_UPDATE_KEYS),
                                    dataclasses.replace(self.critic_spec, seed=self.seed + step, mini_batch_size=(
                                        mini_batch_rows(self.critic_spec.mini_batch_size, self.row_scale))))

    def _update_actor(self, batch: Batch, step: int, t: Metrics,
                      during_update: Callable[[Pending], None] | None) -> Metrics:
        """The actor update (after ``critic.warmup_steps`` with a critic); what the proximal source sends goes along,
        the rollout's log-probs always (the update measures the mismatch, and the importance weights, against
        them)."""
        if self.critic is not None and step < self.cfg.critic.warmup_steps:
            return {}
        keys = ACTOR_UPDATE_KEYS + self.proximal.sent
        with timer(t, "update_actor"):
            pending = self.actor.submit(ActorRolloutRefWorker.update_actor, batch.only(*keys),
                                        dataclasses.replace(self.actor_spec, seed=self.seed + step, mini_batch_size=(
                                            mini_batch_rows(self.actor_spec.mini_batch_size, self.row_scale))))
            if during_update is not None:
                during_update(pending)
            m = pending.result()
        self.policy_version += 1
        return m

    # ------------------------------------------------------------ state
    def save(self, out_dir: str) -> None:
        """The policy (and the critic, under ``critic/``) as Hugging Face folders."""
        self.actor.call(ActorRolloutRefWorker.save, out_dir)
        if self.critic is not None:
            self.critic.call(CriticWorker.save, str(Path(out_dir) / "critic"))

    def save_state(self, folder: Path) -> dict[str, Any]:
        """The workers write their training state into ``folder``; the KL controller's coefficient and the policy
        version come back."""
        self.actor.call(ActorRolloutRefWorker.save_state, str(folder))
        if self.critic is not None:
            self.critic.call(CriticWorker.save_state, str(folder))
        return {"kl_coef": self.kl_ctrl.value, "policy_version": self.policy_version}

    def load_state(self, folder: Path, state: dict[str, Any]) -> None:
        self.actor.call(ActorRolloutRefWorker.load_state, str(folder))
        if self.critic is not None:
            self.critic.call(CriticWorker.load_state, str(folder))
        self.kl_ctrl.value = state["kl_coef"]
        self.policy_version = state["policy_version"]
