"""Policy losses: the 14 ways of turning log-probs and advantages into the actor's loss (``POLICY_LOSSES``).

Tensor conventions: ``old_log_prob``, ``log_prob``, ``ref_log_prob``, ``advantages``,
``values``, ``returns`` and ``vpreds`` are ``[batch, response_len]`` per-token tensors;
``response_mask`` / ``loss_mask`` is a 0/1 (or bool) ``[batch, response_len]`` mask where
1 marks a response token the loss is trained on and 0 marks padding or an observation
token, which never contributes to a loss or a metric.

``POLICY_LOSSES`` selects by name (params.yaml ``actor.loss.name``); an entry's options are the keywords of its
function, read by name from the ``actor.loss`` section (``rlcore.config.PolicyLossConfig``, which declares each
option once, with its doc and limits; the actor update hands it over as it is). Each loss is aggregated by
``rlcore.algos.aggregation`` (``agg_loss``, ``AggScale``); the KL estimators are ``rlcore.algos.kl``'s and the
critic's loss ``rlcore.algos.value_loss``. Formulas follow the papers cited in each docstring and verl's current
``core_algos.py``; where rlcore differs on purpose, the docstring says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from rlcore.algos.aggregation import AggScale, agg_loss, normalize
from rlcore.algos.masked import masked_mean, masked_sum
from rlcore.algos.off_policy import bypass_is_weights, rejection_keep
from rlcore.registry import Registry, check_keywords, keyword_names

_LOSS_TENSORS = frozenset({"log_prob", "advantages", "response_mask"})  # and old_log_prob, for ratio losses
_LOSS_CALL_ARGS = frozenset({"agg_scale", "generator", "is_weights"})  # given per call, not settings


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss and the keywords it takes beyond the four tensors."""

    fn: Callable[..., "tuple[torch.Tensor, dict]"]
    keywords: frozenset[str]
    uses_old_log_prob: bool
    """Whether it has an importance ratio (all but ``gpg``)."""
    old_is_behaviour: bool = False
    """Its ``old_log_prob`` must be the behaviour (rollout) policy's, never recomputed: it corrects for the
    gap to the current policy itself (``bypass_mode``)."""

    @property
    def takes_is_weights(self) -> bool:
        """Whether it weighs its per-token loss by off-policy importance weights (``is_weights``)."""
        return "is_weights" in self.keywords

    @property
    def options(self) -> frozenset[str]:
        """The settings it takes (what a caller reads by name from params.yaml's ``actor.loss``): every keyword but
        the tensors and what is given per call."""
        return self.keywords - _LOSS_CALL_ARGS


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def register_policy_loss(name: str, *, old_is_behaviour: bool = False):
    """Register a policy loss; its keywords beyond the tensors are its settings (each a key of params.yaml's
    ``actor.loss``, which a test checks) and the per-call ``agg_scale`` / ``generator`` / ``is_weights``.
    ``old_is_behaviour``: see :attr:`PolicyLoss.old_is_behaviour`."""

    def decorator(fn):
        params = keyword_names(fn)
        if not _LOSS_TENSORS <= params:
            raise TypeError(f"policy loss {name!r} must take {sorted(_LOSS_TENSORS)}")
        keywords = params - _LOSS_TENSORS - {"old_log_prob"}
        POLICY_LOSSES.add(name, PolicyLoss(fn, keywords, "old_log_prob" in params, old_is_behaviour))
        return fn

    return decorator


def _weighted(pg_losses: torch.Tensor, is_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """The per-token losses ``[batch, response_len]`` times the off-policy importance weights of the proximal
    over the behaviour policy (``rlcore.algos.off_policy``; verl's ``rollout_is_weights``), before aggregation;
    unchanged without weights."""
    return pg_losses if is_weights is None else pg_losses * is_weights


def _metrics(like: torch.Tensor, clipfrac: Any, clipfrac_lower: Any, ppo_kl: Any) -> dict:
    """Detached 0-dim metric tensors on ``like``'s device."""

    def as_tensor(v: Any) -> torch.Tensor:
        return v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v), device=like.device)

    return {
        "pg_clipfrac": as_tensor(clipfrac),
        "pg_clipfrac_lower": as_tensor(clipfrac_lower),
        "ppo_kl": as_tensor(ppo_kl),
    }


