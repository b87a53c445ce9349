"""One PPO-family round, driven by the single controller (this process).

Each step reads like a single-process loop: ``generate`` -> ``compute_log_prob`` ->
``compute_ref_log_prob`` -> ``compute_values`` -> rewards -> ``compute_advantage``
-> ``update_critic`` -> ``update_actor``. Workers hold the weights; the controller only
moves :class:`~rlcore.protocol.Batch` records and does the tensor math of rewards and
advantages (``rlcore.algos``). The reference log-probs come back to the controller only for a
KL penalty in the reward; for the KL loss alone ``update_actor`` computes them on its ranks.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from rlcore.algos.advantage import compute_advantage
from rlcore.algos.kl_control import make_kl_controller
from rlcore.algos.losses import kl_penalty
from rlcore.config import Config
from rlcore.controller import WorkerGroup
from rlcore.controller.balance import balanced_row_order
from rlcore.data.collate import prompt_batch
from rlcore.data.schema import read_rows
from rlcore.protocol import Batch
from rlcore.trainer.common import StepLog, actor_group, critic_group, generate, rule_rewards, start_pool, timer

# Estimators that need a learned value function (a critic worker group).
CRITIC_ESTIMATORS = frozenset({"gae"})
# Estimators that need a greedy-rollout reward baseline per prompt (ReMax).
GREEDY_BASELINE_ESTIMATORS = frozenset({"remax"})


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
        out = []
        while len(out) < n:
            if self.pos == self.size:
                self.order, self.pos = self.rng.permutation(self.size), 0
            step = min(n - len(out), self.size - self.pos)
            out.extend(self.order[self.pos : self.pos + step])
            self.pos += step
        return np.asarray(out)


# What each worker call reads; the rest of the step's Batch (text fields, rewards) stays on the controller.
SEQUENCE_KEYS = ("prompts", "prompt_mask", "responses", "response_mask")
ACTOR_UPDATE_KEYS = ("old_log_probs", "ref_log_probs", "advantages")
CRITIC_UPDATE_KEYS = ("values", "returns")


def tensors_of(batch: Batch, keys: tuple[str, ...], **meta) -> Batch:
    """The fields of ``batch`` among ``keys`` that it has, and ``meta``: a worker call's request, so
    a call ships only what the worker reads (smaller messages, less skew between the ranks' starts)."""
    return Batch({k: batch[k] for k in keys if k in batch}, meta=meta)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO soft overlong punishment: 0 up to ``max_len - buffer``, then linear down to ``-factor``."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    exceed = lengths.float() - (max_len - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0)


def place_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Sequence scores ``[batch]`` onto the last valid response token: ``[batch, response_len]``."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = (response_mask.sum(-1) - 1).clamp(min=0)
    out[torch.arange(len(scores)), last] = scores.float()
    return out * response_mask


def group_token_costs(batch: Batch, n: int) -> np.ndarray:
    """Tokens a packed forward runs for each group of ``n`` rows: its prompt once, each distinct
    response once (``rlcore.engine.packed``); ``[groups]``."""
    groups = len(batch) // n
    mask = batch["response_mask"].bool()
    keyed = torch.where(mask, batch["responses"], -1)
    group_id = torch.arange(groups).repeat_interleave(n)
    distinct = torch.unique(torch.cat([group_id[:, None], keyed], 1), dim=0)  # [distinct rows, 1 + len]
    response_tokens = torch.bincount(distinct[:, 0], weights=(distinct[:, 1:] >= 0).sum(-1).double(),
                                     minlength=groups)
    return (response_tokens + batch["prompt_mask"][::n].sum(-1)).numpy()


def balance_over_ranks(batch: Batch, n: int, n_ranks: int) -> tuple[Batch, float]:
    """``batch`` with whole groups reordered so the ``n_ranks`` chunks hold about equal token counts
    (``group_token_costs``); and the largest rank's share of tokens over the mean share after
    reordering (1.0 = even)."""
    costs = group_token_costs(batch, n)
    order = balanced_row_order(costs, n, n_ranks)
    if order is None:
        return batch, float("nan")
    batch = batch.select(order)
    per_rank = costs[order[::n] // n].reshape(n_ranks, -1).sum(-1)
    return batch, float(per_rank.max() / max(per_rank.mean(), 1e-9))


def keep_informative_groups(batch: Batch, n: int) -> Batch:
    """DAPO dynamic sampling: drop groups whose ``acc`` rewards are all equal."""
    acc = batch["scores"].view(-1, n)
    keep = (acc.max(-1).values > acc.min(-1).values).nonzero().squeeze(-1)
    rows = (keep[:, None] * n + torch.arange(n)).reshape(-1)
    return batch.select(rows)


class RoundRunner:
    """Owns the worker groups and running state of one round; ``step`` is one RL step."""

    def __init__(self, cfg: Config, *, init_dir: str, tokenizer, prompts: Batch, seed: int,
                 groups: tuple[WorkerGroup, WorkerGroup | None] | None = None):
        """Start a resource pool and the worker groups from ``init_dir``, or reuse ``groups``
        (an actor/rollout/ref group and, for critic estimators, a critic group)."""
        self.cfg, self.tok, self.prompts, self.seed = cfg, tokenizer, prompts, seed
        a, alg = cfg.actor, cfg.algorithm
        self.needs_ref = a.use_kl_loss or alg.use_kl_in_reward
        self.use_critic = alg.adv_estimator in CRITIC_ESTIMATORS
        self.pool = None
        if groups is None:
            self.pool = start_pool(cfg)
            groups = self._start_groups(init_dir)
        self.actor, self.critic = groups[0], groups[1] if self.use_critic else None
        if self.use_critic and self.critic is None:
            raise ValueError(f"estimator {alg.adv_estimator!r} needs a critic worker group")
        c = alg.kl_ctrl
        self.kl_ctrl = make_kl_controller(c.type, kl_coef=c.kl_coef, target_kl=c.target_kl, horizon=c.horizon)
        self.sampler = PromptSampler(len(prompts), seed)
        w, n = cfg.resources.n_workers, cfg.rollout.n
        self.actor_meta = {
            "ppo_epochs": a.ppo_epochs, "mini_batch_size": a.ppo_mini_batch_size * n // w,
            "micro_batch_size": a.micro_batch_size, "grad_clip": a.grad_clip, "policy_loss": a.policy_loss,
            "loss_agg_mode": a.loss_agg_mode, "clip_ratio": a.clip_ratio, "clip_ratio_low": a.clip_ratio_low,
            "clip_ratio_high": a.clip_ratio_high, "clip_ratio_c": a.clip_ratio_c, "entropy_coeff": a.entropy_coeff,
            "use_kl_loss": a.use_kl_loss, "kl_loss_type": a.kl_loss_type, "kl_loss_coef": a.kl_loss_coef,
            "temperature": cfg.rollout.temperature,
        }
        cr = cfg.critic
        self.critic_meta = {"ppo_epochs": cr.ppo_epochs, "mini_batch_size": a.ppo_mini_batch_size * n // w,
                            "micro_batch_size": cr.micro_batch_size, "cliprange_value": cr.cliprange_value,
                            "grad_clip": cr.grad_clip}

    def _start_groups(self, init_dir: str) -> tuple[WorkerGroup, WorkerGroup | None]:
        a = self.cfg.actor
        share = 2 if self.use_critic else 1  # colocated groups split each bundle's CPUs
        roles = ("actor", "rollout") + (("ref",) if self.needs_ref else ())
        optim = {"lr": a.lr, "weight_decay": a.weight_decay, "warmup_steps": a.warmup_steps}
        actor = actor_group(self.cfg, self.pool, init_dir, roles, optim=optim, share=share)
        if not self.use_critic:
            return actor, None
        critic_dir = Path(init_dir) / "critic"
        return actor, critic_group(self.cfg, self.pool, critic_dir if critic_dir.is_dir() else init_dir,
                                   share=share)

    # ------------------------------------------------------------------ steps
    def _generate(self, prompts: Batch, step_seed: int, greedy: bool = False) -> Batch:
        r = self.cfg.rollout
        return generate(self.actor, prompts, max_new_tokens=self.cfg.task.max_response_length,
                        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, greedy=greedy, seed=step_seed,
                        micro_batch_size=r.micro_batch_size)

    def _score(self, batch: Batch) -> Batch:
        """Rule rewards (``acc``) and the shaped ``scores`` (with the overlong penalty)."""
        acc = torch.as_tensor(rule_rewards(self.tok, batch), dtype=torch.float32)
        d = self.cfg.ppo.dapo
        lengths = batch["response_mask"].sum(-1)
        pen = overlong_penalty(lengths, self.cfg.task.max_response_length, d.overlong_buffer, d.overlong_penalty)
        return batch.union(Batch({"acc": acc, "scores": acc + pen}))

    def collect(self, step: int) -> tuple[Batch, dict[str, float]]:
        """Rollouts for ``ppo.train_batch_size`` prompts, with DAPO dynamic sampling if asked."""
        cfg, n, want = self.cfg, self.cfg.rollout.n, self.cfg.ppo.train_batch_size
        d = cfg.ppo.dapo
        kept: list[Batch] = []
        tries, have, last = 0, 0, None
        while tries < (d.max_sample_tries if d.dynamic_sampling else 1) and have < want:
            prompts = self.prompts.select(self.sampler.take(want))
            last = self._score(self._generate(prompts.repeat(n), self.seed * 100003 + step * 101 + tries))
            part = keep_informative_groups(last, n) if d.dynamic_sampling else last
            kept.append(part)
            have += len(part) // n
            tries += 1
        batch = Batch.concat([b for b in kept if len(b)]) if have else last
        groups = min(len(batch) // n, want)
        while groups > 1 and (groups * n) % cfg.resources.n_workers:
            groups -= 1  # equal shards per rank
        batch = batch.slice(0, groups * n)
        return batch, {"rollout/sample_tries": tries, "rollout/groups_kept": groups}

    def step(self, step: int) -> dict[str, float]:
        t: dict[str, float] = {}
        cfg, alg = self.cfg, self.cfg.algorithm
        with timer(t, "step"):
            with timer(t, "gen"):
                batch, m = self.collect(step)
                if alg.adv_estimator in GREEDY_BASELINE_ESTIMATORS:
                    batch = self._add_greedy_baseline(batch, step)
                if cfg.ppo.balance_batch:
                    batch, m["perf/dp_token_imbalance"] = balance_over_ranks(batch, cfg.rollout.n,
                                                                             cfg.resources.n_workers)
            req = tensors_of(batch, SEQUENCE_KEYS, micro_batch_size=cfg.actor.micro_batch_size,
                             temperature=cfg.rollout.temperature)
            with timer(t, "old_log_prob"):
                if cfg.actor.recompute_log_prob:
                    batch = batch.union(self.actor.compute_log_prob(req))
                else:
                    batch = batch.union(Batch({"old_log_probs": batch["rollout_log_probs"]}))
            if alg.use_kl_in_reward:  # the rewards need them here; for the KL loss alone the update computes them
                with timer(t, "ref"):
                    batch = batch.union(self.actor.compute_ref_log_prob(req))
            if self.critic is not None:
                with timer(t, "values"):
                    batch = batch.union(self.critic.compute_values(req))
            with timer(t, "adv"):
                batch, adv_m = self._advantages(batch)
            if self.critic is not None:
                with timer(t, "update_critic"):
                    req = tensors_of(batch, SEQUENCE_KEYS + CRITIC_UPDATE_KEYS, critic=self.critic_meta,
                                     seed=self.seed + step)
                    m.update(self.critic.update_critic(req).meta["metrics"])
            if step >= cfg.critic.warmup_steps or self.critic is None:
                with timer(t, "update_actor"):
                    req = tensors_of(batch, SEQUENCE_KEYS + ACTOR_UPDATE_KEYS, actor=self.actor_meta,
                                     seed=self.seed + step)
                    m.update(self.actor.update_actor(req).meta["metrics"])
        return {**m, **adv_m, **self._rollout_metrics(batch, t), **t}

    def validate(self, prompts: Batch) -> dict[str, float]:
        """Greedy pass@1 of the current policy (the rollout copy holds the latest weights) on ``prompts``."""
        gen = self._generate(prompts, self.seed, greedy=True)
        acc = rule_rewards(self.tok, gen)
        return {"val/greedy_pass@1": float(acc.mean()),
                "val/response_length": gen["response_mask"].sum(-1).float().mean().item()}

    def _add_greedy_baseline(self, batch: Batch, step: int) -> Batch:
        """ReMax: the reward of one greedy response per prompt is every sample's baseline."""
        n = self.cfg.rollout.n
        firsts = batch.select(np.arange(0, len(batch), n))
        plain = Batch({k: firsts[k] for k in ("prompts", "prompt_mask")}, dict(firsts.non_tensors))
        greedy = self._score(self._generate(plain, self.seed + step, greedy=True))
        return batch.union(Batch({"reward_baselines": greedy["scores"].repeat_interleave(n)}))

    def _advantages(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        alg, mask = self.cfg.algorithm, batch["response_mask"]
        token_rewards = place_scores(batch["scores"], mask)
        metrics: dict[str, float] = {}
        if alg.use_kl_in_reward:
            kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], alg.kl_penalty) * mask
            seq_kl = (kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean().item()
            token_rewards = token_rewards - self.kl_ctrl.value * kl
            metrics.update({"actor/reward_kl_penalty": seq_kl, "actor/reward_kl_coef": self.kl_ctrl.value})
            self.kl_ctrl.update(seq_kl, len(batch))
        adv, ret = compute_advantage(
            alg.adv_estimator, token_level_rewards=token_rewards, response_mask=mask, index=batch["uid"],
            values=batch["values"] if "values" in batch else None,
            reward_baselines=batch["reward_baselines"] if "reward_baselines" in batch else None,
            gamma=alg.gamma, lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo)
        fmask = mask.bool()
        metrics.update({"critic/advantages_mean": adv[fmask].mean().item(),
                        "critic/advantages_std": adv[fmask].std().item() if fmask.sum() > 1 else 0.0,
                        "critic/returns_mean": ret[fmask].mean().item()})
        return batch.union(Batch({"token_level_rewards": token_rewards, "advantages": adv, "returns": ret})), metrics

    def _rollout_metrics(self, batch: Batch, t: dict[str, float]) -> dict[str, float]:
        mask = batch["response_mask"]
        lengths = mask.sum(-1).float()
        resp_tokens = float(lengths.sum())
        total_tokens = resp_tokens + float(batch["prompt_mask"].sum())
        out = {
            "rollout/reward_mean": batch["scores"].mean().item(),
            "rollout/acc": batch["acc"].mean().item(),
            "rollout/response_length": lengths.mean().item(),
            "rollout/clip_ratio": (lengths >= mask.shape[1]).float().mean().item(),
            "perf/tokens_per_s": total_tokens / max(t["timing_s/step"], 1e-9),
            "perf/gen_tokens_per_s": resp_tokens / max(t["timing_s/gen"], 1e-9),
        }
        return out

    def save(self, out_dir: str) -> None:
        self.actor.save(out_dir)
        if self.critic is not None:
            self.critic.save(str(Path(out_dir) / "critic"))

    def close(self) -> None:
        """Stop the worker groups and pool this runner started (borrowed groups stay up)."""
        if self.pool is None:
            return
        for wg in (self.actor, self.critic):
            if wg is not None:
                wg.shutdown()
        self.pool.release()


def run_ppo_round(cfg: Config, *, round_name: str, init_dir: str, tokenizer, data_path: str, out_dir: str,
                  tracker, plot_csv: str | None = None, val_path: str | None = None) -> dict[str, float]:
    """Train one round from ``init_dir``; save the policy (and critic) to ``out_dir``.

    With ``ppo.val_every`` > 0 and ``val_path``, the greedy pass@1 on those prompts is logged
    before the first step, every ``val_every`` steps and after the last."""
    rnd = cfg.ppo.rounds[round_name]
    prompts = prompt_batch(read_rows(data_path), tokenizer, cfg.task.max_prompt_length, data_path)
    every = cfg.ppo.val_every if val_path else 0
    val = prompt_batch(read_rows(val_path), tokenizer, cfg.task.max_prompt_length, val_path) if every else None
    # a round's seed depends on its own name only, so adding a round leaves earlier ones cached
    seed = cfg.seed + zlib.crc32(round_name.encode()) % 100_000
    runner = RoundRunner(cfg, init_dir=init_dir, tokenizer=tokenizer, prompts=prompts, seed=seed)
    log = StepLog(tracker, plot_csv)
    start = time.perf_counter()
    val_rows: list[dict[str, float]] = []
    if every:
        val_rows.append(runner.validate(val))
        tracker.log_metrics(val_rows[-1], step=0)
    for step in (bar := tqdm(range(rnd.steps), desc=f"ppo {round_name}", unit="step")):
        metrics = runner.step(step)
        if every and ((step + 1) % every == 0 or step + 1 == rnd.steps):
            val_rows.append(runner.validate(val))
            metrics.update(val_rows[-1])  # logged at the step whose update it follows
        bar.set_postfix(acc=f"{metrics['rollout/acc']:.3f}", len=f"{metrics['rollout/response_length']:.1f}")
        log.log(step, metrics)
    runner.save(out_dir)
    runner.close()
    tail = log.rows[-min(10, len(log.rows)):]
    out_val = {}
    if val_rows:
        out_val = {"ppo/val_greedy_pass@1_first": val_rows[0]["val/greedy_pass@1"],
                   "ppo/val_greedy_pass@1_last": val_rows[-1]["val/greedy_pass@1"]}
    return {
        **out_val,
        "ppo/acc_first_step": log.rows[0]["rollout/acc"],
        "ppo/acc_last10": float(np.mean([r["rollout/acc"] for r in tail])),
        "ppo/reward_last10": float(np.mean([r["rollout/reward_mean"] for r in tail])),
        "ppo/steps": rnd.steps,
        "ppo/wall_s": time.perf_counter() - start,
    }
