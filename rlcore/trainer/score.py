"""Reward scoring of the SFT policy: n samples per RL prompt, the training reward and accuracy, trivial-prompt filter."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from rlcore.agents.check import tool_schemas
from rlcore.config import Config
from rlcore.controller.worker_group import WorkerGroup
from rlcore.data.collate import prompt_batch
from rlcore.protocol import Batch
from rlcore.rewards.checks import read_reward_rows
from rlcore.rewards.scoring import Rewards, RewardScorer, agreement
from rlcore.trainer.loop.pool import start_pool
from rlcore.trainer.samples.scoring import reward_scorer, score_responses
from rlcore.trainer.samples.reward_model import RewardModelGroup, colocated, start_reward_model
from rlcore.trainer.samples.generation import rollout_worker_group, sample_chunks
from rlcore.workers.rollout import RolloutWorker

def sample_rewards(cfg: Config, group: WorkerGroup[RolloutWorker], tokenizer, prompts: Batch, *, scorer: RewardScorer,
                   n: int, temperature: float, greedy: bool, seed: int, desc: str,
                   reward_model: RewardModelGroup | None = None) -> tuple[Rewards, Batch]:
    """The :class:`Rewards` of ``n`` responses per prompt (scored by ``scorer`` and ``reward_model``; sample
    ``i * n + j`` is prompt ``i``'s ``j``-th) and the generated Batch (:func:`sample_chunks`)."""
    gen = sample_chunks(cfg, group, prompts, n=n, temperature=temperature, greedy=greedy, seed=seed, desc=desc)
    return score_responses(tokenizer, gen, scorer, what=desc, reward_model=reward_model), gen


def run_score(cfg: Config, *, model_dir: str, tokenizer, data_path: str, out_path: str) -> dict[str, float]:
    """Write the scored (and, if asked, filtered) RL prompts; return the SFT policy's reward metrics.

    ``score.filter_trivial`` drops the prompts whose ``score.n`` training rewards are all equal: their group
    advantages would be 0 (with a 0/1 reward: always right or always wrong). When that would drop every prompt,
    all are kept, with a warning."""
    df = read_reward_rows(data_path, cfg.reward)
    prompts = prompt_batch(df, tokenizer, cfg.task.max_prompt_length, data_path, tool_schemas(cfg.rollout.agent))
    sc = cfg.score
    scorer = reward_scorer(cfg.reward, df, data_path)
    with start_pool(cfg) as pool:
        group = rollout_worker_group(cfg, pool, model_dir, share=1 + colocated(cfg))
        rm = None
        try:
            rm = start_reward_model(cfg, pool, share=2)
            scored, _ = sample_rewards(cfg, group, tokenizer, prompts, scorer=scorer, n=sc.n,
                                       temperature=sc.temperature, greedy=False, seed=cfg.seed, desc="score",
                                       reward_model=rm)
        finally:
            group.shutdown()
            if rm is not None:
                rm.shutdown()
    rewards = scored.total.reshape(len(df), sc.n)
    correct = (scored.acc >= 1.0).reshape(len(df), sc.n)
    mean = rewards.mean(axis=1)
    informative = rewards.max(axis=1) > rewards.min(axis=1)
    keep = informative if sc.filter_trivial else np.ones(len(df), dtype=bool)
    if not keep.any():
        print(f"warning: score: the SFT policy's {sc.n} rewards are equal on every one of the {len(df)} prompts; "
              "keeping them all (PPO steps learn nothing until the policy's samples differ: train SFT longer or "
              "check the reward)", file=sys.stderr, flush=True)
        keep = np.ones(len(df), dtype=bool)
    df = df.assign(sft_rewards=list(rewards.tolist()), sft_mean_reward=mean, sft_pass_rate=correct.mean(axis=1))
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    df[keep].reset_index(drop=True).to_parquet(out_path)
    return {
        "score/mean_reward": float(rewards.mean()),
        "score/pass@1": float(correct.mean()),
        f"score/pass@{sc.n}": float(correct.any(axis=1).mean()),
        "score/frac_all_correct": float(correct.all(axis=1).mean()),
        "score/frac_all_wrong": float((~correct).all(axis=1).mean()),
        "score/prompts_kept": int(keep.sum()),
        "score/prompts_total": len(df),
        **{f"score/{k}": v for k, v in scored.metrics().items()},
        **({"score/reward/rm/agreement": share} if "rm" in scored.values and (share := agreement(
            scored.values["rm"], scored.acc >= 1.0, sc.n)) is not None else {}),
    }
