"""Policy losses, KL penalties, loss aggregation, value loss and entropy.

Tensor conventions: ``old_log_prob``, ``log_prob``, ``ref_log_prob``, ``advantages``,
``values``, ``returns`` and ``vpreds`` are ``[batch, response_len]`` per-token tensors;
``response_mask`` / ``loss_mask`` is a 0/1 (or bool) ``[batch, response_len]`` mask where
1 marks a response token the loss is trained on and 0 marks padding or an observation
token, which never contributes to a loss or a metric.

Three registries select behaviour by name: ``POLICY_LOSSES`` (``policy_loss``),
``KL_PENALTIES`` (``kl_penalty``) and ``LOSS_AGG_MODES`` (``agg_loss``). Formulas follow
verl's ``trainer/ppo/core_algos.py``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from rlcore.algos.masked import masked_mean, masked_sum
from rlcore.algos.registry import Registry

POLICY_LOSSES: Registry[Callable[..., Any]] = Registry("policy loss")
KL_PENALTIES: Registry[Callable[..., torch.Tensor]] = Registry("KL penalty")
LOSS_AGG_MODES: Registry[Callable[..., torch.Tensor]] = Registry("loss aggregation mode")

# Hyper-parameters only some policy losses use; ``policy_loss`` forwards these.
_EXTRA_POLICY_ARGS = frozenset(
    {"clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "generator"}
)


# ------------------------------------------------------------------- aggregation


@LOSS_AGG_MODES.register("token-mean")
def _agg_token_mean(loss_mat: torch.Tensor, loss_mask: torch.Tensor, **_unused: Any) -> torch.Tensor:
    """``token-mean``: mean over all valid tokens of the batch."""
    return masked_mean(loss_mat, loss_mask)


def _seq_mean(seq_losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean over the sequences that have at least one valid token."""
    non_empty = (loss_mask.to(seq_losses.dtype).sum(dim=-1) > 0).to(seq_losses.dtype)
    return (seq_losses * non_empty).sum() / non_empty.sum().clamp(min=1)


@LOSS_AGG_MODES.register("seq-mean-token-sum")
def _agg_seq_mean_token_sum(loss_mat: torch.Tensor, loss_mask: torch.Tensor, **_unused: Any) -> torch.Tensor:
    """``seq-mean-token-sum``: per-sequence token sum, averaged over non-empty sequences."""
    return _seq_mean(masked_sum(loss_mat, loss_mask, dim=-1), loss_mask)


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def _agg_seq_mean_token_mean(loss_mat: torch.Tensor, loss_mask: torch.Tensor, **_unused: Any) -> torch.Tensor:
    """``seq-mean-token-mean``: per-sequence token mean, averaged over non-empty sequences."""
    return _seq_mean(masked_mean(loss_mat, loss_mask, dim=-1), loss_mask)


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def _agg_seq_mean_token_sum_norm(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_scale_factor: Optional[float] = None, **_unused: Any
) -> torch.Tensor:
    """``seq-mean-token-sum-norm``: total token sum / ``loss_scale_factor`` (default response_len)."""
    scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return masked_sum(loss_mat, loss_mask) / scale


def agg_loss(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str, *, loss_scale_factor: Optional[float] = None
) -> torch.Tensor:
    """Aggregate a per-token loss matrix into a scalar (verl ``agg_loss``; Dr. GRPO,
    Liu et al. 2025, arXiv:2503.20783, motivates the length-unbiased modes).

    With ``m`` the mask, ``L_i = sum_t m_it`` and ``S`` the set of rows with ``L_i > 0``:

    * ``token-mean``: ``sum_it m_it l_it / sum_it m_it``.
    * ``seq-mean-token-sum``: ``mean_{i in S} sum_t m_it l_it``.
    * ``seq-mean-token-mean``: ``mean_{i in S} (sum_t m_it l_it / L_i)``.
    * ``seq-mean-token-sum-norm``: ``sum_it m_it l_it / loss_scale_factor`` where the
      factor defaults to ``response_len`` (``loss_mask.shape[-1]``).

    Fully masked rows are left out of the sequence means (as the latest verl does); an
    all-masked batch aggregates to 0 instead of NaN.

    Args:
        loss_mat: ``[batch, response_len]`` per-token losses.
        loss_mask: ``[batch, response_len]``; 1 = token counted, 0 = ignored.
        mode: A name in ``LOSS_AGG_MODES``.
        loss_scale_factor: Divisor of ``seq-mean-token-sum-norm``.

    Returns:
        0-dim loss tensor.
    """
    return LOSS_AGG_MODES.get(mode)(loss_mat, loss_mask, loss_scale_factor=loss_scale_factor)


