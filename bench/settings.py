"""The one set of knobs both systems share, and where the benchmark keeps its files.

Everything comes from ``params.yaml`` (the project's defaults) plus the few overrides
below, so "the same settings" is true by construction: ``bench.ours`` builds its
rlcore Config from :func:`rl_config`, ``bench.trl_side`` builds its GRPOConfig from
:func:`shared` (the same Config, read through one function).

    .venv/bin/python -m bench.run_bench            # full run (make bench)
"""

from __future__ import annotations

import hashlib
import json
import os
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
    "ppo.train_batch_size": 32,  # the benchmark's step: 32 prompts x rollout.n responses, whatever the recipe uses
}
# prompt order and sampling seed of the RL phase (both systems take the same prompt order); bench.reward_gap runs
# other seeds through BENCH_RL_SEED
RL_SEED = int(os.environ.get("BENCH_RL_SEED") or 1234)
# The SFT checkpoint is a fixture (both systems start from it), not what is measured: its length is
# pinned so a first run (which builds it) stays within the 15-minute budget whatever params.yaml says.
FIXTURE_OVERRIDES: dict[str, Any] = {"sft.steps": 1000}
# What the SFT checkpoint depends on (the RL split's size is not among them: it does not change the SFT split).
SFT_KEYS = ("seed", "model", "sft", "task.name", "task.min_digits", "task.max_digits", "task.ops", "task.n_sft",
            "task.n_test", "task.max_prompt_length", "task.max_response_length", "task.long_tail_frac",
            "task.long_tail_length")
DATA_KEYS = ("seed", "task")


# Named configurations of `make bench` (``run_bench --configs``): (shared sets, fixture sets).
# realistic: a 6.3M-parameter Llama (hidden 256, 6 layers), 16 prompts x 8 = 128 responses of up to 32
# tokens per step, from a practically untrained model (one SFT step at lr 1e-6) whose answers mostly run to
# the limit (78% of them; 5 or 20 SFT steps at the recipe's lr already teach the arithmetic answers' early EOS:
# 3-4 tokens). The generation-bound regime of long reasoning answers; its rewards are ~0 for both systems.
# long: answers that run to their limit with a larger batch: an 8.4M-parameter Llama (hidden 256, 8 layers), 32 prompts
# x 8 = 256 responses of up to 50 tokens per step, the practically untrained fixture of realistic (answers run to the
# limit): the update-bound regime (its figures in docs/results/memory.md and the long section below).
# lora: the default configuration with both systems training rank-16 LoRA adapters (peft) at the LoRA recipe's
# learning rate (examples/lora.yaml); the reference is the model with its adapter disabled in both.
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "default": ({}, {}),
    "realistic": ({"model.tiny.hidden_size": 256, "model.tiny.num_layers": 6, "model.tiny.num_heads": 4,
                   "model.tiny.intermediate_size": 1024, "task.max_response_length": 32,
                   "ppo.train_batch_size": 16, "rollout.n": 8},
                  {"sft.steps": 1, "sft.lr": 1e-6}),
    "long": ({"model.tiny.hidden_size": 256, "model.tiny.num_layers": 8, "model.tiny.num_heads": 4,
              "model.tiny.intermediate_size": 1024, "task.max_response_length": 50,
              "ppo.train_batch_size": 32, "rollout.n": 8},
             {"sft.steps": 1, "sft.lr": 1e-6}),
    "lora": ({"actor.lora.rank": 16, "actor.lora.alpha": 32.0, "actor.lr": 1e-3}, {}),
}
# Steps each configuration runs when the command line does not say (a long step takes ~10 s per system).
# long runs the headline pair only: four systems at that size at once (two TRL processes of 3-5 GiB, four ranks of
# 2.2 GiB) left too little of the machine's 24 GiB and Ray's memory monitor killed a rank
RUN_SIZES: dict[str, dict[str, int]] = {"long": {"steps": 8, "warmup": 1, "block": 2, "profile_steps": 3,
                                                 "like_for_like": 0}}
SET_ENV, FIXTURE_SET_ENV = "BENCH_SET", "BENCH_FIXTURE_SET"


def shared_sets() -> dict[str, Any]:
    """``--set KEY=VALUE`` of the run (both systems and the fixture), passed to the children in the environment."""
    return json.loads(os.environ.get(SET_ENV) or "{}")


def fixture_sets() -> dict[str, Any]:
    """``--fixture-set KEY=VALUE`` of the run (the fixture build only, e.g. ``sft.steps=20``)."""
    return json.loads(os.environ.get(FIXTURE_SET_ENV) or "{}")


def with_one_update(sets: dict[str, Any]) -> dict[str, Any]:
    """``actor.ppo_mini_batch_size`` = ``ppo.train_batch_size`` (whatever the sets choose): one optimizer
    step per RL step."""
    return {**sets, "actor.ppo_mini_batch_size": sets["ppo.train_batch_size"]}


def rl_config(extra: dict[str, Any] | None = None) -> Config:
    """The rlcore Config of the benchmark (params.yaml + OVERRIDES + ``--set`` + ``extra``, e.g. from --ours-set)."""
    cfg = load_config(PARAMS, with_one_update({**OVERRIDES, **shared_sets(), **(extra or {})}))
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
        "clip_ratio": cfg.actor.loss.clip_ratio,
        "kl_coef": cfg.actor.kl_loss_coef,
        "kl_estimator": "k3 (low_var_kl)",
        "optimisation_passes_per_step": cfg.actor.ppo_epochs,
        "optimizer_steps_per_rl_step": cfg.ppo.train_batch_size // cfg.actor.ppo_mini_batch_size,
        "loss_aggregation": cfg.actor.loss.loss_agg_mode,
        "dtype": cfg.model.dtype,
        "seed": RL_SEED,
    }


def fixture_config() -> Config:
    """The config the data, base model and SFT checkpoint are built from."""
    return load_config(PARAMS, with_one_update({**OVERRIDES, **shared_sets(), **FIXTURE_OVERRIDES, **fixture_sets()}))


def fixture_key(cfg: Config, keys: tuple[str, ...]) -> str:
    """Short hash of the dotted ``keys`` of ``cfg``: a params.yaml change there builds a new fixture."""
    data = cfg.model_dump(mode="json")
    picked = {}
    for key in keys:
        node = data
        for part in key.split("."):
            node = node[part]
        picked[key] = node
    return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:10]


def paths() -> dict[str, Path]:
    cfg = fixture_config()
    data = WORK_DIR / f"data-{fixture_key(cfg, DATA_KEYS)}"
    return {
        "data": data,
        "rl_data": data / "rl_train.parquet",
        "sft_data": data / "sft_train.parquet",
        "base": WORK_DIR / "base",  # materialize_tiny keys its folders by shape and seed
        "sft": WORK_DIR / f"sft-{fixture_key(cfg, SFT_KEYS)}",
    }
