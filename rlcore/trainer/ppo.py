"""One PPO-family round, driven by the single controller (this process).

Each step reads like a single-process loop: ``generate`` -> ``compute_log_prob`` ->
``compute_ref_log_prob`` -> ``compute_values`` -> rewards -> ``compute_advantage``
-> ``update_critic`` -> ``update_actor``. Workers hold the weights; the controller only
moves :class:`~rlcore.protocol.Batch` records with typed specs (``actor.call(Worker.method,
batch, spec)``) and does the tensor math of rewards and advantages (``rlcore.algos``). What a
step runs follows from the registries: the estimator says whether it needs a critic or a
greedy baseline. The reference log-probs come back to the controller only for a KL penalty in
the reward; for the KL loss alone ``update_actor`` computes them on its ranks.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from rlcore.algos.advantage import ESTIMATORS, AdvantageOptions, compute_advantage
from rlcore.algos.kl_control import controller_options, make_kl_controller
from rlcore.algos.losses import POLICY_LOSSES, PolicyLossOptions, kl_penalty
from rlcore.algos.off_policy import importance_weights, off_policy_metrics
from rlcore.config import Config
from rlcore.controller.balance import balance_over_ranks
from rlcore.controller.resource_pool import ResourcePool
from rlcore.controller.worker_group import Pending, WorkerGroup
from rlcore.data.collate import prompt_batch
from rlcore.interrupt import training_loop
from rlcore.protocol import Batch, Metrics
from rlcore.registry import options_from
from rlcore.rewards.checks import read_reward_rows
from rlcore.trainer.checkpoint import Resume, StepCheckpoints, write_error
from rlcore.trainer.common import (
    StepLog,
    model_spec,
    start_pool,
    stop_if_diverged,
    timer,
)
from rlcore.trainer.generation import (
    engine_spec,
    generate,
    generate_spec,
    reward_scorer,
    rule_rewards,
)
from rlcore.trainer.rollout_data import (
    PromptSampler,
    keep_informative_groups,
    overlong_penalty,
    place_scores,
    sample_rows,
)
from rlcore.viewer import RolloutsFile, rollouts_frame, write_page
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
SEQUENCE_KEYS = ("prompts", "prompt_mask", "responses", "response_mask")
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

    @classmethod
    def start(cls, cfg: Config, pool: ResourcePool, init_dir: str) -> RoundGroups:
        """Start and initialise the groups ``cfg`` needs, from the model at ``init_dir`` (a critic from
        ``init_dir/critic`` if a previous round saved one there)."""
        use_critic = ESTIMATORS.get(cfg.algorithm.adv_estimator).needs_critic
        share = 2 if use_critic else 1  # colocated groups split each bundle's CPUs
        a, c, timeout = cfg.actor, cfg.critic, cfg.ray.timeout_s
        actor = WorkerGroup(ActorRolloutRefWorker, pool, name="actor", share=share, timeout_s=timeout,
                            model=model_spec(cfg, init_dir), engine=engine_spec(cfg),
                            optim=OptimSpec(lr=a.lr, weight_decay=a.weight_decay, warmup_steps=a.warmup_steps),
                            with_ref=needs_reference(cfg), seed=cfg.seed)
        groups = cls(actor)
        try:
            actor.call(ActorRolloutRefWorker.init_model)
            if use_critic:
                critic_dir = Path(init_dir) / "critic"
                groups.critic = WorkerGroup(CriticWorker, pool, name="critic", share=share, timeout_s=timeout,
                                            model=model_spec(cfg, critic_dir if critic_dir.is_dir() else init_dir),
                                            optim=OptimSpec(lr=c.lr, weight_decay=c.weight_decay), seed=cfg.seed)
                groups.critic.call(CriticWorker.init_model)
        except BaseException:
            groups.shutdown()
            raise
        return groups

    def shutdown(self) -> None:
        for group in (self.actor, self.critic):
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
        if self.estimator.needs_critic and self.critic is None:
            raise ValueError(f"estimator {alg.adv_estimator!r} needs a critic worker group")
        k = alg.kl_ctrl
        self.kl_ctrl = make_kl_controller(k.type, **options_from(k, controller_options(k.type)))
        self.sampler = PromptSampler(len(prompts), seed)
        self.log_prob_spec = LogProbSpec(cfg.actor.micro_batch_size, cfg.rollout.temperature)
        self.values_spec = ValuesSpec(cfg.critic.micro_batch_size)
        self.actor_spec, self.critic_spec = actor_update_spec(cfg, seed), critic_update_spec(cfg, seed)
        self.adv_options = AdvantageOptions(gamma=alg.gamma, lam=alg.lam,
                                            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
                                            gdpo_batch_norm=alg.gdpo_batch_norm, handle_zero_tail=alg.handle_zero_tail)
        self.samples: list[dict] = []  # ppo.log_samples rows of every step so far (the rollouts file's rows)
        self.policy_version = 0  # actor updates so far: the version of the weights the next rollouts use
        self.last_batch = Batch()  # the last step's whole batch (rollouts, rewards, advantages), for inspection
        self.rewards = reward_scorer(cfg)  # guarded reward functions; counts their errors and timeouts
        # the proximal policy's log-probs come from a trainer forward (else the rollout's are the old ones)
        self.recompute_log_prob = recomputes_old_log_probs(cfg, cfg.actor.recompute_log_prob)
        self.proximal_in_update = proximal_in_update(cfg)

    # ------------------------------------------------------------------ steps
    def _generate(self, prompts: Batch, seed: int, greedy: bool = False) -> Batch:
        spec = generate_spec(self.cfg, temperature=self.cfg.rollout.temperature, seed=seed, greedy=greedy)
        return generate(self.actor, ActorRolloutRefWorker.generate, prompts, spec)

    def _score(self, batch: Batch, what: str) -> Batch:
        """Rule rewards (``acc``) and the shaped ``scores`` (with the overlong penalty)."""
        acc = torch.as_tensor(rule_rewards(self.tok, batch, self.rewards, what=what), dtype=torch.float32)
        d = self.cfg.ppo.dapo
        lengths = batch["response_mask"].sum(-1)
        pen = overlong_penalty(lengths, self.cfg.task.max_response_length, d.overlong_buffer, d.overlong_penalty)
        return batch.union(Batch({"acc": acc, "scores": acc + pen}))

    def collect(self, step: int) -> tuple[Batch, Metrics]:
        """Rollouts for ``ppo.train_batch_size`` prompts, with DAPO dynamic sampling if asked."""
        cfg, n, want = self.cfg, self.cfg.rollout.n, self.cfg.ppo.train_batch_size
        d = cfg.ppo.dapo
        kept: list[Batch] = []
        tries, have, last = 0, 0, Batch()
        while tries < (d.max_sample_tries if d.dynamic_sampling else 1) and have < want:
            prompts = self.prompts.select(self.sampler.take(want))
            last = self._score(self._generate(prompts.repeat(n), self.seed * 100003 + step * 101 + tries),
                               f"ppo step {step}")
            part = keep_informative_groups(last, n) if d.dynamic_sampling else last
            kept.append(part)
            have += len(part) // n
            tries += 1
        batch = Batch.concat([b for b in kept if len(b)]) if have else last
        groups = min(len(batch) // n, want)
        while groups > 1 and (groups * n) % cfg.resources.n_workers:
            groups -= 1  # equal shards per rank
        return batch.slice(0, groups * n), {"rollout/sample_tries": tries, "rollout/groups_kept": groups}

    def step(self, step: int) -> Metrics:
        t: Metrics = {}
        version = self.policy_version  # the weights this step's rollouts come from
        errors, timeouts = self.rewards.counts()
        with timer(t, "step"):
            with timer(t, "gen"):
                batch, m = self.collect(step)
                if self.estimator.needs_greedy_baseline:
                    batch = self._add_greedy_baseline(batch, step)
                m.update({"reward/errors": self.rewards.errors - errors,
                          "reward/timeouts": self.rewards.timeouts - timeouts})
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
                keys = ACTOR_UPDATE_KEYS if self.recompute_log_prob and not fused else ACTOR_UPDATE_KEYS + (
                    "rollout_log_probs",)
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
        """``actor.off_policy``: the advantages times the importance weights of the proximal (recomputed) policy
        over the behaviour (rollout) policy; the weights' metrics (``off_policy/*``) whatever the correction."""
        o = self.cfg.actor.off_policy
        weights, stats = importance_weights(batch["old_log_probs"], batch["rollout_log_probs"],
                                            batch["response_mask"], o.correction, cap=o.cap, low=o.low, high=o.high)
        metrics = off_policy_metrics(stats)
        if o.correction == "none":
            return batch, metrics
        return batch.replace(advantages=batch["advantages"] * weights, is_weights=weights), metrics

    def validate(self, prompts: Batch) -> Metrics:
        """Greedy pass@1 of the current policy (the rollout copy holds the latest weights) on ``prompts``."""
        gen = self._generate(prompts, self.seed, greedy=True)
        errors, timeouts = self.rewards.counts()
        acc = rule_rewards(self.tok, gen, self.rewards, what="ppo validation")
        return {"val/greedy_pass@1": float(acc.mean()),
                "val/response_length": gen["response_mask"].sum(-1).float().mean().item(),
                "val/reward_errors": self.rewards.errors - errors,
                "val/reward_timeouts": self.rewards.timeouts - timeouts}

    def _add_greedy_baseline(self, batch: Batch, step: int) -> Batch:
        """ReMax: the reward of one greedy response per prompt is every sample's baseline."""
        n = self.cfg.rollout.n
        firsts = batch.select(np.arange(0, len(batch), n))
        plain = Batch(firsts.only("prompts", "prompt_mask").tensors, dict(firsts.non_tensors))
        greedy = self._score(self._generate(plain, self.seed + step, greedy=True), f"ppo step {step}'s greedy baseline")
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
        mask = batch["response_mask"]
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