# ------------------------------------------------------------------ KL penalties


def _log_ratio(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


@KL_PENALTIES.register("kl", "k1")
def _kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k1: ``logp - logp_ref`` (unbiased, high variance)."""
    return _log_ratio(log_prob, ref_log_prob)


@KL_PENALTIES.register("abs")
def _kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """abs: ``|logp - logp_ref|``."""
    return _log_ratio(log_prob, ref_log_prob).abs()


@KL_PENALTIES.register("mse", "k2")
def _kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k2: ``0.5 (logp - logp_ref)^2``."""
    return 0.5 * _log_ratio(log_prob, ref_log_prob).square()


@KL_PENALTIES.register("low_var_kl", "k3")
def _kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k3 (low-variance): ``e^x - x - 1`` with ``x = logp_ref - logp``, clamped as in verl."""
    x = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(x) - x - 1.0, min=-10.0, max=10.0)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) (Schulman 2020, "Approximating KL
    divergence", http://joschu.net/blog/kl-approx.html).

    With ``d = log_prob - ref_log_prob``:

    * ``kl`` / ``k1``: ``d``.
    * ``abs``: ``|d|``.
    * ``mse`` / ``k2``: ``0.5 * d^2``.
    * ``low_var_kl`` / ``k3``: ``x = clamp(-d, -20, 20)``, ``clamp(e^x - x - 1, -10, 10)``.

    Args:
        log_prob: ``[batch, response_len]`` log-probs of the sampled tokens under pi.
        ref_log_prob: ``[batch, response_len]`` log-probs under the reference policy.
        kind: A name in ``KL_PENALTIES``.

    Returns:
        ``[batch, response_len]`` per-token penalty (unmasked; aggregate with a mask).
    """
    return KL_PENALTIES.get(kind)(log_prob, ref_log_prob)


# ----------------------------------------------------------------- policy losses


def _metrics(like: torch.Tensor, clipfrac: Any, clipfrac_lower: Any, ppo_kl: Any) -> dict:
    """Detached 0-dim metric tensors on ``like``'s device."""

    def as_tensor(v: Any) -> torch.Tensor:
        return v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v), device=like.device)

    return {
        "pg_clipfrac": as_tensor(clipfrac),
        "pg_clipfrac_lower": as_tensor(clipfrac_lower),
        "ppo_kl": as_tensor(ppo_kl),
    }


