"""RL algorithm math: advantage estimators, policy/value losses, KL penalties, KL control.

Pure tensor functions (torch/numpy only, no I/O, no config objects). Names that a config
selects are looked up in the registries ``ESTIMATORS``, ``POLICY_LOSSES``,
``KL_PENALTIES``, ``LOSS_AGG_MODES`` and ``KL_CONTROLLERS``.
"""

from rlcore.algos.advantage import ESTIMATORS, compute_advantage
from rlcore.algos.kl_control import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    FixedKLController,
    make_kl_controller,
)
from rlcore.algos.losses import (
    KL_PENALTIES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    value_loss,
)
from rlcore.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rlcore.algos.registry import Registry

__all__ = [
    "ESTIMATORS",
    "KL_CONTROLLERS",
    "KL_PENALTIES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "Registry",
    "agg_loss",
    "compute_advantage",
    "entropy_from_logits",
    "kl_penalty",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "value_loss",
]