@register_policy_loss("vanilla")
def ppo_clip_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None,
    agg_scale: Optional[AggScale] = None,
    is_weights: Optional[torch.Tensor] = None, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
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
        loss_scale_factor: ``seq-mean-token-sum-norm`` divisor.
        agg_scale: Global normalisers of a micro-batch (``AggScale``).
        is_weights: ``[batch, response_len]`` off-policy weights (``actor.off_policy``) multiplying each
            token's loss before aggregation, as verl does. None: 1.
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
    loss = agg_loss(_weighted(pg_losses, is_weights), response_mask, loss_agg_mode,
                    loss_scale_factor=loss_scale_factor, scale=agg_scale)
    clipfrac = masked_mean((loss2 > loss1).to(log_prob.dtype), response_mask)
    clipfrac_lower = masked_mean(((clipped > loss3) & negative).to(log_prob.dtype), response_mask)
    return loss, _metrics(loss, clipfrac, clipfrac_lower, masked_mean(-neg_kl, response_mask))


def _sequence_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor
                    ) -> "tuple[torch.Tensor, torch.Tensor]":
    """GSPO's token-level sequence ratio: ``(logp - logp_old, s_it)`` with ``log s_it = sg[mean_t m (logp -
    logp_old)] + logp_it - sg[logp_it]``, clamped above at 10: ``s_i`` in value, ``s_i grad logp_it`` in
    gradient."""
    neg_kl = log_prob - old_log_prob
    lengths = response_mask.to(log_prob.dtype).sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(neg_kl, response_mask, dim=-1) / lengths
    log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    return neg_kl, torch.exp(torch.clamp(log_ratio, max=10.0))