def round_seed(cfg: Config, round_name: str) -> int:
    """A round's seed depends on its own name only, so adding a round leaves earlier ones cached."""
    return cfg.seed + zlib.crc32(round_name.encode()) % 100_000


@contextmanager
def running_round(cfg: Config, *, init_dir: str, tokenizer, prompts: Batch, seed: int,
                  steps: int | None = None) -> Iterator[RoundRunner]:
    """A RoundRunner over freshly started worker groups (on a new resource pool), all stopped on the way
    out whatever happens: ``with running_round(...) as runner: runner.step(0)``. With ``ppo.mode: async`` it is
    an :class:`~rlcore.trainer.async_ppo.AsyncRoundRunner` with its generators, for a round of ``steps``."""
    with start_pool(cfg) as pool:
        groups = RoundGroups.start(cfg, pool, init_dir)
        try:
            if cfg.ppo.mode == "async":
                if steps is None:
                    raise ValueError("running_round: ppo.mode async needs the round's steps")
                with async_ppo.running_async_round(cfg, groups, init_dir=init_dir, tokenizer=tokenizer, prompts=prompts,
                                         seed=seed, steps=steps) as runner:
                    yield runner
            else:
                yield RoundRunner(cfg, groups=groups, tokenizer=tokenizer, prompts=prompts, seed=seed)
        finally:
            groups.shutdown()


