"""The one set of knobs both systems share, and where the benchmark keeps its files.

Everything comes from ``params.yaml`` (the project's defaults) plus the few overrides
below, so "the same settings" is true by construction: ``bench.ours`` builds its
rlcore Config from :func:`rl_config`, ``bench.trl_side`` builds its GRPOConfig from
:func:`shared` (the same Config, read through one function).

    .venv/bin/python -m bench.run_bench            # full run (make bench)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcore.config import Config, load_config

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
WORK_DIR = BENCH_DIR / "_work"  # gitignored: data, the tiny base model, the SFT model, profiles
PARAMS = REPO_ROOT / "params.yaml"

# One optimizer step per RL step: a PPO mini-batch is the whole train batch (TRL: one
# gradient-accumulation window covers the whole generation batch).
OVERRIDES: dict[str, Any] = {
    "tracking.enabled": False,
    "actor.ppo_mini_batch_size": 32,  # == ppo.train_batch_size
}
RL_SEED = 1234  # prompt order and sampling seed of the RL phase (both systems take the same prompt order)


def rl_config() -> Config:
    """The rlcore Config of the benchmark (params.yaml + OVERRIDES)."""
    cfg = load_config(PARAMS, OVERRIDES)
    assert cfg.actor.ppo_mini_batch_size == cfg.ppo.train_batch_size, "one optimizer step per RL step"
    return cfg


def shared(cfg: Config) -> dict[str, Any]:
    """The settings both systems must agree on (printed in RESULTS.md)."""
    return {
        "prompts_per_step": cfg.ppo.train_batch_size,
        "generations_per_prompt": cfg.rollout.n,
        "completions_per_step": cfg.ppo.train_batch_size * cfg.rollout.n,
        "max_prompt_length": cfg.task.max_prompt_length,
        "max_response_length": cfg.task.max_response_length,
        "temperature": cfg.rollout.temperature,
        "top_p": cfg.rollout.top_p,
        "top_k": cfg.rollout.top_k,
        "learning_rate": cfg.actor.lr,
        "lr_schedule": "constant (no warm-up)",
        "weight_decay": cfg.actor.weight_decay,
        "grad_clip": cfg.actor.grad_clip,
        "clip_ratio": cfg.actor.clip_ratio,
        "kl_coef": cfg.actor.kl_loss_coef,
        "kl_estimator": "k3 (low_var_kl)",
        "optimisation_passes_per_step": cfg.actor.ppo_epochs,
        "optimizer_steps_per_rl_step": cfg.ppo.train_batch_size // cfg.actor.ppo_mini_batch_size,
        "loss_aggregation": cfg.actor.loss_agg_mode,
        "dtype": cfg.model.dtype,
        "seed": RL_SEED,
    }


def paths() -> dict[str, Path]:
    return {
        "data": WORK_DIR / "data",
        "rl_data": WORK_DIR / "data" / "rl_train.parquet",
        "sft_data": WORK_DIR / "data" / "sft_train.parquet",
        "base": WORK_DIR / "base",
        "sft": WORK_DIR / "sft",
        "profile": WORK_DIR / "profile",
    }