@register_policy_loss("gspo")
def gspo_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    agg_scale: Optional[AggScale] = None,
    is_weights: Optional[torch.Tensor] = None, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
) -> "tuple[torch.Tensor, dict]":
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071).

    Sequence ratio ``s_i = exp(mean_{t valid}(logp_it - logp_old_it))`` (geometric mean of
    token ratios). Token-level form with stop-gradient ``sg``:
    ``log s_it = sg[log s_i] + logp_it - sg[logp_it]`` (clamped above at 10), so
    ``s_it == s_i`` in value and ``grad s_it = s_i grad logp_it``.
    ``l_it = max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high))``, aggregated with
    ``seq-mean-token-mean`` whatever ``actor.loss.loss_agg_mode`` says: the paper's objective is a mean
    over sequences of per-sequence means. (verl fixed the mode this way up to 0.9.0; verl 0.9.1 passes
    ``loss_agg_mode`` through, token-mean by default, and recommends seq-mean-token-mean.)
    ``pg_clipfrac_lower`` is always 0. (The paper's clip range is about 3e-4 / 4e-4, not 0.2.)

    Args:
        old_log_prob: ``[batch, response_len]`` behaviour-policy log-probs.
        log_prob: ``[batch, response_len]`` current-policy log-probs (differentiated).
        advantages: ``[batch, response_len]`` (constant over a sequence in GSPO).
        response_mask: ``[batch, response_len]``; 1 = token in the loss and in ``s_i``.
        agg_scale: Global normalisers of a micro-batch (``AggScale``).
        is_weights: ``[batch, response_len]`` off-policy weights (``actor.off_policy``) multiplying each
            token's loss before aggregation, as verl does. None: 1.
        clip_ratio_low: ``eps_low``.
        clip_ratio_high: ``eps_high``.

    Returns:
        ``(loss, metrics)``.
    """
    neg_kl, ratio = _sequence_ratio(old_log_prob, log_prob, response_mask)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = agg_loss(_weighted(torch.maximum(loss1, loss2), is_weights), response_mask, "seq-mean-token-mean",
                    scale=agg_scale)
    clipfrac = masked_mean((loss2 > loss1).to(log_prob.dtype), response_mask)
    return loss, _metrics(loss, clipfrac, 0.0, masked_mean(-neg_kl, response_mask))


@register_policy_loss("geo_mean")
def geo_mean_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    agg_scale: Optional[AggScale] = None,
    is_weights: Optional[torch.Tensor] = None, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
) -> "tuple[torch.Tensor, dict]":
    """Geometric-Mean Policy Optimization, GMPO (Zhao et al. 2025, arXiv:2507.20673).

    Token log-ratios ``d_t = logp_t - logp_old_t`` are clipped in log space in the
    pessimistic direction: ``d'_t = sgn(A_t) min(sgn(A_t) d_t, sgn(A_t) clamp(d_t, -eps_low,
    eps_high))``. Per sequence ``rho_i = exp(sum_t m d'_t / (L_i + 1e-8))`` and
    ``Abar_i = sum_t m A_t / (L_i + 1e-8)``; ``loss = mean_i(-Abar_i rho_i)`` over all rows
    of the batch, empty ones included (like verl, ``loss_agg_mode`` is not used). Under gradient
    accumulation (``agg_scale``) the mean is over the rows of the whole global mini-batch; verl
    instead sums its micro-batches' means, which depends on how the batch was split.
    ``pg_clipfrac`` / ``pg_clipfrac_lower``: masked fraction of tokens whose ``d_t`` was clamped
    with ``A > 0`` / ``A < 0``. (The paper clips at 0.4 in log space.)

    Args:
        old_log_prob: ``[batch, response_len]`` behaviour-policy log-probs.
        log_prob: ``[batch, response_len]`` current-policy log-probs (differentiated).
        advantages: ``[batch, response_len]`` (sequence-level advantages broadcast).
        response_mask: ``[batch, response_len]``; 1 = token in the loss.
        agg_scale: Global normalisers of a micro-batch (``AggScale``).
        is_weights: ``[batch, response_len]`` off-policy weights (``actor.off_policy``); a sequence's loss
            is multiplied by the geometric mean of its tokens' weights, as verl does. None: 1.
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
    seq_losses = -seq_adv * ratio
    if is_weights is not None:  # a sequence weighs the geometric mean of its tokens' weights (verl's)
        seq_losses = seq_losses * torch.exp(masked_sum(torch.log(is_weights + 1e-10), response_mask, dim=-1) / lengths)
    loss = normalize(seq_losses.sum(), "sequences", response_mask, agg_scale, all_rows=True)
    was_clipped = neg_kl != neg_kl_clamped
    clipfrac = masked_mean((was_clipped & (advantages > 0)).to(log_prob.dtype), response_mask)
    clipfrac_lower = masked_mean((was_clipped & (advantages < 0)).to(log_prob.dtype), response_mask)
    return loss, _metrics(loss, clipfrac, clipfrac_lower, masked_mean(-neg_kl, response_mask))


@register_policy_loss("gpg")
def gpg_loss(
    *, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None,
    agg_scale: Optional[AggScale] = None, is_weights: Optional[torch.Tensor] = None,
) -> "tuple[torch.Tensor, dict]":
    """Group Policy Gradient loss (Chu et al. 2025, arXiv:2504.02546): plain REINFORCE
    ``l_t = -A_t logp_t`` without ratio or clipping, aggregated with ``agg_loss``.
    All metrics are 0.

    Args:
        log_prob: ``[batch, response_len]`` current-policy log-probs (differentiated).
        advantages: ``[batch, response_len]``.
        response_mask: ``[batch, response_len]``; 1 = token in the loss.
        loss_agg_mode: ``agg_loss`` mode.
        loss_scale_factor: ``seq-mean-token-sum-norm`` divisor.
        agg_scale: Global normalisers of a micro-batch (``AggScale``).
        is_weights: ``[batch, response_len]`` off-policy weights (``actor.off_policy``) multiplying each
            token's loss before aggregation, as verl does. None: 1.

    Returns:
        ``(loss, metrics)``.
    """
    loss = agg_loss(_weighted(-log_prob * advantages, is_weights), response_mask, loss_agg_mode,
                    loss_scale_factor=loss_scale_factor, scale=agg_scale)
    return loss, _metrics(loss, 0.0, 0.0, 0.0)


@register_policy_loss("cispo")
def cispo_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None,
    agg_scale: Optional[AggScale] = None,
    is_weights: Optional[torch.Tensor] = None, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
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
        loss_scale_factor: ``seq-mean-token-sum-norm`` divisor.
        agg_scale: Global normalisers of a micro-batch (``AggScale``).
        is_weights: ``[batch, response_len]`` off-policy weights (``actor.off_policy``) multiplying each
            token's loss before aggregation, as verl does. None: 1.
        clip_ratio_low: ``eps_low``.
        clip_ratio_high: ``eps_high``.

    Returns:
        ``(loss, metrics)``.
    """
    neg_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    weight = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = agg_loss(_weighted(-weight.detach() * advantages * log_prob, is_weights), response_mask, loss_agg_mode,
                    loss_scale_factor=loss_scale_factor, scale=agg_scale)
    clipfrac = masked_mean((ratio != weight).to(log_prob.dtype), response_mask)
    return loss, _metrics(loss, clipfrac, 0.0, masked_mean(-neg_kl, response_mask))


def _token_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached per-token ``(A - mean A)(logp - mean logp)`` with means over the mask."""
    adv, logp = advantages.detach(), log_prob.detach()
    return (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))