@POLICY_LOSSES.register("vanilla")
def ppo_clip_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean", clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0, **_unused: Any,
) -> "tuple[torch.Tensor, dict]":
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with asymmetric
    "clip-higher" bounds (DAPO, Yu et al. 2025, arXiv:2503.14476) and dual clip for
    negative advantages (Ye et al. 2020, arXiv:1912.09729).

    ``r = exp(clamp(logp - logp_old, -20, 20))``;
    ``l1 = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``;
    for ``A < 0``: ``l = min(l1, -A c)``, else ``l = l1``; aggregated with ``agg_loss``.
    Metrics: ``pg_clipfrac`` = masked mean of ``[-A clip(r) > -A r]``,
    ``pg_clipfrac_lower`` = masked mean of ``[l1 > -A c and A < 0]``,
    ``ppo_kl`` = masked mean of ``-(clamped log-ratio)``.

    Args:
        old_log_prob: ``[batch, response_len]`` behaviour-policy log-probs.
        log_prob: ``[batch, response_len]`` current-policy log-probs (differentiated).
        advantages: ``[batch, response_len]``.
        response_mask: ``[batch, response_len]``; 1 = token in the loss.
        loss_agg_mode: ``agg_loss`` mode.
        clip_ratio_low: ``eps_low``.
        clip_ratio_high: ``eps_high``.
        clip_ratio_c: Dual-clip constant ``c`` (> 1).

    Returns:
        ``(loss, metrics)``.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    neg_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_ratio_c
    dual = torch.minimum(clipped, loss3)
    negative = advantages < 0
    pg_losses = torch.where(negative, dual, clipped)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    clipfrac = masked_mean((loss2 > loss1).to(log_prob.dtype), response_mask)
    clipfrac_lower = masked_mean(((clipped > loss3) & negative).to(log_prob.dtype), response_mask)
    return loss, _metrics(loss, clipfrac, clipfrac_lower, masked_mean(-neg_kl, response_mask))


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean", clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, **_unused: Any,
) -> "tuple[torch.Tensor, dict]":
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071).

    Sequence ratio ``s_i = exp(mean_{t valid}(logp_it - logp_old_it))`` (geometric mean of
    token ratios). Token-level form with stop-gradient ``sg``:
    ``log s_it = sg[log s_i] + logp_it - sg[logp_it]`` (clamped above at 10), so
    ``s_it == s_i`` in value and ``grad s_it = s_i grad logp_it``.
    ``l_it = max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high))``, aggregated with
    ``loss_agg_mode`` (verl defaults GSPO to ``seq-mean-token-mean``; here the caller
    chooses). ``pg_clipfrac_lower`` is always 0.

    Args:
        old_log_prob: ``[batch, response_len]`` behaviour-policy log-probs.
        log_prob: ``[batch, response_len]`` current-policy log-probs (differentiated).
        advantages: ``[batch, response_len]`` (constant over a sequence in GSPO).
        response_mask: ``[batch, response_len]``; 1 = token in the loss and in ``s_i``.
        loss_agg_mode: ``agg_loss`` mode.
        clip_ratio_low: ``eps_low``.
        clip_ratio_high: ``eps_high``.

    Returns:
        ``(loss, metrics)``.
    """
    neg_kl = log_prob - old_log_prob
    lengths = response_mask.to(log_prob.dtype).sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(neg_kl, response_mask, dim=-1) / lengths
    log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = agg_loss(torch.maximum(loss1, loss2), response_mask, loss_agg_mode)
    clipfrac = masked_mean((loss2 > loss1).to(log_prob.dtype), response_mask)
    return loss, _metrics(loss, clipfrac, 0.0, masked_mean(-neg_kl, response_mask))


@POLICY_LOSSES.register("geo_mean")
def geo_mean_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, **_unused: Any,
) -> "tuple[torch.Tensor, dict]":
    """Geometric-Mean Policy Optimization, GMPO (Zhao et al. 2025, arXiv:2507.20673).

    Token log-ratios ``d_t = logp_t - logp_old_t`` are clipped in log space in the
    pessimistic direction: ``d'_t = sgn(A_t) min(sgn(A_t) d_t, sgn(A_t) clamp(d_t, -eps_low,
    eps_high))``. Per sequence ``rho_i = exp(sum_t m d'_t / (L_i + 1e-8))`` and
    ``Abar_i = sum_t m A_t / (L_i + 1e-8)``; ``loss = mean_i(-Abar_i rho_i)`` over the
    batch (like verl, ``loss_agg_mode`` is not used). ``pg_clipfrac`` /
    ``pg_clipfrac_lower``: masked fraction of tokens whose ``d_t`` was clamped with
    ``A > 0`` / ``A < 0``.

    Args:
        old_log_prob: ``[batch, response_len]`` behaviour-policy log-probs.
        log_prob: ``[batch, response_len]`` current-policy log-probs (differentiated).
        advantages: ``[batch, response_len]`` (sequence-level advantages broadcast).
        response_mask: ``[batch, response_len]``; 1 = token in the loss.
        clip_ratio_low: ``eps_low`` (in log space).
        clip_ratio_high: ``eps_high`` (in log space).

    Returns:
        ``(loss, metrics)``.
    """
    neg_kl = log_prob - old_log_prob
    sign = torch.sign(advantages)
    neg_kl_clamped = torch.clamp(neg_kl, -clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * neg_kl, sign * neg_kl_clamped)
    lengths = response_mask.to(log_prob.dtype).sum(dim=-1) + 1e-8
    ratio = torch.exp(masked_sum(pessimistic, response_mask, dim=-1) / lengths)
    seq_adv = masked_sum(advantages, response_mask, dim=-1) / lengths
    loss = torch.mean(-seq_adv * ratio)
    was_clipped = neg_kl != neg_kl_clamped
    clipfrac = masked_mean((was_clipped & (advantages > 0)).to(log_prob.dtype), response_mask)
    clipfrac_lower = masked_mean((was_clipped & (advantages < 0)).to(log_prob.dtype), response_mask)
    return loss, _metrics(loss, clipfrac, clipfrac_lower, masked_mean(-neg_kl, response_mask))


@POLICY_LOSSES.register("gpg")
def gpg_loss(
    *, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean", **_unused: Any,
) -> "tuple[torch.Tensor, dict]":
    """Group Policy Gradient loss (Chu et al. 2025, arXiv:2504.02546): plain REINFORCE
    ``l_t = -A_t logp_t`` without ratio or clipping, aggregated with ``agg_loss``.
    All metrics are 0.

    Args:
        log_prob: ``[batch, response_len]`` current-policy log-probs (differentiated).
        advantages: ``[batch, response_len]``.
        response_mask: ``[batch, response_len]``; 1 = token in the loss.
        loss_agg_mode: ``agg_loss`` mode.

    Returns:
        ``(loss, metrics)``.
    """
    loss = agg_loss(-log_prob * advantages, response_mask, loss_agg_mode)
    return loss, _metrics(loss, 0.0, 0.0, 0.0)


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean", clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, **_unused: Any,
) -> "tuple[torch.Tensor, dict]":
    """Clipped IS-weight Policy Optimization, CISPO (MiniMax-M1, arXiv:2506.13585, eq. 4-5).

    ``r = exp(clamp(logp - logp_old, -20, 20))``, ``r_hat = clip(r, 1 - eps_low, 1 + eps_high)``;
    ``l_t = -sg[r_hat_t] A_t logp_t`` so every token keeps a gradient, scaled by the
    clipped weight. ``pg_clipfrac`` = masked fraction with ``r != r_hat``; lower is 0.

    Args:
        old_log_prob: ``[batch, response_len]`` behaviour-policy log-probs.
        log_prob: ``[batch, response_len]`` current-policy log-probs (differentiated).
        advantages: ``[batch, response_len]``.
        response_mask: ``[batch, response_len]``; 1 = token in the loss.
        loss_agg_mode: ``agg_loss`` mode.
        clip_ratio_low: ``eps_low``.
        clip_ratio_high: ``eps_high``.

    Returns:
        ``(loss, metrics)``.
    """
    neg_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    weight = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = agg_loss(-weight.detach() * advantages * log_prob, response_mask, loss_agg_mode)
    clipfrac = masked_mean((ratio != weight).to(log_prob.dtype), response_mask)
    return loss, _metrics(loss, clipfrac, 0.0, masked_mean(-neg_kl, response_mask))


def _token_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached per-token ``(A - mean A)(logp - mean logp)`` with means over the mask."""
    adv, logp = advantages.detach(), log_prob.detach()
    return (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))


