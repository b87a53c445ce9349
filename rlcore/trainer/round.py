"""A PPO-family round as two composed parts: a rollout source and a PPO step.

    runner = RoundRunner(cfg, groups=groups, tokenizer=tok, prompts=prompts, seed=seed)   # ppo.mode sync
    metrics = runner.step(0)

Each step is ``rollout = rollouts.next(step)`` (:mod:`rlcore.trainer.rollouts`: the trainer's ranks generate, or
the asynchronous generators' queue hands over a batch) then ``ppo.train(rollout.batch)``
(:class:`~rlcore.trainer.ppo_step.PPOStep`), then the source hears of the new policy version. Each part saves and
loads its own state; the runner adds the rollouts kept for inspection (``ppo.log_samples``) and the step's metrics.
The round's loop (validation, checkpoints, resume, divergence) is :mod:`rlcore.trainer.ppo`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from rlcore.agents.batch import agent_metrics
from rlcore.config import Config
from rlcore.engine.sequence import response_attention
from rlcore.protocol import Batch, Metrics
from rlcore.trainer.loop.step_log import timer
from rlcore.trainer.groups import RoundGroups
from rlcore.trainer.ppo_step import PPOStep
from rlcore.trainer.rollout_data import sample_rows
from rlcore.trainer.rollouts import RolloutSource, RoundScoring, SyncRollouts, trainer_generate


class RoundRunner:
    """One round over its worker groups: :meth:`step` is one RL step, :meth:`validate` greedy pass@1 on held-out
    prompts. Without ``rollouts`` the source is the synchronous one; ``ppo.mode`` async passes its own."""

    def __init__(self, cfg: Config, *, groups: RoundGroups, tokenizer, prompts: Batch, seed: int,
                 rollouts: RolloutSource | None = None, scoring: RoundScoring | None = None):
        self.cfg, self.tok, self.seed = cfg, tokenizer, seed
        self.actor = groups.actor
        self.scoring = scoring or RoundScoring(cfg, tokenizer, groups.reward_model)
        self.ppo = PPOStep(cfg, groups, seed=seed, reward_weights=self.scoring.weights)
        self.rollouts: RolloutSource = rollouts or SyncRollouts(
            cfg, groups.actor, self.scoring, prompts=prompts, seed=seed,
            greedy_baseline=self.ppo.estimator.needs_greedy_baseline)
        self.samples: list[dict] = []  # ppo.log_samples rows of every step so far (the rollouts file's rows)
        self.last_batch = Batch()  # the last step's whole batch (rollouts, rewards, advantages), for inspection

    @property
    def policy_version(self) -> int:
        """Actor updates so far: the version of the weights the next rollouts use."""
        return self.ppo.policy_version

    def step(self, step: int) -> Metrics:
        t: Metrics = {}
        with timer(t, "step"):
            with timer(t, "gen"):
                rollout = self.rollouts.next(step, self.ppo.policy_version, t)
            batch, m = self.ppo.train(rollout.batch, step, t, during_update=partial(self.rollouts.during_update, step))
            self.rollouts.updated(step, self.ppo.policy_version, t)
        self.samples += sample_rows(batch, self.tok, step, self.cfg.ppo.log_samples, policy_version=rollout.version)
        self.last_batch = batch
        return {**rollout.metrics, **m, **rollout_metrics(batch, t), **self.rollouts.step_metrics(rollout, batch, t),
                **t}

    def validate(self, prompts: Batch) -> Metrics:
        """Greedy pass@1 of the current policy (the trainer's rollout copy holds the latest weights) on ``prompts``."""
        gen = trainer_generate(self.cfg, self.actor, prompts, self.seed, greedy=True)
        rewards = self.scoring.rewards(gen, "ppo validation")
        m = rewards.metrics()
        return {"val/greedy_pass@1": float((rewards.acc >= 1.0).mean()),
                "val/reward_mean": float(rewards.total.mean()),
                "val/response_length": response_attention(gen).sum(-1).float().mean().item(),
                "val/reward_errors": m["reward/errors"], "val/reward_timeouts": m["reward/timeouts"],
                **agent_metrics(gen, "val/agent")}

    def save(self, out_dir: str) -> None:
        self.ppo.save(out_dir)

    def save_state(self, folder: Path) -> dict[str, Any]:
        """Each part's state (the workers write theirs into ``folder``), and the rollouts kept so far."""
        return {"ppo": self.ppo.save_state(folder), "rollouts": self.rollouts.save_state(folder),
                "samples": list(self.samples)}

    def load_state(self, folder: Path, state: dict[str, Any]) -> None:
        """Continue from what :meth:`save_state` wrote and returned: the update's state first (an asynchronous
        source publishes the restored weights before it hands out batches again)."""
        self.ppo.load_state(folder, state["ppo"])
        self.rollouts.load_state(folder, state["rollouts"])
        self.samples = list(state["samples"])


def rollout_metrics(batch: Batch, t: Metrics) -> Metrics:
    """A step's rollouts: reward, accuracy, length (of a whole trajectory: model and observation tokens), the share
    cut at the length limit, throughput; and the tool loop's ``agent/*``."""
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


@contextmanager
def running_sync_round(cfg: Config, groups: RoundGroups, *, init_dir: str, tokenizer, prompts: Batch, seed: int,
                       steps: int | None = None) -> Iterator[RoundRunner]:
    """``ppo.mode: sync``: a :class:`RoundRunner` over ``groups`` with the synchronous source (nothing else to start
    or stop)."""
    yield RoundRunner(cfg, groups=groups, tokenizer=tokenizer, prompts=prompts, seed=seed)

