"""Reward scoring of the SFT policy: n samples per RL prompt, rule rewards, trivial-prompt filter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from rlcore.config import Config
from rlcore.data.collate import prompt_batch
from rlcore.data.schema import read_rows
from rlcore.protocol import Batch
from rlcore.trainer.common import actor_group, generate, rule_rewards, start_pool

CHUNK_PROMPTS = 128  # prompts per generate call, so the progress bar moves


def sample_rewards(cfg: Config, wg, tokenizer, prompts: Batch, *, n: int, temperature: float, greedy: bool,
                   seed: int, desc: str) -> tuple[np.ndarray, Batch]:
    """Rewards ``[prompts, n]`` and the generated Batch, chunk by chunk with a progress bar."""
    outs = []
    for i, start in enumerate(tqdm(range(0, len(prompts), CHUNK_PROMPTS), desc=desc, unit="chunk")):
        chunk = prompts.slice(start, start + CHUNK_PROMPTS).repeat(n)
        outs.append(generate(wg, chunk, max_new_tokens=cfg.task.max_response_length, temperature=temperature,
                             top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, greedy=greedy,
                             seed=seed * 100003 + i, micro_batch_size=cfg.rollout.micro_batch_size))
    gen = Batch.concat(outs)
    return rule_rewards(tokenizer, gen).reshape(len(prompts), n), gen


def run_score(cfg: Config, *, model_dir: str, tokenizer, data_path: str, out_path: str) -> dict[str, float]:
    """Write the scored (and, if asked, filtered) RL prompts; return SFT-policy reward metrics."""
    df = read_rows(data_path)
    prompts = prompt_batch(df, tokenizer, cfg.task.max_prompt_length, data_path)
    pool = start_pool(cfg)
    wg = actor_group(cfg, pool, model_dir, ("rollout",))
    sc = cfg.score
    rewards, _ = sample_rewards(cfg, wg, tokenizer, prompts, n=sc.n, temperature=sc.temperature, greedy=False,
                                seed=cfg.seed, desc="score")
    wg.shutdown()
    pool.release()
    mean = rewards.mean(axis=1)
    df = df.assign(sft_rewards=list(rewards.tolist()), sft_mean_reward=mean)
    keep = (mean > 0) & (mean < 1) if sc.filter_trivial else np.ones(len(df), dtype=bool)
    if not keep.any():
        raise RuntimeError(f"score: every one of {len(df)} prompts has mean reward 0 or 1 under the SFT policy; "
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
    }
