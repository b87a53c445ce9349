"""The synchronous PPO-family round (``ppo.mode: sync``): the trainer's ranks generate each step's batch with
their rollout copy of the policy, then train on it.

Each step reads like a single-process loop: ``generate`` -> ``compute_log_prob`` ->
``compute_ref_log_prob`` -> ``compute_values`` -> rewards -> ``compute_advantage``
-> ``update_critic`` -> ``update_actor``. Workers hold the weights; the controller only
moves :class:`~rlcore.protocol.Batch` records with typed specs (``actor.call(Worker.method,
batch, spec)``) and does the tensor math of rewards and advantages (``rlcore.algos``). What a
step runs follows from the registries: the estimator says whether it needs a critic or a
greedy baseline. The reference log-probs come back to the controller only for a KL penalty in
the reward; for the KL loss alone ``update_actor`` computes them on its ranks.

:class:`RoundGroups` (the trainer's worker groups) and everything of a step after its rollouts are scored
(:meth:`RoundRunner.train`) serve the asynchronous round too (:mod:`rlcore.trainer.async_ppo`); the round's
loop, which picks the runner by ``ppo.mode``, is :mod:`rlcore.trainer.ppo`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlcore.agents.batch import agent_metrics
from rlcore.algos.advantage import ESTIMATORS, AdvantageOptions, compute_advantage
from rlcore.algos.kl_control import controller_options, make_kl_controller
from rlcore.algos.losses import POLICY_LOSSES, PolicyLossOptions, kl_penalty
from rlcore.algos.off_policy import importance_weights, off_policy_metrics
from rlcore.config import Config
from rlcore.controller.balance import balance_over_ranks
from rlcore.controller.resource_pool import ResourcePool
from rlcore.controller.worker_group import Pending, WorkerGroup
from rlcore.engine.sequence import SEQUENCE_KEYS, response_attention
from rlcore.protocol import Batch, Metrics
from rlcore.registry import options_from
from rlcore.rewards.scoring import Rewards, agreement
from rlcore.rollout import engine_spec
from rlcore.trainer.common import model_spec, timer
from rlcore.trainer.generation import reward_scorer, score_responses
from rlcore.trainer.reward_model import RewardModelGroup, colocated, start_reward_model
from rlcore.trainer.rollout_data import (
    PromptSampler,
    keep_informative_groups,
    overlong_penalty,
    place_scores,
    sample_rows,
)
from rlcore.trainer.sampling import generate, generate_spec
from rlcore.workers.actor import (
    ActorRolloutRefWorker,
    ActorUpdateSpec,
    KLLossSpec,
    LogProbSpec,
    OffPolicySpec,
)
from rlcore.workers.critic import CriticUpdateSpec, CriticWorker, ValuesSpec
from rlcore.workers.optim import OptimSpec

# What each worker call reads; the rest of the step's Batch (text fields, rewards) stays on the controller.
ACTOR_UPDATE_KEYS = SEQUENCE_KEYS + ("old_log_probs", "ref_log_probs", "advantages")
CRITIC_UPDATE_KEYS = SEQUENCE_KEYS + ("values", "returns")
# The Batch field holding each data input an estimator may declare. reward_components (float32 [batch,
# n_components], each reward's unweighted sequence score) comes with several reward functions; a batch without it
# gives gdpo one component, the token rewards' sum (see RoundRunner._estimator_input).
ESTIMATOR_FIELDS = {"index": "uid", "values": "values", "reward_baselines": "reward_baselines",
                    "reward_components": "reward_components", "old_log_probs": "old_log_probs",
                    "sum_pi_squared": "sum_pi_squared"}


def proximal_in_update(cfg: Config) -> bool:
    """Whether the proximal (old) log-probs, when they are recomputed, can be the actor update's own first forward
    instead of a forward of their own: one epoch of one mini-batch (so no optimizer step comes before any row's
    forward), and nothing on the controller reads them (a KL penalty in the reward does, and an estimator that takes
    them or sum pi^2)."""
    a = cfg.actor
    estimator = ESTIMATORS.get(cfg.algorithm.adv_estimator)
    return (a.ppo_epochs == 1 and a.ppo_mini_batch_size >= cfg.ppo.train_batch_size and not cfg.algorithm.use_kl_in_reward
            and not estimator.reads_old_log_probs and not estimator.needs_sum_pi_squared)


def recomputes_old_log_probs(cfg: Config, proximal: bool) -> bool:
    """Whether the round recomputes the old log-probs with a trainer forward (``proximal``: the round asks for the
    proximal policy), which a loss whose old policy is the behaviour policy (``bypass_mode``) never does."""
    return proximal and not POLICY_LOSSES.get(cfg.actor.policy_loss).old_is_behaviour


def needs_reference(cfg: Config) -> bool:
    """A KL term (loss or in-reward penalty) needs the frozen reference."""
    return cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def actor_update_spec(cfg: Config, seed: int) -> ActorUpdateSpec:
    """params.yaml ``actor`` as one update's typed settings; mini-batches in rows per rank."""
    a, n, w = cfg.actor, cfg.rollout.n, cfg.resources.n_workers
    loss = PolicyLossOptions(
        loss_agg_mode=a.loss_agg_mode, loss_scale_factor=a.loss_scale_factor or float(cfg.task.max_response_length),
        clip_ratio_low=a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
        clip_cov_ratio=a.clip_cov_ratio, clip_cov_lb=a.clip_cov_lb, clip_cov_ub=a.clip_cov_ub,
        kl_cov_ratio=a.kl_cov_ratio, ppo_kl_coef=a.ppo_kl_coef, sapo_tau_pos=a.sapo_tau_pos, sapo_tau_neg=a.sapo_tau_neg,
        dro_beta=a.dro_beta, vespo_k_pos=a.vespo_k_pos, vespo_lambda_pos=a.vespo_lambda_pos, vespo_k_neg=a.vespo_k_neg,
        vespo_lambda_neg=a.vespo_lambda_neg, bypass_loss_type=a.bypass.loss_type, bypass_is=a.bypass.rollout_is,
        bypass_is_threshold=a.bypass.is_threshold, bypass_is_threshold_low=a.bypass.is_threshold_low,
        bypass_rs=a.bypass.rollout_rs, bypass_rs_threshold=a.bypass.rs_threshold,
        bypass_rs_threshold_low=a.bypass.rs_threshold_low)
    return ActorUpdateSpec(epochs=a.ppo_epochs, mini_batch_size=a.ppo_mini_batch_size * n // w,
                           micro_batch_size=a.micro_batch_size, grad_clip=a.grad_clip,
                           temperature=cfg.rollout.temperature, policy_loss=a.policy_loss, loss=loss,
                           entropy_coeff=a.entropy_coeff,
                           kl=KLLossSpec(a.kl_loss_type, a.kl_loss_coef) if a.use_kl_loss else None, seed=seed)


