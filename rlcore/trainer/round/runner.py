"""A PPO-family round as two composed parts: a batch source and a PPO step.

    with running_round(cfg, init_dir=..., tokenizer=tok, prompts=prompts, seed=seed) as runner:   # modes.py
        metrics = runner.step(0)

Each step is ``scored = source.next(step)`` (:mod:`rlcore.trainer.round.source`: the trainer's ranks generate, or
the asynchronous generators' queue hands over a batch) then ``ppo.train(scored.batch)``
(:class:`~rlcore.trainer.round.ppo_step.PPOStep`), then the source hears of the new policy version. Each part saves
and loads its own state; the runner adds the samples kept for inspection (``ppo.log_samples``) and the step's
metrics. The round's loop (validation, checkpoints, resume, divergence) is :mod:`rlcore.trainer.ppo`'s.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from rlcore.agents.batch import agent_metrics
from rlcore.agents.trajectory_rows import main_rows
from rlcore.config import Config
from rlcore.engine.sequence import response_attention
from rlcore.protocol import Batch, Metrics
from rlcore.trainer.loop.step_log import timer
from rlcore.trainer.round.kept_samples import sample_rows
from rlcore.trainer.round.ppo_step import PPOStep
from rlcore.trainer.round.scoring import RoundScoring
from rlcore.trainer.round.source import BatchSource
from rlcore.trainer.round.worker_groups import RoundWorkerGroups, trainer_generate


class RoundRunner:
    """One round over its worker groups: :meth:`step` is one RL step, :meth:`validate` greedy pass@1 on held-out
    prompts; ``source`` is the ``ppo.mode``'s (:mod:`rlcore.trainer.round.modes` composes them)."""

    def __init__(self, cfg: Config, *, worker_groups: RoundWorkerGroups, source: BatchSource, scoring: RoundScoring,
                 tokenizer, seed: int):
        self.cfg, self.tok, self.seed = cfg, tokenizer, seed
        self.actor = worker_groups.actor
        self.scoring = scoring
        self.ppo = PPOStep(cfg, worker_groups, seed=seed, reward_weights=scoring.weights)
        self.source = source
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
                scored = self.source.next(step, self.ppo.policy_version, t)
            batch, m = self.ppo.train(scored.batch, step, t, during_update=partial(self.source.during_update, step))
            self.source.updated(step, self.ppo.policy_version, t)
        batch = main_rows(batch)  # one row per sample (an agent program's trajectory may train as several)
        self.samples += sample_rows(batch, self.tok, step, self.cfg.ppo.log_samples, policy_version=scored.version)
        self.last_batch = batch
        return {**scored.metrics, **m, **rollout_metrics(batch, t), **self.source.step_metrics(scored, batch, t), **t}

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
        return {"ppo": self.ppo.save_state(folder), "source": self.source.save_state(folder),
                "samples": list(self.samples)}

    def load_state(self, folder: Path, state: dict[str, Any]) -> None:
        """Continue from what :meth:`save_state` wrote and returned: the update's state first (an asynchronous
        source publishes the restored weights before it hands out batches again)."""
        self.ppo.load_state(folder, state["ppo"])
        self.source.load_state(folder, state["source"])
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