@POLICY_LOSSES.register("clip_cov")
def clip_cov_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean", clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 0.0002, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0,
    generator: Optional[torch.Generator] = None, **_unused: Any,
) -> "tuple[torch.Tensor, dict]":
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs",
    arXiv:2505.22617).

    PPO-clip loss ``max(-A r, -A clip(r))`` with ``r = exp(logp - logp_old)``, except that
    up to ``k = max(int(clip_cov_ratio * #valid), 1)`` tokens get their loss (and so their
    gradient) zeroed. Candidates are valid tokens not already clipped by PPO whose
    covariance ``(A - mean A)(logp - mean logp)`` lies strictly in ``(lb, ub)``.
    Selection: verl samples ``k`` candidates uniformly at random. Here it is deterministic
    by default -- the ``k`` candidates with the largest covariance (``topk``) -- and only
    random (uniform, like verl) when a ``torch.Generator`` is passed as ``generator``.
    ``pg_clipfrac`` = masked fraction of zeroed tokens; ``pg_clipfrac_lower`` is 0.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[batch, response_len]``.
        loss_agg_mode: ``agg_loss`` mode.
        clip_ratio_low, clip_ratio_high: PPO clip bounds.
        clip_cov_ratio: Fraction of valid tokens to detach.
        clip_cov_lb, clip_cov_ub: Covariance window for candidates.
        generator: Optional RNG making the selection random (verl behaviour).

    Returns:
        ``(loss, metrics)``.
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    valid = response_mask.bool()
    neg_kl = log_prob - old_log_prob
    ratio = torch.exp(neg_kl)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    cov = _token_covariance(advantages, log_prob, response_mask)
    candidate = valid & ~(loss2 > loss1) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    flat_idx = torch.nonzero(candidate.flatten()).flatten()
    k = min(max(int(clip_cov_ratio * int(valid.sum().item())), 1), flat_idx.numel())
    if generator is None:
        chosen = flat_idx[torch.topk(cov.flatten()[flat_idx], k).indices]
    else:
        chosen = flat_idx[torch.randperm(flat_idx.numel(), generator=generator)[:k].to(flat_idx.device)]
    keep = torch.ones(cov.numel(), dtype=log_prob.dtype, device=log_prob.device)
    keep[chosen] = 0.0
    keep = keep.view_as(cov)
    loss = agg_loss(torch.maximum(loss1, loss2) * keep, response_mask, loss_agg_mode)
    clipfrac = masked_mean((keep == 0).to(log_prob.dtype), response_mask)
    return loss, _metrics(loss, clipfrac, 0.0, masked_mean(-neg_kl, response_mask))


@POLICY_LOSSES.register("kl_cov")
def kl_cov_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean", kl_cov_ratio: float = 0.0002, ppo_kl_coef: float = 1.0, **_unused: Any,
) -> "tuple[torch.Tensor, dict]":
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617).

    Unclipped surrogate ``-A r`` (``r = exp(logp - logp_old)``) on every token, plus a
    penalty ``ppo_kl_coef * |logp - logp_old|`` on the ``k = max(int(#valid *
    kl_cov_ratio), 1)`` valid tokens with the largest covariance
    ``(A - mean A)(logp - mean logp)`` (means over valid tokens). The selection is a
    deterministic ``topk``, as in verl. Metrics: ``ppo_kl`` = masked mean of
    ``|logp - logp_old|`` (verl reports the absolute KL here); clip fractions are 0.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[batch, response_len]``.
        loss_agg_mode: ``agg_loss`` mode.
        kl_cov_ratio: Fraction of valid tokens that get the KL penalty.
        ppo_kl_coef: Penalty coefficient.

    Returns:
        ``(loss, metrics)``.
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    valid = response_mask.bool()
    neg_kl = log_prob - old_log_prob
    abs_kl = neg_kl.abs()
    pg_losses = -advantages * torch.exp(neg_kl)
    flat_idx = torch.nonzero(valid.flatten()).flatten()
    if flat_idx.numel() > 0:
        cov = _token_covariance(advantages, log_prob, response_mask).flatten()[flat_idx]
        k = max(1, int(flat_idx.numel() * kl_cov_ratio))
        selected = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        selected[flat_idx[torch.topk(cov, k).indices]] = True
        pg_losses = torch.where(selected.view_as(valid), pg_losses + ppo_kl_coef * abs_kl, pg_losses)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    return loss, _metrics(loss, 0.0, 0.0, masked_mean(abs_kl, response_mask))


