"""KL-coefficient controllers for the in-reward KL penalty.

``FixedKLController`` keeps the coefficient constant. ``AdaptiveKLController`` is the
proportional controller of Ziegler et al. 2019, "Fine-Tuning Language Models from Human
Preferences" (arXiv:1909.08593, sec. 2.2)::

    e = clip(KL_current / KL_target - 1, -0.2, 0.2)
    beta <- beta * (1 + e * n_steps / horizon)

Controllers are built by name through the ``KL_CONTROLLERS`` registry (``fixed``,
``adaptive``) via ``make_kl_controller``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from rlcore.algos.registry import Registry


class FixedKLController:
    """Constant KL coefficient.

    Attributes:
        value: The coefficient ``beta``.
    """

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient never changes (arguments accepted for interface parity)."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593).

    Attributes:
        value: Current coefficient ``beta``.
        target: Target KL per step.
        horizon: Number of samples over which the error is corrected.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl is None or target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon is None or horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` towards keeping ``current_kl`` at ``target``.

        ``e = clip(current_kl / target - 1, -0.2, 0.2)``; ``value *= 1 + e * n_steps / horizon``.

        Args:
            current_kl: Measured KL (a float or a 0-dim tensor).
            n_steps: Number of samples (batch size) since the last update.
        """
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KLController = Union[FixedKLController, AdaptiveKLController]

KL_CONTROLLERS: Registry[Callable[..., KLController]] = Registry("KL controller")


@KL_CONTROLLERS.register("fixed")
def _make_fixed(*, kl_coef: float, **_unused: Any) -> FixedKLController:
    return FixedKLController(kl_coef)


@KL_CONTROLLERS.register("adaptive")
def _make_adaptive(
    *, kl_coef: float, target_kl: Optional[float], horizon: Optional[float], **_unused: Any
) -> AdaptiveKLController:
    return AdaptiveKLController(init_kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)


def make_kl_controller(
    kind: str, *, kl_coef: float, target_kl: Optional[float] = None, horizon: Optional[float] = None
) -> KLController:
    """Build the KL controller registered as ``kind``.

    Args:
        kind: ``fixed`` or ``adaptive`` (any name in ``KL_CONTROLLERS``).
        kl_coef: Initial (or constant) coefficient.
        target_kl: Target KL (``adaptive`` only; must be > 0).
        horizon: Horizon (``adaptive`` only; must be > 0).

    Returns:
        A controller with ``.value`` and ``.update(current_kl, n_steps)``.

    Raises:
        KeyError: Unknown kind (the message lists the allowed names).
        ValueError: ``adaptive`` without a positive ``target_kl`` or ``horizon``.
    """
    return KL_CONTROLLERS.get(kind)(kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
