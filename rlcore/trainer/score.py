"""Reward scoring of the SFT policy: n samples per RL prompt, rule rewards, trivial-prompt filter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from rlcore.config import Config
from rlcore.controller.worker_group import WorkerGroup
from rlcore.data.collate import prompt_batch
from rlcore.errors import ConfigError
from rlcore.protocol import Batch
from rlcore.rewards.checks import read_reward_rows
from rlcore.rewards.guard import RewardScorer
from rlcore.trainer.common import model_spec, start_pool
from rlcore.rollout import engine_spec
from rlcore.trainer.generation import generate, generate_spec, reward_scorer, rule_rewards
from rlcore.workers.rollout import RolloutWorker

CHUNK_PROMPTS = 128  # prompts per generate call, so the progress bar moves


def rollout_group(cfg: Config, pool, model_dir: str) -> WorkerGroup[RolloutWorker]:
    """A generation-only worker group over the model at ``model_dir``, initialised."""
    group = WorkerGroup(RolloutWorker, pool, name="rollout", timeout_s=cfg.ray.timeout_s,
                        model=model_spec(cfg, model_dir), engine=engine_spec(cfg.rollout), seed=cfg.seed)
    group.call(RolloutWorker.init_model)
    return group


def sample_chunks(cfg: Config, group: WorkerGroup[RolloutWorker], prompts: Batch, *, n: int, temperature: float,
                  greedy: bool, seed: int, desc: str, max_new_tokens: int | None = None) -> Batch:
    """``n`` responses per prompt (rows ``i * n ... i * n + n - 1`` are prompt ``i``'s), generated
    ``CHUNK_PROMPTS`` prompts at a time with a progress bar. Chunk ``i`` is seeded by ``seed`` and
    ``i``, so the same prompts, seed and resources give the same responses."""
    outs = []
    for i, start in enumerate(tqdm(range(0, len(prompts), CHUNK_PROMPTS), desc=desc, unit="chunk")):
        chunk = prompts.slice(start, start + CHUNK_PROMPTS).repeat(n)
        spec = generate_spec(cfg, temperature=temperature, greedy=greedy, seed=seed * 100003 + i,
                             max_new_tokens=max_new_tokens)
        outs.append(generate(group, RolloutWorker.generate, chunk, spec))
    return Batch.concat(outs)


def sample_rewards(cfg: Config, group: WorkerGroup[RolloutWorker], tokenizer, prompts: Batch, *, scorer: RewardScorer,
                   n: int, temperature: float, greedy: bool, seed: int, desc: str) -> tuple[np.ndarray, Batch]:
    """Rewards ``[prompts, n]`` (scored by ``scorer``) and the generated Batch (:func:`sample_chunks`)."""
    gen = sample_chunks(cfg, group, prompts, n=n, temperature=temperature, greedy=greedy, seed=seed, desc=desc)
    return rule_rewards(tokenizer, gen, scorer, what=desc).reshape(len(prompts), n), gen


def run_score(cfg: Config, *, model_dir: str, tokenizer, data_path: str, out_path: str) -> dict[str, float]:
    """Write the scored (and, if asked, filtered) RL prompts; return SFT-policy reward metrics."""
    df = read_reward_rows(data_path)
    prompts = prompt_batch(df, tokenizer, cfg.task.max_prompt_length, data_path)
    sc = cfg.score
    scorer = reward_scorer(cfg)
    with start_pool(cfg) as pool:
        group = rollout_group(cfg, pool, model_dir)
        try:
            rewards, _ = sample_rewards(cfg, group, tokenizer, prompts, scorer=scorer, n=sc.n,
                                        temperature=sc.temperature, greedy=False, seed=cfg.seed, desc="score")
        finally:
            group.shutdown()
    mean = rewards.mean(axis=1)
    df = df.assign(sft_rewards=list(rewards.tolist()), sft_mean_reward=mean)
    keep = (mean > 0) & (mean < 1) if sc.filter_trivial else np.ones(len(df), dtype=bool)
    if not keep.any():
        raise ConfigError(f"score: every one of {len(df)} prompts has mean reward 0 or 1 under the SFT policy; "
                           "nothing left for PPO (set score.filter_trivial: false or change sft/task)")
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    df[keep].reset_index(drop=True).to_parquet(out_path)
    return {
        "score/mean_reward": float(rewards.mean()),
        "score/pass@1": float(rewards.mean()),
        f"score/pass@{sc.n}": float((rewards.max(axis=1) > 0).mean()),
        "score/frac_all_correct": float((mean == 1).mean()),
        "score/frac_all_wrong": float((mean == 0).mean()),
        "score/prompts_kept": int(keep.sum()),
        "score/prompts_total": len(df),
        "score/reward_errors": scorer.errors,
        "score/reward_timeouts": scorer.timeouts,
    }