def policy_loss(
    mode: str,
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: Optional[float] = None,
    clip_ratio_high: Optional[float] = None,
    clip_ratio_c: float = 3.0,
    **extra: Any,
) -> "tuple[torch.Tensor, dict]":
    """Compute the policy-gradient loss registered under ``mode`` in ``POLICY_LOSSES``.

    Modes: ``vanilla`` (PPO clip + clip-higher + dual clip), ``gspo``, ``geo_mean`` (GMPO),
    ``gpg``, ``cispo``, ``clip_cov``, ``kl_cov``; see each function's docstring.

    Args:
        mode: Policy-loss name.
        old_log_prob: ``[batch, response_len]`` behaviour-policy log-probs.
        log_prob: ``[batch, response_len]`` current-policy log-probs (differentiated).
        advantages: ``[batch, response_len]``.
        response_mask: ``[batch, response_len]``; 1 = token in the loss, 0 = ignored.
        loss_agg_mode: ``agg_loss`` mode (``geo_mean`` ignores it, as verl).
        clip_ratio: Symmetric clip ``eps``.
        clip_ratio_low: Lower clip ``eps_low``; defaults to ``clip_ratio``.
        clip_ratio_high: Upper clip ``eps_high``; defaults to ``clip_ratio``.
        clip_ratio_c: Dual-clip constant (``vanilla``).
        **extra: Mode-specific hyper-parameters: ``clip_cov_ratio`` (0.0002),
            ``clip_cov_lb`` (1.0), ``clip_cov_ub`` (5.0), ``generator`` (None) for
            ``clip_cov``; ``kl_cov_ratio`` (0.0002), ``ppo_kl_coef`` (1.0) for ``kl_cov``.

    Returns:
        ``(loss, metrics)``: 0-dim loss tensor and a dict of detached 0-dim tensors with at
        least ``pg_clipfrac``, ``pg_clipfrac_lower`` and ``ppo_kl``.

    Raises:
        KeyError: Unknown mode (the message lists the allowed names).
        TypeError: Unknown keyword in ``extra``.
    """
    unknown = set(extra) - _EXTRA_POLICY_ARGS
    if unknown:
        raise TypeError(f"policy_loss got unexpected keyword arguments {sorted(unknown)}")
    fn = POLICY_LOSSES.get(mode)
    return fn(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        clip_ratio_low=clip_ratio if clip_ratio_low is None else clip_ratio_low,
        clip_ratio_high=clip_ratio if clip_ratio_high is None else clip_ratio_high,
        clip_ratio_c=clip_ratio_c, **extra,
    )


