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

from typing import Callable, Union

from rlcore.registry import Registry, check_keywords, keyword_names


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

    def __init__(self, kl_coef: float, target_kl: float, horizon: float):
        if target_kl is None or target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon is None or horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(kl_coef)
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
KL_CONTROLLERS.add("fixed", FixedKLController)
KL_CONTROLLERS.add("adaptive", AdaptiveKLController)


def controller_options(kind: str) -> frozenset[str]:
    """The constructor arguments of the controller ``kind`` (read by name from ``algorithm.kl_ctrl``)."""
    return keyword_names(KL_CONTROLLERS.get(kind)) - {"self"}


def make_kl_controller(kind: str, **options: float) -> KLController:
    """Build the KL controller registered as ``kind``.

    Args:
        kind: ``fixed`` or ``adaptive`` (any name in ``KL_CONTROLLERS``).
        **options: Exactly what the controller takes: ``kl_coef`` (initial or constant coefficient)
            for both; ``target_kl`` and ``horizon`` (both > 0) for ``adaptive``.

    Returns:
        A controller with ``.value`` and ``.update(current_kl, n_steps)``.

    Raises:
        KeyError: Unknown kind (the message lists the allowed names).
        TypeError: An option the controller does not take, or a missing one.
        ValueError: ``adaptive`` without a positive ``target_kl`` or ``horizon``.
    """
    check_keywords(f"KL controller {kind!r}", options, controller_options(kind))
    return KL_CONTROLLERS.get(kind)(**options)