def run_ppo_round(cfg: Config, *, round_name: str, init_dir: str, tokenizer, data_path: str, out_dir: str,
                  tracker, plot_csv: str | None = None, val_path: str | None = None,
                  rollouts_path: str | None = None, checkpoints: StepCheckpoints | None = None,
                  resume: Resume | None = None) -> Metrics:
    """Train one round from ``init_dir``; save the policy (and critic) to ``out_dir``.

    With ``ppo.val_every`` > 0 and ``val_path``, the greedy pass@1 on those prompts is logged
    before the first step, every ``val_every`` steps and after the last. With ``ppo.log_samples``
    > 0, that many rollouts per step go to ``rollouts_path`` (a parquet rewritten atomically after
    every step, so a crash keeps the steps so far; see :mod:`rlcore.viewer`), and at the end to
    MLflow: the table ``rollout_samples.json`` and the page ``rollouts.html``.

    With ``checkpoints``, a step checkpoint is written every ``ppo.save_every`` steps; with ``resume``, the
    round continues after the checkpoint's step from its state (``rlcore.trainer.checkpoint``) and ends as
    the uninterrupted round would.

    Workers skip an optimizer step whose loss or gradient norm is not finite (``actor/nonfinite_steps``,
    ``critic/nonfinite_steps``); after ``actor``/``critic.max_nonfinite_steps`` in a row the round raises
    :class:`~rlcore.errors.TrainingDiverged` once that step is logged
    (:func:`~rlcore.trainer.common.stop_if_diverged`)."""
    rnd = cfg.ppo.rounds[round_name]
    prompts = prompt_batch(read_reward_rows(data_path), tokenizer, cfg.task.max_prompt_length, data_path)
    every = cfg.ppo.val_every if val_path else 0
    val = Batch()
    if val_path and every:
        val = prompt_batch(read_reward_rows(val_path), tokenizer, cfg.task.max_prompt_length, val_path)
    log = StepLog(tracker, plot_csv)
    start = time.perf_counter()
    val_rows: list[Metrics] = []
    rollouts = RolloutsFile(rollouts_path) if rollouts_path else None
    first = resume.step if resume is not None else 0
    with running_round(cfg, init_dir=init_dir, tokenizer=tokenizer, prompts=prompts,
                       seed=round_seed(cfg, round_name), steps=rnd.steps) as runner:
        if resume is not None:
            runner.load_state(resume.folder, resume.state["runner"])
            log.restore(resume.state["log_rows"], to_tracker=not getattr(tracker, "resumed", False))
            val_rows = list(resume.state["val_rows"])
            if rollouts is not None:
                rollouts.update(runner.samples)
        elif every:
            val_rows.append(runner.validate(val))
            tracker.log_metrics(val_rows[-1], step=0)
        def checkpoint(done: int) -> None:
            assert checkpoints is not None
            folder = checkpoints.begin(done)
            try:
                state = runner.save_state(folder)
            except Exception as err:
                raise checkpoints.worker_error(folder, err) from err
            log.flush()  # the MLflow run holds every step up to the checkpoint a re-run continues it from
            checkpoints.commit(folder, done, {"runner": state, "log_rows": log.rows, "val_rows": val_rows,
                                              "run_id": tracker.run_id, "model_dir": str(init_dir)})

        with training_loop() as stop:
            for step in (bar := tqdm(range(first, rnd.steps), initial=first, total=rnd.steps,
                                     desc=f"ppo {round_name}", unit="step")):
                metrics = runner.step(step)
                if every and ((step + 1) % every == 0 or step + 1 == rnd.steps):
                    val_rows.append(runner.validate(val))
                    metrics.update(val_rows[-1])  # logged at the step whose update it follows
                bar.set_postfix(acc=f"{metrics['rollout/acc']:.3f}", len=f"{metrics['rollout/response_length']:.1f}")
                log.log(step, metrics)
                if rollouts is not None:
                    rollouts.update(runner.samples)
                # after the step's row and rollouts are kept, before a checkpoint: TrainingDiverged, exit code 3
                stop_if_diverged(log.rows, "actor", cfg.actor.max_nonfinite_steps,
                                 ("actor/pg_loss", "actor/grad_norm"), "lower actor.lr or check the rewards")
                stop_if_diverged(log.rows, "critic", cfg.critic.max_nonfinite_steps,
                                 ("critic/vf_loss", "critic/grad_norm"), "lower critic.lr or check the rewards")
                due = checkpoints is not None and checkpoints.due(step + 1, rnd.steps)
                if due or (stop.requested and checkpoints is not None and checkpoints.save_every > 0
                           and step + 1 < rnd.steps):  # Ctrl-C/SIGTERM: a checkpoint of this step, then stop
                    checkpoint(step + 1)
                if stop.requested:
                    stop.stop_now()
        try:
            runner.save(out_dir)
        except Exception as err:
            raise write_error(err, f"cannot write the round's model to {out_dir}",
                              "the step checkpoints and the metrics and plots so far are intact") from err
    tracker.log_table(runner.samples, "rollout_samples.json")
    log_rollouts_page(tracker, runner.samples, title=f"ppo {round_name}: rollouts")
    return round_summary(log.rows, val_rows, rnd.steps, time.perf_counter() - start)