@register_policy_loss("clip_cov")
def clip_cov_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None,
    agg_scale: Optional[AggScale] = None,
    is_weights: Optional[torch.Tensor] = None, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 0.0002, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0,
    generator: Optional[torch.Generator] = None,
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
        loss_scale_factor: ``seq-mean-token-sum-norm`` divisor.
        agg_scale: Global normalisers of a micro-batch (``AggScale``).
        is_weights: ``[batch, response_len]`` off-policy weights (``actor.off_policy``) multiplying each
            token's loss before aggregation, as verl does. None: 1.
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
    loss = agg_loss(_weighted(torch.maximum(loss1, loss2) * keep, is_weights), response_mask, loss_agg_mode,
                    loss_scale_factor=loss_scale_factor, scale=agg_scale)
    clipfrac = masked_mean((keep == 0).to(log_prob.dtype), response_mask)
    return loss, _metrics(loss, clipfrac, 0.0, masked_mean(-neg_kl, response_mask))


@register_policy_loss("kl_cov")
def kl_cov_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None,
    agg_scale: Optional[AggScale] = None,
    is_weights: Optional[torch.Tensor] = None, kl_cov_ratio: float = 0.0002, ppo_kl_coef: float = 1.0,
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
        loss_scale_factor: ``seq-mean-token-sum-norm`` divisor.
        agg_scale: Global normalisers of a micro-batch (``AggScale``).
        is_weights: ``[batch, response_len]`` off-policy weights (``actor.off_policy``) multiplying each
            token's loss before aggregation, as verl does. None: 1.
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
    loss = agg_loss(_weighted(pg_losses, is_weights), response_mask, loss_agg_mode,
                    loss_scale_factor=loss_scale_factor, scale=agg_scale)
    return loss, _metrics(loss, 0.0, 0.0, masked_mean(abs_kl, response_mask))


def _dppo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
               response_mask: torch.Tensor, inside: torch.Tensor, *, clip_ratio_c: float, loss_agg_mode: str,
               loss_scale_factor: Optional[float], agg_scale: Optional[AggScale],
               is_weights: Optional[torch.Tensor]) -> "tuple[torch.Tensor, dict]":
    """DPPO's surrogate once the trust-region test ``inside`` (bool ``[batch, response_len]``) is known:
    ``l_t = -A_t sg[min(r_t, c)] logp_t [inside_t]``."""
    neg_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    keep = inside.detach().to(log_prob.dtype)
    weight = torch.clamp(ratio, max=clip_ratio_c).detach()
    loss = agg_loss(_weighted(-advantages * weight * log_prob * keep, is_weights), response_mask, loss_agg_mode,
                    loss_scale_factor=loss_scale_factor, scale=agg_scale)
    clipfrac = masked_mean(1.0 - keep, response_mask)
    truncated = masked_mean((ratio > clip_ratio_c).to(log_prob.dtype) * keep, response_mask)
    return loss, _metrics(loss, clipfrac, truncated, masked_mean(-neg_kl, response_mask))


@register_policy_loss("dppo_tv")
def dppo_tv_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None,
    agg_scale: Optional[AggScale] = None,
    is_weights: Optional[torch.Tensor] = None, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> "tuple[torch.Tensor, dict]":
    """Divergence PPO with the binary total-variation trust region, DPPO-Binary-TV (Qi et al. 2026,
    "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv:2602.04879).

    PPO's ratio clip bounds ``pi / pi_old``, which lets a token whose probability falls from 0.99 to 0.8 pass
    and stops one that rises from 1e-4 to 2e-4. DPPO bounds a divergence of the token's two-outcome
    distributions instead, here the total variation ``|p - p_old|`` (``p = exp(logp)``): a token with
    ``A > 0`` takes part while ``p - p_old <= delta_high``, one with ``A <= 0`` while
    ``p - p_old >= -delta_low``; the others get no gradient. Inside, the loss is the truncated-IS policy
    gradient ``l_t = -A_t sg[min(r_t, c)] logp_t`` with ``r = exp(clamp(logp - logp_old, -20, 20))`` (the
    paper's section 5.4 truncation, in place of dual clip), aggregated with ``agg_loss``.
    ``delta_low``/``delta_high`` are ``clip_ratio_low``/``clip_ratio_high`` (verl reads the same keys; its
    DPPO recipe uses 0.15) and ``c`` is ``clip_ratio_c``.
    Metrics: ``pg_clipfrac`` = masked share of tokens outside the region, ``pg_clipfrac_lower`` = masked share
    inside it whose ratio was truncated, ``ppo_kl`` = masked mean of ``-(clamped log-ratio)``.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[batch, response_len]``.
        loss_agg_mode: ``agg_loss`` mode.
        loss_scale_factor: ``seq-mean-token-sum-norm`` divisor.
        agg_scale: Global normalisers of a micro-batch (``AggScale``).
        is_weights: ``[batch, response_len]`` off-policy weights (``actor.off_policy``) multiplying each
            token's loss before aggregation, as verl does. None: 1.
        clip_ratio_low, clip_ratio_high: TV bounds ``delta_low``, ``delta_high``.
        clip_ratio_c: Truncation ``c`` of the importance ratio.

    Returns:
        ``(loss, metrics)``.
    """
    rise = log_prob.exp() - old_log_prob.exp()
    inside = torch.where(advantages > 0, rise <= clip_ratio_high, rise >= -clip_ratio_low)
    return _dppo_loss(log_prob, old_log_prob, advantages, response_mask, inside, clip_ratio_c=clip_ratio_c,
                      loss_agg_mode=loss_agg_mode, loss_scale_factor=loss_scale_factor, agg_scale=agg_scale,
                      is_weights=is_weights)


