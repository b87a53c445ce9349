"""The names params.yaml may select, for validation without importing the registries.

Loading params.yaml must stay light (no torch, pandas, pyarrow or ray): every stage validates
its params before anything heavy starts, and ``rlcore/config.py`` is a DVC dependency of every
stage. The registries themselves live beside the code they select (``rlcore.algos``,
``rlcore.engine.strategy``, ...); ``tests/test_names.py`` checks that each tuple here equals its
registry's names, so a new entry cannot be forgotten on either side.
"""

from __future__ import annotations

# rlcore.algos.advantage.ESTIMATORS
ADV_ESTIMATORS = ("gae", "gpg", "grpo", "grpo_passk", "opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                  "remax", "rloo")
# rlcore.algos.losses.POLICY_LOSSES
POLICY_LOSSES = ("cispo", "clip_cov", "geo_mean", "gpg", "gspo", "kl_cov", "vanilla")
# rlcore.algos.losses.KL_ESTIMATORS
KL_ESTIMATORS = ("abs", "abs+", "k1", "k1+", "k2", "k2+", "k3", "k3+", "kl", "kl+", "low_var_kl", "low_var_kl+",
                 "mse", "mse+")
# rlcore.algos.losses.LOSS_AGG_MODES
LOSS_AGG_MODES = ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean", "token-sum")
# rlcore.algos.kl_control.KL_CONTROLLERS
KL_CONTROLLERS = ("adaptive", "fixed")
# rlcore.engine.strategy.STRATEGIES, and those of them that shard parameters (``Strategy.shards``)
STRATEGIES = ("ddp", "fsdp")
SHARDED_STRATEGIES = ("fsdp",)
# rlcore.rollout.ENGINES
ROLLOUT_ENGINES = ("hf", "static")
# rlcore.data.splits.TASKS
TASKS = ("arithmetic", "file", "gsm8k")
# rlcore.trainer.ppo.ROUND_MODES
PPO_MODES = ("async", "sync")


def check_name(kind: str, value: str, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``; else ValueError listing them (pydantic reports it
    with the key)."""
    if value not in allowed:
        raise ValueError(f"unknown {kind} {value!r}; allowed: {', '.join(sorted(allowed))}")
    return value