# ------------------------------------------------------------ value loss, entropy


def value_loss(
    vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, *,
    cliprange_value: float, loss_agg_mode: str = "token-mean",
) -> "tuple[torch.Tensor, torch.Tensor]":
    """Clipped value-function loss of PPO (Schulman et al. 2017, arXiv:1707.06347; as in
    TRL/verl ``compute_value_loss``).

    ``v_clip = clamp(vpred, V_old - c, V_old + c)``;
    ``loss = 0.5 * agg(max((vpred - R)^2, (v_clip - R)^2))``;
    ``clipfrac = masked_mean([(v_clip - R)^2 > (vpred - R)^2])``.

    Args:
        vpreds: ``[batch, response_len]`` current value predictions (differentiated).
        returns: ``[batch, response_len]`` value targets ``R``.
        values: ``[batch, response_len]`` values at rollout time ``V_old``.
        response_mask: ``[batch, response_len]``; 1 = token in the loss.
        cliprange_value: Clip range ``c``.
        loss_agg_mode: ``agg_loss`` mode.

    Returns:
        ``(loss, clipfrac)``, both 0-dim tensors (``clipfrac`` detached).
    """
    vclipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    unclipped_loss = (vpreds - returns) ** 2
    clipped_loss = (vclipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(unclipped_loss, clipped_loss), response_mask, loss_agg_mode)
    clipfrac = masked_mean((clipped_loss > unclipped_loss).to(vpreds.dtype), response_mask).detach()
    return loss, clipfrac


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution ``softmax(logits)`` at each position.

    ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` (equal to ``-sum p log p``); the
    logsumexp and softmax are computed stably, and ``-inf`` logits (banned tokens, p = 0)
    contribute 0 instead of ``0 * -inf = nan``.

    Args:
        logits: ``[..., vocab]`` unnormalised scores, e.g. ``[batch, response_len, vocab]``.

    Returns:
        ``[...]`` entropy per position, e.g. ``[batch, response_len]``.
    """
    finite = torch.where(torch.isneginf(logits), torch.zeros((), dtype=logits.dtype, device=logits.device), logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * finite).sum(dim=-1)