@register_policy_loss("dppo_kl")
def dppo_kl_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None,
    agg_scale: Optional[AggScale] = None,
    is_weights: Optional[torch.Tensor] = None, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> "tuple[torch.Tensor, dict]":
    """Divergence PPO with the binary KL trust region, DPPO-Binary-KL (Qi et al. 2026, arXiv:2602.04879).

    As ``dppo_tv`` with the divergence ``D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) /
    (1 - p + 1e-8))``, the KL between the Bernoulli distributions "this token or another" of the old and the
    current policy. A token with ``A > 0`` takes part while ``D <= delta_high`` or its probability did not rise
    (``p <= p_old``), one with ``A <= 0`` while ``D <= delta_low`` or it did not fall: only moves in the
    direction the advantage pushes are bounded. ``delta_low``/``delta_high`` are ``clip_ratio_low``/
    ``clip_ratio_high`` (verl's DPPO recipe uses 0.05); ``c`` is ``clip_ratio_c``. Metrics as ``dppo_tv``.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[batch, response_len]``.
        loss_agg_mode: ``agg_loss`` mode.
        loss_scale_factor: ``seq-mean-token-sum-norm`` divisor.
        agg_scale: Global normalisers of a micro-batch (``AggScale``).
        is_weights: ``[batch, response_len]`` off-policy weights (``actor.off_policy``) multiplying each
            token's loss before aggregation, as verl does. None: 1.
        clip_ratio_low, clip_ratio_high: KL bounds ``delta_low``, ``delta_high``.
        clip_ratio_c: Truncation ``c`` of the importance ratio.

    Returns:
        ``(loss, metrics)``.
    """
    p, p_old = log_prob.exp(), old_log_prob.exp()
    binary_kl = p_old * (old_log_prob - log_prob) + (1.0 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    inside = torch.where(advantages > 0, (binary_kl <= clip_ratio_high) | (p <= p_old),
                         (binary_kl <= clip_ratio_low) | (p >= p_old))
    return _dppo_loss(log_prob, old_log_prob, advantages, response_mask, inside, clip_ratio_c=clip_ratio_c,
                      loss_agg_mode=loss_agg_mode, loss_scale_factor=loss_scale_factor, agg_scale=agg_scale,
                      is_weights=is_weights)


@register_policy_loss("sapo")
def sapo_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    agg_scale: Optional[AggScale] = None,
    is_weights: Optional[torch.Tensor] = None, sapo_tau_pos: float = 1.0, sapo_tau_neg: float = 1.05,
) -> "tuple[torch.Tensor, dict]":
    """Soft Adaptive Policy Optimization, SAPO (Gao et al. 2025, arXiv:2511.20347).

    A smooth gate in place of the clip: ``f(r) = sigmoid(tau (r - 1)) * 4 / tau`` with
    ``r = exp(clamp(logp - logp_old, -20, 20))`` and ``tau = sapo_tau_pos`` where ``A > 0``, ``sapo_tau_neg``
    elsewhere. ``f(1) = 2 / tau`` and ``f'(r) = 4 sigmoid' (tau (r - 1))``, which is 1 at ``r = 1`` (the
    on-policy gradient is PPO's) and decays as the ratio leaves 1, faster for a larger ``tau`` (negative
    advantages get the larger one: their tokens' logits spread more). ``l_t = -f(r_t) A_t``, aggregated with
    ``seq-mean-token-mean`` whatever ``actor.loss.loss_agg_mode`` says, as the paper and verl do. Clip fractions
    are 0.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[batch, response_len]``.
        agg_scale: Global normalisers of a micro-batch (``AggScale``).
        is_weights: ``[batch, response_len]`` off-policy weights (``actor.off_policy``) multiplying each
            token's loss before aggregation, as verl does. None: 1.
        sapo_tau_pos: Gate temperature where ``A > 0``.
        sapo_tau_neg: Gate temperature where ``A <= 0``.

    Returns:
        ``(loss, metrics)``.
    """
    neg_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    tau = torch.where(advantages > 0, torch.full_like(ratio, sapo_tau_pos), torch.full_like(ratio, sapo_tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = agg_loss(_weighted(-gate * advantages, is_weights), response_mask, "seq-mean-token-mean", scale=agg_scale)
    return loss, _metrics(loss, 0.0, 0.0, masked_mean(-neg_kl, response_mask))


@register_policy_loss("dro")
def dro_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None,
    agg_scale: Optional[AggScale] = None, is_weights: Optional[torch.Tensor] = None, dro_beta: float = 0.05,
) -> "tuple[torch.Tensor, dict]":
    """Direct Reward Optimisation's policy term, DRO (Richemond et al. 2024, arXiv:2405.19107), as verl
    implements it: a policy gradient with a quadratic trust-region penalty instead of a ratio or a clip,
    ``l_t = -(A_t logp_t - beta / 2 (logp_t - logp_old_t)^2)``, aggregated with ``agg_loss``. (The paper
    penalises against the reference policy and learns a value baseline; here ``logp_old`` is the policy that
    sampled and the advantage comes from the estimator.) Clip fractions are 0.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[batch, response_len]``.
        loss_agg_mode: ``agg_loss`` mode.
        loss_scale_factor: ``seq-mean-token-sum-norm`` divisor.
        agg_scale: Global normalisers of a micro-batch (``AggScale``).
        is_weights: ``[batch, response_len]`` off-policy weights (``actor.off_policy``) multiplying each
            token's loss before aggregation, as verl does. None: 1.
        dro_beta: Penalty coefficient ``beta`` (> 0).

    Returns:
        ``(loss, metrics)``.

    Raises:
        ValueError: ``dro_beta <= 0``.
    """
    if dro_beta <= 0:
        raise ValueError(f"dro_beta must be > 0, got {dro_beta}")
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * dro_beta * log_ratio.square())
    loss = agg_loss(_weighted(pg_losses, is_weights), response_mask, loss_agg_mode,
                    loss_scale_factor=loss_scale_factor, scale=agg_scale)
    return loss, _metrics(loss, 0.0, 0.0, masked_mean(-log_ratio, response_mask))