def critic_update_spec(cfg: Config, seed: int) -> CriticUpdateSpec:
    """params.yaml ``critic`` as one update's typed settings (its own batch sizes)."""
    c, n, w = cfg.critic, cfg.rollout.n, cfg.resources.n_workers
    mini = c.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size
    return CriticUpdateSpec(epochs=c.ppo_epochs, mini_batch_size=mini * n // w, micro_batch_size=c.micro_batch_size,
                            grad_clip=c.grad_clip, cliprange_value=c.cliprange_value, seed=seed)


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
                            optim=OptimSpec(lr=a.lr, weight_decay=a.weight_decay, warmup_steps=a.warmup_steps,
                                            offload=cfg.resources.offload.optimizer),
                            with_ref=needs_reference(cfg), seed=cfg.seed)
        groups = cls(actor)
        try:
            actor.call(ActorRolloutRefWorker.init_model)
            if use_critic:
                critic_dir = Path(init_dir) / "critic"
                groups.critic = WorkerGroup(CriticWorker, pool, name="critic", share=share, timeout_s=timeout,
                                            model=model_spec(cfg, critic_dir if critic_dir.is_dir() else init_dir,
                                                             "critic"),
                                            optim=OptimSpec(lr=c.lr, weight_decay=c.weight_decay,
                                                            offload=cfg.resources.offload.optimizer), seed=cfg.seed)
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


