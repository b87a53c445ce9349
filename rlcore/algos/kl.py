"""KL estimators between the policy and a reference, per token: ``KL_ESTIMATORS`` selects by name
(``kl_penalty``; Schulman's k1, k2, k3 and their straight-through variants, as verl names them). Used by the KL
loss term, the KL in the reward, and the rollout-mismatch metrics.
"""

from __future__ import annotations

from typing import Callable

import torch

from rlcore.registry import Registry

KL_ESTIMATORS: Registry[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = Registry("KL estimator")


def _log_ratio(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


def _kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k1: ``logp - logp_ref`` (unbiased, high variance)."""
    return _log_ratio(log_prob, ref_log_prob)


def _kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """abs: ``|logp - logp_ref|``."""
    return _log_ratio(log_prob, ref_log_prob).abs()


def _kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k2: ``0.5 (logp - logp_ref)^2``."""
    return 0.5 * _log_ratio(log_prob, ref_log_prob).square()


def _kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k3 (low-variance): ``e^x - x - 1`` with ``x = logp_ref - logp``, clamped as in verl."""
    x = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(x) - x - 1.0, min=-10.0, max=10.0)


def _straight_through_k2(value_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """``<name>+``: the value of ``value_fn`` with the gradient of k2, ``k2 - sg(k2) + sg(value)``: k2's
    gradient is an unbiased estimate of the gradient of KL(pi || pi_ref) whatever estimator is logged."""

    def estimator(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
        k2 = _kl_k2(log_prob, ref_log_prob)
        return k2 - k2.detach() + value_fn(log_prob, ref_log_prob).detach()

    estimator.__doc__ = f"value of {value_fn.__name__}, gradient of k2"
    return estimator


for _names, _fn in ((("kl", "k1"), _kl_k1), (("abs",), _kl_abs), (("mse", "k2"), _kl_k2),
                    (("low_var_kl", "k3"), _kl_k3)):
    for _name in _names:
        KL_ESTIMATORS.add(_name, _fn)
        KL_ESTIMATORS.add(_name + "+", _straight_through_k2(_fn))


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) (Schulman 2020, "Approximating KL
    divergence", http://joschu.net/blog/kl-approx.html).

    With ``d = log_prob - ref_log_prob``:

    * ``kl`` / ``k1``: ``d``.
    * ``abs``: ``|d|``.
    * ``mse`` / ``k2``: ``0.5 * d^2``.
    * ``low_var_kl`` / ``k3``: ``x = clamp(-d, -20, 20)``, ``clamp(e^x - x - 1, -10, 10)``.
    * any of these with ``+`` (``k3+``, ``low_var_kl+``, ...): the same value, with the gradient of k2
      (a straight-through estimator, verl's ``+`` variants).

    Args:
        log_prob: ``[batch, response_len]`` log-probs of the sampled tokens under pi.
        ref_log_prob: ``[batch, response_len]`` log-probs under the reference policy.
        kind: A name in ``KL_ESTIMATORS``.

    Returns:
        ``[batch, response_len]`` per-token penalty (unmasked; aggregate with a mask).
    """
    return KL_ESTIMATORS.get(kind)(log_prob, ref_log_prob)