@register_policy_loss("luspo")
def luspo_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    agg_scale: Optional[AggScale] = None,
    is_weights: Optional[torch.Tensor] = None, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
) -> "tuple[torch.Tensor, dict]":
    """Length-Unbiased Sequence Policy Optimization, LUSPO (arXiv:2602.05261; TRL GRPOTrainer ``loss_type``
    ``luspo``).

    GSPO's clipped sequence-ratio surrogate (``gspo``: ``s_i = exp(mean_t(logp - logp_old))`` in its
    token-level form, clamped above at ``e^10``), with each sequence weighted by its length:
    ``loss = (1 / B) sum_i sum_t m_it max(-A_it s_it, -A_it clip(s_it, 1 - eps_low, 1 + eps_high))`` over
    all ``B`` rows (empty ones too, as in TRL). GSPO's per-sequence mean makes a long response's tokens count
    less than a short one's; the length weight undoes that.

    A policy loss, not an aggregation mode: its surrogate needs GSPO's sequence ratio (TRL refuses it at token
    level), and its length weighting is fixed by the objective, so ``actor.loss.loss_agg_mode`` is not read
    (as ``gspo`` fixes its own). Metrics as ``gspo``.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[batch, response_len]``.
        agg_scale: Global normalisers of a micro-batch (``AggScale``; the mean is then over the global rows).
        is_weights: ``[batch, response_len]`` off-policy weights (``actor.off_policy``) multiplying each
            token's loss before aggregation, as verl does. None: 1.
        clip_ratio_low, clip_ratio_high: ``eps_low``, ``eps_high``.

    Returns:
        ``(loss, metrics)``.
    """
    neg_kl, ratio = _sequence_ratio(old_log_prob, log_prob, response_mask)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    total = masked_sum(_weighted(torch.maximum(loss1, loss2), is_weights), response_mask)
    loss = normalize(total, "sequences", response_mask, agg_scale, all_rows=True)
    clipfrac = masked_mean((loss2 > loss1).to(log_prob.dtype), response_mask)
    return loss, _metrics(loss, clipfrac, 0.0, masked_mean(-neg_kl, response_mask))