class RoundRunner:
    """The running state of one round over its worker groups; ``step`` is one RL step."""

    def __init__(self, cfg: Config, *, groups: RoundGroups, tokenizer, prompts: Batch, seed: int):
        self.cfg, self.tok, self.prompts, self.seed = cfg, tokenizer, prompts, seed
        alg = cfg.algorithm
        self.estimator = ESTIMATORS.get(alg.adv_estimator)
        self.actor = groups.actor
        self.critic = groups.critic if self.estimator.needs_critic else None
        self.reward_model = groups.reward_model
        if self.estimator.needs_critic and self.critic is None:
            raise ValueError(f"estimator {alg.adv_estimator!r} needs a critic worker group")
        k = alg.kl_ctrl
        self.kl_ctrl = make_kl_controller(k.type, **options_from(k, controller_options(k.type)))
        self.sampler = PromptSampler(len(prompts), seed)
        self.log_prob_spec = LogProbSpec(cfg.actor.micro_batch_size, cfg.rollout.temperature)
        self.values_spec = ValuesSpec(cfg.critic.micro_batch_size)
        self.actor_spec, self.critic_spec = actor_update_spec(cfg, seed), critic_update_spec(cfg, seed)
        self.rewards = reward_scorer(cfg)  # guarded reward functions; counts their errors and timeouts
        # each reward component's weight, in the order of the batch's reward_components (functions, reward model)
        weights = tuple(f.weight for f in self.rewards.functions) + (
            (cfg.reward.model.weight,) if cfg.reward.model is not None else ())
        self.adv_options = AdvantageOptions(gamma=alg.gamma, lam=alg.lam,
                                            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
                                            gdpo_batch_norm=alg.gdpo_batch_norm, handle_zero_tail=alg.handle_zero_tail,
                                            reward_weights=weights)
        self.samples: list[dict] = []  # ppo.log_samples rows of every step so far (the rollouts file's rows)
        self.policy_version = 0  # actor updates so far: the version of the weights the next rollouts use
        self.last_batch = Batch()  # the last step's whole batch (rollouts, rewards, advantages), for inspection
        # the proximal policy's log-probs come from a trainer forward (else the rollout's are the old ones)
        self.recompute_log_prob = recomputes_old_log_probs(cfg, cfg.actor.recompute_log_prob)
        self.proximal_in_update = proximal_in_update(cfg)

    # ------------------------------------------------------------------ steps
    def _generate(self, prompts: Batch, seed: int, greedy: bool = False) -> Batch:
        spec = generate_spec(self.cfg, temperature=self.cfg.rollout.temperature, seed=seed, greedy=greedy)
        return generate(self.actor, ActorRolloutRefWorker.generate, prompts, spec)

    def _score(self, batch: Batch, what: str) -> tuple[Batch, Rewards]:
        """The rewards of every function (and the reward model): the accuracy score (``acc``), the shaped training
        reward (``scores``: the weighted sum plus the overlong penalty) and each component unweighted
        (``reward_components``, for estimators that treat them apart); and the batch's :class:`Rewards`."""
        rewards = score_responses(self.tok, batch, self.rewards, what=what, reward_model=self.reward_model)
        d = self.cfg.ppo.dapo
        lengths = response_attention(batch).sum(-1)  # a trajectory's tokens, observations included: its budget
        pen = overlong_penalty(lengths, self.cfg.task.max_response_length, d.overlong_buffer, d.overlong_penalty)
        components, _ = rewards.components()
        return batch.union(Batch({"acc": torch.as_tensor(rewards.acc, dtype=torch.float32),
                                  "scores": torch.as_tensor(rewards.total, dtype=torch.float32) + pen,
                                  "reward_components": torch.as_tensor(components, dtype=torch.float32)})), rewards

    def collect(self, step: int) -> tuple[Batch, Metrics]:
        """Rollouts for ``ppo.train_batch_size`` prompts, with DAPO dynamic sampling if asked; the metrics of
        every response scored on the way (``reward/*``; ``timing_s/reward``: decoding and scoring them, the reward
        model included) and of the tries."""
        cfg, n, want = self.cfg, self.cfg.rollout.n, self.cfg.ppo.train_batch_size
        d = cfg.ppo.dapo
        kept: list[Batch] = []
        scored: list[Rewards] = []
        tries, have, last, reward_s = 0, 0, Batch(), 0.0
        while tries < (d.max_sample_tries if d.dynamic_sampling else 1) and have < want:
            prompts = self.prompts.select(self.sampler.take(want))
            generated = self._generate(prompts.repeat(n), self.seed * 100003 + step * 101 + tries)
            start = time.perf_counter()
            last, rewards = self._score(generated, f"ppo step {step}")
            reward_s += time.perf_counter() - start
            scored.append(rewards)
            part = keep_informative_groups(last, n) if d.dynamic_sampling else last
            kept.append(part)
            have += len(part) // n
            tries += 1
        batch = Batch.concat([b for b in kept if len(b)]) if have else last
        groups = min(len(batch) // n, want)
        while groups > 1 and (groups * n) % cfg.resources.n_workers:
            groups -= 1  # equal shards per rank
        every = Rewards.concat(scored)
        m = {**every.metrics(), "rollout/sample_tries": tries, "rollout/groups_kept": groups, "timing_s/reward": reward_s}
        if "rm" in every.values:  # the reward model against the truth, on this step's samples
            share = agreement(every.values["rm"], every.acc >= 1.0, n)
            if share is not None:
                m["reward/rm/agreement"] = share
        return batch.slice(0, groups * n), m

    def step(self, step: int) -> Metrics:
        t: Metrics = {}
        version = self.policy_version  # the weights this step's rollouts come from
        with timer(t, "step"):
            with timer(t, "gen"):
                batch, m = self.collect(step)
                if self.estimator.needs_greedy_baseline:
                    batch = self._add_greedy_baseline(batch, step)
            batch, train_m = self.train(batch, step, t)
        self.samples += sample_rows(batch, self.tok, step, self.cfg.ppo.log_samples, policy_version=version)
        self.last_batch = batch
        return {**m, **train_m, **self._rollout_metrics(batch, t), **t}

    def train(self, batch: Batch, step: int, t: Metrics,
              while_updating: Callable[[Pending], None] | None = None) -> tuple[Batch, Metrics]:
        """Everything of a step after its rollouts are scored: old (proximal) and reference log-probs, values,
        advantages with the off-policy weights, the critic and actor updates; the policy version goes up by one.
        Returns the batch with what was computed and the step's metrics; timings go into ``t``.
        ``while_updating(pending)`` runs on the controller while the actor update runs on the ranks."""
        cfg, alg = self.cfg, self.cfg.algorithm
        m: Metrics = {}
        if cfg.ppo.balance_batch:
            with timer(t, "balance"):
                batch, m["perf/dp_token_imbalance"] = balance_over_ranks(batch, cfg.rollout.n, cfg.resources.n_workers)
        sequences = batch.only(*SEQUENCE_KEYS)
        # fused: the update's own first forward is the proximal policy, no separate one (OffPolicySpec)
        fused = self.recompute_log_prob and self.proximal_in_update
        stats = self.estimator.needs_sum_pi_squared  # the forward also returns sum pi^2 (the optimal token baselines)
        if (self.recompute_log_prob and not fused) or stats:
            with timer(t, "old_log_prob"):
                forward = self.actor.call(ActorRolloutRefWorker.compute_log_prob, sequences,
                                          dataclasses.replace(self.log_prob_spec, sum_pi_squared=stats))
            batch = batch.union(forward if self.recompute_log_prob else forward.only("sum_pi_squared"))
            if self.recompute_log_prob:
                m.update(logprob_mismatch(batch))
        if not self.recompute_log_prob:  # the rollout ran the same weights: its log-probs are the old policy's
            batch = batch.union(Batch({"old_log_probs": batch["rollout_log_probs"]}))
        if alg.use_kl_in_reward:  # the rewards need them here; for the KL loss alone the update computes them
            with timer(t, "ref"):
                batch = batch.union(self.actor.call(ActorRolloutRefWorker.compute_ref_log_prob, sequences,
                                                    self.log_prob_spec))
        if self.critic is not None:
            with timer(t, "values"):
                batch = batch.union(self.critic.call(CriticWorker.compute_values, sequences, self.values_spec))
        with timer(t, "adv"):
            batch, adv_m = self._advantages(batch)
            m.update(adv_m)
            if self.recompute_log_prob and not fused:
                batch, off_m = self._off_policy_weights(batch)
                m.update(off_m)
        if self.critic is not None:
            with timer(t, "update_critic"):
                m.update(self.critic.call(CriticWorker.update_critic, batch.only(*CRITIC_UPDATE_KEYS),
                                          dataclasses.replace(self.critic_spec, seed=self.seed + step)))
        if self.critic is None or step >= cfg.critic.warmup_steps:
            with timer(t, "update_actor"):
                # without a recompute, the update's first mini-batch (before any optimizer step, the
                # rollout's weights) measures the rollout/trainer mismatch from the rollout log-probs
                keys: tuple[str, ...] = ACTOR_UPDATE_KEYS
                if not (self.recompute_log_prob and not fused):
                    keys += ("rollout_log_probs",)
                keys += ("is_weights",) if "is_weights" in batch else ()
                o = cfg.actor.off_policy
                spec = dataclasses.replace(self.actor_spec, seed=self.seed + step, off_policy=OffPolicySpec(
                    o.correction, o.cap, o.low, o.high) if fused else None)
                pending = self.actor.submit(ActorRolloutRefWorker.update_actor, batch.only(*keys), spec)
                if while_updating is not None:
                    while_updating(pending)
                m.update(pending.result())
            self.policy_version += 1
        return batch, m

    def _off_policy_weights(self, batch: Batch) -> tuple[Batch, Metrics]:
        """``actor.off_policy``: the importance weights of the proximal (recomputed) policy over the behaviour
        (rollout) policy as ``is_weights``, which the policy loss multiplies each token's loss by; the weights'
        metrics (``off_policy/*``) whatever the correction."""
        o = self.cfg.actor.off_policy
        weights, stats = importance_weights(batch["old_log_probs"], batch["rollout_log_probs"],
                                            batch["response_mask"], o.correction, cap=o.cap, low=o.low, high=o.high)
        metrics = off_policy_metrics(stats)
        if o.correction == "none":
            return batch, metrics
        return batch.union(Batch({"is_weights": weights})), metrics

    def validate(self, prompts: Batch) -> Metrics:
        """Greedy pass@1 of the current policy (the rollout copy holds the latest weights) on ``prompts``."""
        gen = self._generate(prompts, self.seed, greedy=True)
        rewards = score_responses(self.tok, gen, self.rewards, what="ppo validation", reward_model=self.reward_model)
        m = rewards.metrics()
        return {"val/greedy_pass@1": float((rewards.acc >= 1.0).mean()),
                "val/reward_mean": float(rewards.total.mean()),
                "val/response_length": response_attention(gen).sum(-1).float().mean().item(),
                "val/reward_errors": m["reward/errors"], "val/reward_timeouts": m["reward/timeouts"],
                **agent_metrics(gen, "val/agent")}

    def _add_greedy_baseline(self, batch: Batch, step: int) -> Batch:
        """ReMax: the reward of one greedy response per prompt is every sample's baseline."""
        n = self.cfg.rollout.n
        firsts = batch.select(np.arange(0, len(batch), n))
        plain = Batch(firsts.only("prompts", "prompt_mask").tensors,
                      {k: v for k, v in firsts.non_tensors.items() if not k.startswith("agent_")})
        greedy, _ = self._score(self._generate(plain, self.seed + step, greedy=True),
                                f"ppo step {step}'s greedy baseline")
        return batch.union(Batch({"reward_baselines": greedy["scores"].repeat_interleave(n)}))

    def _advantages(self, batch: Batch) -> tuple[Batch, Metrics]:
        alg, mask = self.cfg.algorithm, batch["response_mask"]
        token_rewards = place_scores(batch["scores"], mask)
        metrics: Metrics = {}
        if alg.use_kl_in_reward:
            kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], alg.kl_penalty) * mask
            seq_kl = (kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean().item()
            token_rewards = token_rewards - self.kl_ctrl.value * kl
            metrics.update({"actor/reward_kl_penalty": seq_kl, "actor/reward_kl_coef": self.kl_ctrl.value})
            self.kl_ctrl.update(seq_kl, len(batch))
        inputs = {name: self._estimator_input(batch, name, token_rewards) for name in self.estimator.inputs}
        adv, ret = compute_advantage(alg.adv_estimator, token_level_rewards=token_rewards, response_mask=mask,
                                     **inputs, **options_from(self.adv_options, self.estimator.options))
        fmask = mask.bool()
        metrics.update({"critic/advantages_mean": adv[fmask].mean().item(),
                        "critic/advantages_std": adv[fmask].std().item() if fmask.sum() > 1 else 0.0,
                        "critic/returns_mean": ret[fmask].mean().item()})
        return batch.union(Batch({"token_level_rewards": token_rewards, "advantages": adv, "returns": ret})), metrics

    @staticmethod
    def _estimator_input(batch: Batch, name: str, token_rewards: torch.Tensor) -> Any:
        """The batch field holding the estimator's data input ``name``. Without ``reward_components`` (one reward
        function), gdpo gets one: the token rewards' sum (the scores, less an in-reward KL penalty), with the
        default weight 1.0, so it is grpo's advantage whitened over the batch (verl's fallback too)."""
        if name == "reward_components" and "reward_components" not in batch:
            return token_rewards.sum(-1, keepdim=True)
        return batch[ESTIMATOR_FIELDS[name]]

    def _rollout_metrics(self, batch: Batch, t: Metrics) -> Metrics:
        """The step's rollouts: reward, accuracy, length (of a whole trajectory: model and observation tokens),
        the share cut at the length limit, throughput; and the tool loop's ``agent/*``."""
        mask = response_attention(batch)
        lengths = mask.sum(-1).float()
        resp_tokens = float(lengths.sum())
        total_tokens = resp_tokens + float(batch["prompt_mask"].sum())
        return {
            "rollout/reward_mean": batch["scores"].mean().item(),
            "rollout/acc": batch["acc"].mean().item(),
            "rollout/response_length": lengths.mean().item(),
            "rollout/clip_ratio": (lengths >= mask.shape[1]).float().mean().item(),
            "perf/tokens_per_s": total_tokens / max(t["timing_s/step"], 1e-9),
            "perf/gen_tokens_per_s": resp_tokens / max(t["timing_s/gen"], 1e-9),
            **agent_metrics(batch),
        }

    def save(self, out_dir: str) -> None:
        self.actor.call(ActorRolloutRefWorker.save, out_dir)
        if self.critic is not None:
            self.critic.call(CriticWorker.save, str(Path(out_dir) / "critic"))

    # ------------------------------------------------------------ checkpoints
    def save_state(self, folder: Path) -> dict[str, Any]:
        """The workers write their training state into ``folder``; returns the controller's own state
        (everything a later step reads that is not a param): the prompt sampler's order, position and
        RNG, the KL controller's coefficient, the rollouts kept and the policy version."""
        self.actor.call(ActorRolloutRefWorker.save_state, str(folder))
        if self.critic is not None:
            self.critic.call(CriticWorker.save_state, str(folder))
        return {"sampler": {"order": self.sampler.order.copy(), "pos": self.sampler.pos,
                            "rng": self.sampler.rng.bit_generator.state},
                "kl_coef": self.kl_ctrl.value, "samples": list(self.samples), "policy_version": self.policy_version}

    def load_state(self, folder: Path, state: dict[str, Any]) -> None:
        """Continue from what :meth:`save_state` wrote and returned."""
        self.actor.call(ActorRolloutRefWorker.load_state, str(folder))
        if self.critic is not None:
            self.critic.call(CriticWorker.load_state, str(folder))
        s = state["sampler"]
        self.sampler.order, self.sampler.pos = s["order"], s["pos"]
        self.sampler.rng.bit_generator.state = s["rng"]
        self.kl_ctrl.value = state["kl_coef"]
        self.samples = list(state["samples"])
        self.policy_version = state["policy_version"]


def logprob_mismatch(batch: Batch) -> Metrics:
    """How far the rollout engine's log-probs of the sampled tokens are from the trainer's recomputed ones
    (the training-inference mismatch): mean and max absolute difference over response tokens, and the
    k3 estimate of KL(trainer || rollout)."""
    mask = batch["response_mask"].bool()
    diff = (batch["old_log_probs"] - batch["rollout_log_probs"])[mask]
    k3 = kl_penalty(batch["old_log_probs"], batch["rollout_log_probs"], "k3")[mask]
    return {"rollout/logprob_abs_diff_mean": diff.abs().mean().item(),
            "rollout/logprob_abs_diff_max": diff.abs().max().item(), "rollout/logprob_k3_kl": k3.mean().item()}


@contextmanager
def running_sync_round(cfg: Config, groups: RoundGroups, *, init_dir: str, tokenizer, prompts: Batch, seed: int,
                       steps: int | None = None) -> Iterator[RoundRunner]:
    """``ppo.mode: sync``: a :class:`RoundRunner` over ``groups`` (nothing else to start or stop)."""
    yield RoundRunner(cfg, groups=groups, tokenizer=tokenizer, prompts=prompts, seed=seed)