def log_rollouts_page(tracker, rows: list[dict], title: str) -> None:
    """The rollouts as one HTML page (:func:`rlcore.viewer.render_page`), logged to the run as the
    artifact ``rollouts.html`` (a null tracker drops it); nothing without rows."""
    if not rows:
        return
    with tempfile.TemporaryDirectory() as tmp:
        tracker.log_artifact(write_page(rollouts_frame(rows), Path(tmp) / "rollouts.html", title))


def round_summary(rows: list[Metrics], val_rows: list[Metrics], steps: int, wall_s: float) -> Metrics:
    """The round's metrics file: first/last validation, accuracy of the first and last 10 steps, the reward
    functions' errors and timeouts of all steps."""
    tail = rows[-min(10, len(rows)):]
    out: Metrics = {}
    if val_rows:
        out = {"ppo/val_greedy_pass@1_first": val_rows[0]["val/greedy_pass@1"],
               "ppo/val_greedy_pass@1_last": val_rows[-1]["val/greedy_pass@1"]}
    return {
        **out,
        "ppo/acc_first_step": rows[0]["rollout/acc"],
        "ppo/acc_last10": float(np.mean([r["rollout/acc"] for r in tail])),
        "ppo/reward_last10": float(np.mean([r["rollout/reward_mean"] for r in tail])),
        "ppo/reward_errors": int(sum(r["reward/errors"] for r in rows)),
        "ppo/reward_timeouts": int(sum(r["reward/timeouts"] for r in rows)),
        "ppo/steps": steps,
        "ppo/wall_s": wall_s,
    }


# The asynchronous round builds on RoundRunner and RoundGroups above, and running_round picks it: imported once
# they exist (the module object, so either module may be imported first).
from rlcore.trainer import async_ppo  # noqa: E402