@register_policy_loss("vespo")
def vespo_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None,
    agg_scale: Optional[AggScale] = None,
    is_weights: Optional[torch.Tensor] = None, vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
) -> "tuple[torch.Tensor, dict]":
    """Variational sEquence-level Soft Policy Optimization, VESPO (arXiv:2602.10693; TRL GRPOTrainer
    ``loss_type`` ``vespo``).

    A smooth, asymmetric weight of the whole sequence's importance ratio in place of a clip:
    ``log w_i = clamp(sum_t m_it clamp(logp_it - logp_old_it, -20, 20), log 1e-8, 20)``,
    ``phi(w) = exp(lambda + k log w - lambda w)`` (a gamma density shape normalised to ``phi(1) = 1``, which
    fades both for ``w << 1`` and ``w >> 1``), ``k, lambda = vespo_k_pos, vespo_lambda_pos`` where
    ``A >= 0`` and ``vespo_k_neg, vespo_lambda_neg`` elsewhere (``lambda`` floored at 1e-4; a non-finite
    ``phi`` counts 0). ``l_t = -sg[phi] A_t logp_t``, aggregated with ``agg_loss`` (TRL divides by the
    global token count: ``token-mean``).

    A policy loss, not an aggregation mode: the weight ``phi`` changes each token's gradient, whatever the
    normaliser. Clip fractions are 0; ``ppo_kl`` as the other losses.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``[batch, response_len]``.
        loss_agg_mode: ``agg_loss`` mode.
        loss_scale_factor: ``seq-mean-token-sum-norm`` divisor.
        agg_scale: Global normalisers of a micro-batch (``AggScale``).
        is_weights: ``[batch, response_len]`` off-policy weights (``actor.off_policy``) multiplying each
            token's loss before aggregation, as verl does. None: 1.
        vespo_k_pos, vespo_lambda_pos: ``k``, ``lambda`` where ``A >= 0``.
        vespo_k_neg, vespo_lambda_neg: ``k``, ``lambda`` where ``A < 0``.

    Returns:
        ``(loss, metrics)``.
    """
    neg_kl = log_prob - old_log_prob
    with torch.no_grad():
        seq = masked_sum(neg_kl.clamp(-20.0, 20.0), response_mask, dim=-1).unsqueeze(-1)
        log_w = seq.clamp(math.log(1e-8), 20.0)
        nonneg = advantages >= 0
        k = torch.where(nonneg, torch.full_like(neg_kl, vespo_k_pos), torch.full_like(neg_kl, vespo_k_neg))
        lam = torch.where(nonneg, torch.full_like(neg_kl, vespo_lambda_pos),
                          torch.full_like(neg_kl, vespo_lambda_neg)).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    loss = agg_loss(_weighted(-phi * advantages * log_prob, is_weights), response_mask, loss_agg_mode,
                    loss_scale_factor=loss_scale_factor, scale=agg_scale)
    return loss, _metrics(loss, 0.0, 0.0, masked_mean(-neg_kl, response_mask))


@register_policy_loss("bypass_mode", old_is_behaviour=True)
def bypass_mode_loss(
    *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None,
    agg_scale: Optional[AggScale] = None, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0, bypass_loss_type: str = "ppo_clip", bypass_is: str = "sequence",
    bypass_is_threshold: float = 2.0, bypass_is_threshold_low: Optional[float] = None,
    bypass_rs: Optional[str] = None, bypass_rs_threshold: float = 2.0, bypass_rs_threshold_low: Optional[float] = None,
) -> "tuple[torch.Tensor, dict]":
    """verl's rollout correction in bypass mode (two policies, no proximal forward; Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training"; Liu et al. 2025, "When speed kills
    stability").

    ``old_log_prob`` is the behaviour (rollout) policy's: the round never recomputes old log-probs (the
    trainer does not, for this loss). With ``d = sg[logp] - logp_rollout``:

    * importance weights ``w`` (``off_policy.bypass_is_weights``: per ``token`` or ``sequence``, truncated at
      ``bypass_is_threshold``, or IcePop-masked outside ``[bypass_is_threshold_low, bypass_is_threshold]``);
    * a rejection test ``k`` (``off_policy.rejection_keep`` with ``bypass_rs``, 1 everywhere when None);
    * ``reinforce``: ``l_t = -k_t w_t A_t logp_t`` (an IS-weighted policy gradient), aggregated with
      ``agg_loss``; ``ppo_clip``: ``vanilla`` (clip and dual clip) against the rollout policy with the
      advantages ``k_t A_t``; the ratio is the IS correction there, so ``w`` is only reported.

    Rejected tokens stay in the loss normaliser with a zero loss (rlcore's off-policy convention; verl drops
    them from it). Metrics: the chosen loss's, ``is_weight_mean`` (masked mean of ``w``) and
    ``rejected_frac`` (masked share of tokens with ``k = 0``).

    Args:
        old_log_prob: ``[batch, response_len]`` the rollout policy's log-probs.
        log_prob, advantages, response_mask: ``[batch, response_len]``.
        loss_agg_mode, loss_scale_factor, agg_scale: aggregation, as ``vanilla``.
        clip_ratio_low, clip_ratio_high, clip_ratio_c: ``ppo_clip``'s bounds.
        bypass_loss_type: ``ppo_clip`` or ``reinforce``.
        bypass_is: ``token``, ``sequence`` or ``none``.
        bypass_is_threshold, bypass_is_threshold_low: the weights' bounds.
        bypass_rs: rejection test name (``off_policy.REJECTION_OPTIONS``) or None.
        bypass_rs_threshold, bypass_rs_threshold_low: its bounds.

    Returns:
        ``(loss, metrics)``.
    """
    if bypass_loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(f"bypass_loss_type must be ppo_clip or reinforce, got {bypass_loss_type!r}")
    with torch.no_grad():
        log_ratio = log_prob - old_log_prob
        weights = bypass_is_weights(log_ratio, response_mask, bypass_is, bypass_is_threshold, bypass_is_threshold_low)
        keep = torch.ones_like(log_ratio) if bypass_rs is None else rejection_keep(
            log_ratio, response_mask, bypass_rs, bypass_rs_threshold, bypass_rs_threshold_low)
    if bypass_loss_type == "reinforce":
        loss = agg_loss(-advantages * weights * keep * log_prob, response_mask, loss_agg_mode,
                        loss_scale_factor=loss_scale_factor, scale=agg_scale)
        metrics = _metrics(loss, 0.0, 0.0, masked_mean(-log_ratio, response_mask))
    else:
        loss, metrics = ppo_clip_loss(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages * keep, response_mask=response_mask,
            loss_agg_mode=loss_agg_mode, loss_scale_factor=loss_scale_factor, agg_scale=agg_scale,
            clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c)
    metrics["is_weight_mean"] = masked_mean(weights, response_mask)
    metrics["rejected_frac"] = masked_mean(1.0 - keep, response_mask)
    return loss, metrics


def policy_loss(
    mode: str, *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
    response_mask: torch.Tensor, **options: Any,
) -> "tuple[torch.Tensor, dict]":
    """Compute the policy-gradient loss registered under ``mode`` in ``POLICY_LOSSES``.

    Modes: ``vanilla`` (PPO clip + clip-higher + dual clip), ``gspo``, ``geo_mean`` (GMPO),
    ``gpg``, ``cispo``, ``clip_cov``, ``kl_cov``, ``dppo_tv``, ``dppo_kl``, ``sapo``, ``dro``, ``luspo``,
    ``vespo``, ``bypass_mode``; see each function's docstring.

    Args:
        mode: Policy-loss name.
        old_log_prob: ``[batch, response_len]`` behaviour-policy log-probs (``gpg`` has no ratio and
            does not read them).
        log_prob: ``[batch, response_len]`` current-policy log-probs (differentiated).
        advantages: ``[batch, response_len]``.
        response_mask: ``[batch, response_len]``; 1 = token in the loss, 0 = ignored.
        **options: Keywords the chosen loss takes: its settings (a caller with params.yaml's ``actor.loss`` passes
            ``options_from(loss, POLICY_LOSSES.get(mode).options)``), ``agg_scale``,
            ``is_weights`` (every loss but ``bypass_mode``, which weighs by itself) and, for ``clip_cov``,
            ``generator``.

    Returns:
        ``(loss, metrics)``: 0-dim loss tensor and a dict of detached 0-dim tensors with at
        least ``pg_clipfrac``, ``pg_clipfrac_lower`` and ``ppo_kl``.

    Raises:
        KeyError: Unknown mode (the message lists the allowed names).
        TypeError: A keyword the chosen loss does not take (named in the message).
    """
    entry = POLICY_LOSSES.get(mode)
    check_keywords(f"policy loss {mode!r}", options, entry.keywords)
    if entry.uses_old_log_prob:
        options["old_log_prob"] = old_log_prob
    return entry.fn(log_prob=log_prob, advantages=advantages, response_mask=response_mask, **options)
