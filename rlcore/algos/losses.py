"""Policy losses: the 14 ways of turning log-probs and advantages into the actor's loss, registered by name in
``POLICY_LOSSES``: ``vanilla`` (PPO clip with clip-higher and dual clip), ``gspo``, ``geo_mean`` (GMPO), ``gpg``,
``cispo``, ``clip_cov``, ``kl_cov``, ``dppo_tv``, ``dppo_kl``, ``sapo``, ``dro``, ``luspo``, ``vespo`` and
``bypass_mode``.

params.yaml ``actor.loss.name`` selects one and ``policy_loss`` calls it. What every loss shares is declared once
here, so that each loss's docstring gives only its formula, its papers and its own options:

* Inputs: one ``LossInputs``, given first and positional-only; its fields document the per-token tensors, what
  the response mask keeps, the off-policy weights and the global normalisers.
* Options: the loss function's keywords, read by name from the ``actor.loss`` section
  (``rlcore.config.PolicyLossConfig``, which declares each option once, with its doc and limits; the actor update
  hands it over as it is). ``loss_agg_mode`` is the ``rlcore.algos.aggregation.agg_loss`` mode the per-token loss
  is aggregated with and ``loss_scale_factor`` that mode's ``seq-mean-token-sum-norm`` divisor; a loss without
  them fixes its own aggregation, as its docstring says.
* Result: ``(loss, metrics)``: a 0-dim loss and detached 0-dim metrics, at least ``pg_clipfrac``,
  ``pg_clipfrac_lower`` and ``ppo_kl`` (each loss's docstring says what they measure; 0 where it has no such
  quantity).

The KL estimators are ``rlcore.algos.kl``'s and the critic's loss ``rlcore.algos.value_loss``. Formulas follow the
papers cited in each docstring and verl's current ``core_algos.py``; where rlcore differs on purpose, the docstring
says so.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from rlcore.algos.aggregation import AggScale, agg_loss, normalize
from rlcore.algos.masked import masked_mean, masked_sum
from rlcore.algos.off_policy import bypass_is_weights, rejection_keep
from rlcore.registry import Registry, check_keywords, keyword_names

LossAndMetrics = tuple[torch.Tensor, dict[str, torch.Tensor]]
_LOSS_CALL_ARGS = frozenset({"agg_scale", "generator", "is_weights"})  # given per call, not settings


@dataclass(frozen=True)
class LossInputs:
    """What every policy loss is given; each tensor is ``[batch, response_len]``, one value per response token."""

    old_log_prob: torch.Tensor
    """Log-probs under the old policy: the proximal one (recomputed before the update), or the behaviour (rollout)
    one where the round recomputes none, as always for ``bypass_mode``. ``gpg`` has no ratio and does not read
    them."""
    log_prob: torch.Tensor
    """Log-probs under the current policy; the loss is differentiated through them."""
    advantages: torch.Tensor
    """Per-token advantages (a sequence-level estimator's broadcast over the sequence)."""
    response_mask: torch.Tensor
    """0/1 (or bool): 1 marks a response token the loss is trained on, 0 padding or an observation token, which
    never contributes to the loss or a metric."""
    is_weights: Optional[torch.Tensor] = None
    """Off-policy importance weights of the proximal over the behaviour policy (``actor.off_policy``,
    ``rlcore.algos.off_policy``; verl's ``rollout_is_weights``), multiplying each token's loss before aggregation
    as verl does (``geo_mean`` weighs a sequence instead). None: 1. A loss whose old policy is the behaviour one
    (``bypass_mode``) is never given them: it has no proximal policy to weigh."""
    agg_scale: Optional[AggScale] = None
    """Global normalisers of this micro-batch under gradient accumulation (``AggScale``); None: this batch alone."""

    def log_ratio(self) -> torch.Tensor:
        """The per-token log-ratio ``logp - logp_old``, unclamped (for the losses whose formula has no clamp)."""
        return self.log_prob - self.old_log_prob

    def clamped_log_ratio(self) -> "tuple[torch.Tensor, torch.Tensor]":
        """``(d, r)``: the log-ratio ``d = clamp(logp - logp_old, -20, 20)`` and the ratio ``r = exp(d)``; the
        clamp keeps ``r`` finite where the two policies are far apart."""
        log_ratio = torch.clamp(self.log_ratio(), min=-20.0, max=20.0)
        return log_ratio, torch.exp(log_ratio)

    def weighted(self, token_losses: torch.Tensor) -> torch.Tensor:
        """The per-token losses times ``is_weights`` (unchanged without them)."""
        return token_losses if self.is_weights is None else token_losses * self.is_weights

    def aggregate(self, token_losses: torch.Tensor, loss_agg_mode: str,
                  loss_scale_factor: Optional[float] = None) -> torch.Tensor:
        """The weighted per-token losses aggregated by ``agg_loss`` over the response tokens (over the global
        mini-batch with ``agg_scale``)."""
        return agg_loss(self.weighted(token_losses), self.response_mask, loss_agg_mode,
                        loss_scale_factor=loss_scale_factor, scale=self.agg_scale)

    def token_mean(self, values: torch.Tensor) -> torch.Tensor:
        """The mean of per-token ``values`` over the response tokens."""
        return masked_mean(values, self.response_mask)

    def token_share(self, flags: torch.Tensor) -> torch.Tensor:
        """The share of response tokens where the bool ``flags`` hold, in the log-probs' dtype."""
        return masked_mean(flags.to(self.log_prob.dtype), self.response_mask)


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss and the keywords ``policy_loss`` takes for it beyond the four tensors."""

    fn: Callable[..., LossAndMetrics]
    """``fn(inputs, **options)``."""
    keywords: frozenset[str]
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
        what is given per call."""
        return self.keywords - _LOSS_CALL_ARGS


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def register_policy_loss(name: str, *, old_is_behaviour: bool = False):
    """Register a policy loss ``fn(inputs: LossInputs, /, **options)``; its keywords are its settings (each a key of
    params.yaml's ``actor.loss``, which a test checks) and, for ``clip_cov``, the per-call ``generator``.
    ``policy_loss`` also takes ``agg_scale`` and, unless ``old_is_behaviour`` (see
    :attr:`PolicyLoss.old_is_behaviour`), ``is_weights`` for it, into its ``LossInputs``."""

    def decorator(fn):
        params = list(inspect.signature(fn).parameters.values())
        if not params or params[0].kind is not inspect.Parameter.POSITIONAL_ONLY:
            raise TypeError(f"policy loss {name!r} must take its LossInputs first, positional-only")
        # is_weights weigh the proximal policy against the behaviour one: there is none to weigh where old is behaviour
        per_call = {"agg_scale"} if old_is_behaviour else {"agg_scale", "is_weights"}
        POLICY_LOSSES.add(name, PolicyLoss(fn, keyword_names(fn) | per_call, old_is_behaviour))
        return fn

    return decorator


def _metrics(like: torch.Tensor, clipfrac: Any = 0.0, clipfrac_lower: Any = 0.0, ppo_kl: Any = 0.0) -> dict:
    """Detached 0-dim metric tensors on ``like``'s device; 0 for what a loss does not have."""

    def as_tensor(v: Any) -> torch.Tensor:
        return v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v), device=like.device)

    return {
        "pg_clipfrac": as_tensor(clipfrac),
        "pg_clipfrac_lower": as_tensor(clipfrac_lower),
        "ppo_kl": as_tensor(ppo_kl),
    }


def _clipped_surrogate(advantages: torch.Tensor, ratio: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float
                       ) -> "tuple[torch.Tensor, torch.Tensor]":
    """PPO's per-token clipped surrogate ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` and where the clip
    set it (``-A clip(r) > -A r``, bool)."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@register_policy_loss("vanilla")
def ppo_clip_loss(inputs: LossInputs, /, *, loss_agg_mode: str = "token-mean",
                  loss_scale_factor: Optional[float] = None, clip_ratio_low: float = 0.2,
                  clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0) -> LossAndMetrics:
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
        clip_ratio_low: ``eps_low``.
        clip_ratio_high: ``eps_high``.
        clip_ratio_c: Dual-clip constant ``c`` (> 1).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    advantages = inputs.advantages
    log_ratio, ratio = inputs.clamped_log_ratio()
    surrogate, clipped = _clipped_surrogate(advantages, ratio, clip_ratio_low, clip_ratio_high)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    token_losses = torch.where(negative, torch.minimum(surrogate, dual_bound), surrogate)
    loss = inputs.aggregate(token_losses, loss_agg_mode, loss_scale_factor)
    return loss, _metrics(loss, inputs.token_share(clipped), inputs.token_share((surrogate > dual_bound) & negative),
                          inputs.token_mean(-log_ratio))


def _sequence_clipped_surrogate(inputs: LossInputs, clip_ratio_low: float, clip_ratio_high: float
                                ) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
    """GSPO's per-token clipped surrogate (see ``gspo``), with ``log s_it = sg[mean_t m (logp - logp_old)] + logp_it
    - sg[logp_it]`` clamped above at 10 (``s_i`` in value, ``s_i grad logp_it`` in gradient); and its
    ``pg_clipfrac`` and ``ppo_kl``."""
    log_prob, mask = inputs.log_prob, inputs.response_mask
    token_log_ratio = inputs.log_ratio()
    lengths = mask.to(log_prob.dtype).sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(token_log_ratio, mask, dim=-1) / lengths
    log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    surrogate, clipped = _clipped_surrogate(inputs.advantages, ratio, clip_ratio_low, clip_ratio_high)
    return surrogate, inputs.token_share(clipped), inputs.token_mean(-token_log_ratio)


@register_policy_loss("gspo")
def gspo_loss(inputs: LossInputs, /, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2) -> LossAndMetrics:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071).

    Sequence ratio ``s_i = exp(mean_{t valid}(logp_it - logp_old_it))`` (geometric mean of
    token ratios over the response mask's tokens; GSPO's advantage is constant over a sequence).
    Token-level form with stop-gradient ``sg``:
    ``log s_it = sg[log s_i] + logp_it - sg[logp_it]`` (clamped above at 10), so
    ``s_it == s_i`` in value and ``grad s_it = s_i grad logp_it``.
    ``l_it = max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high))``, aggregated with
    ``seq-mean-token-mean`` whatever ``actor.loss.loss_agg_mode`` says: the paper's objective is a mean
    over sequences of per-sequence means. (verl fixed the mode this way up to 0.9.0; verl 0.9.1 passes
    ``loss_agg_mode`` through, token-mean by default, and recommends seq-mean-token-mean.)
    ``pg_clipfrac_lower`` is always 0. (The paper's clip range is about 3e-4 / 4e-4, not 0.2.)

    Args:
        clip_ratio_low: ``eps_low``.
        clip_ratio_high: ``eps_high``.
    """
    surrogate, clipfrac, ppo_kl = _sequence_clipped_surrogate(inputs, clip_ratio_low, clip_ratio_high)
    loss = inputs.aggregate(surrogate, "seq-mean-token-mean")
    return loss, _metrics(loss, clipfrac, ppo_kl=ppo_kl)


@register_policy_loss("geo_mean")
def geo_mean_loss(inputs: LossInputs, /, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2
                  ) -> LossAndMetrics:
    """Geometric-Mean Policy Optimization, GMPO (Zhao et al. 2025, arXiv:2507.20673).

    Token log-ratios ``d_t = logp_t - logp_old_t`` are clipped in log space in the
    pessimistic direction: ``d'_t = sgn(A_t) min(sgn(A_t) d_t, sgn(A_t) clamp(d_t, -eps_low,
    eps_high))``. Per sequence ``rho_i = exp(sum_t m d'_t / (L_i + 1e-8))`` and
    ``Abar_i = sum_t m A_t / (L_i + 1e-8)``; ``loss = mean_i(-Abar_i rho_i)`` over all rows
    of the batch, empty ones included (like verl, ``loss_agg_mode`` is not used). Under gradient
    accumulation (``agg_scale``) the mean is over the rows of the whole global mini-batch; verl
    instead sums its micro-batches' means, which depends on how the batch was split.
    With ``is_weights``, a sequence's loss is multiplied by the geometric mean of its tokens' weights, as verl
    does.
    ``pg_clipfrac`` / ``pg_clipfrac_lower``: masked fraction of tokens whose ``d_t`` was clamped
    with ``A > 0`` / ``A < 0``. (The paper clips at 0.4 in log space.)

    Args:
        clip_ratio_low: ``eps_low`` (in log space).
        clip_ratio_high: ``eps_high`` (in log space).
    """
    advantages, mask = inputs.advantages, inputs.response_mask
    log_ratio = inputs.log_ratio()
    sign = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clamped)
    lengths = mask.to(inputs.log_prob.dtype).sum(dim=-1) + 1e-8
    ratio = torch.exp(masked_sum(pessimistic, mask, dim=-1) / lengths)
    seq_adv = masked_sum(advantages, mask, dim=-1) / lengths
    seq_losses = -seq_adv * ratio
    if inputs.is_weights is not None:  # a sequence weighs the geometric mean of its tokens' weights (verl's)
        seq_losses = seq_losses * torch.exp(masked_sum(torch.log(inputs.is_weights + 1e-10), mask, dim=-1) / lengths)
    loss = normalize(seq_losses.sum(), "sequences", mask, inputs.agg_scale, all_rows=True)
    was_clipped = log_ratio != log_ratio_clamped
    return loss, _metrics(loss, inputs.token_share(was_clipped & (advantages > 0)),
                          inputs.token_share(was_clipped & (advantages < 0)), inputs.token_mean(-log_ratio))


@register_policy_loss("gpg")
def gpg_loss(inputs: LossInputs, /, *, loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None
             ) -> LossAndMetrics:
    """Group Policy Gradient loss (Chu et al. 2025, arXiv:2504.02546): plain REINFORCE
    ``l_t = -A_t logp_t`` without ratio or clipping, aggregated with ``agg_loss``.
    All metrics are 0."""
    loss = inputs.aggregate(-inputs.log_prob * inputs.advantages, loss_agg_mode, loss_scale_factor)
    return loss, _metrics(loss)


@register_policy_loss("cispo")
def cispo_loss(inputs: LossInputs, /, *, loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None,
               clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2) -> LossAndMetrics:
    """Clipped IS-weight Policy Optimization, CISPO (MiniMax-M1, arXiv:2506.13585, eq. 4-5).

    ``r = exp(clamp(logp - logp_old, -20, 20))``, ``r_hat = clip(r, 1 - eps_low, 1 + eps_high)``;
    ``l_t = -sg[r_hat_t] A_t logp_t`` so every token keeps a gradient, scaled by the
    clipped weight. ``pg_clipfrac`` = masked fraction with ``r != r_hat``; lower is 0.

    Args:
        clip_ratio_low: ``eps_low``.
        clip_ratio_high: ``eps_high``.
    """
    log_ratio, ratio = inputs.clamped_log_ratio()
    weight = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = inputs.aggregate(-weight.detach() * inputs.advantages * inputs.log_prob, loss_agg_mode, loss_scale_factor)
    return loss, _metrics(loss, inputs.token_share(ratio != weight), ppo_kl=inputs.token_mean(-log_ratio))


def _token_covariance(inputs: LossInputs) -> torch.Tensor:
    """Detached per-token ``(A - mean A)(logp - mean logp)`` with means over the response tokens."""
    adv, logp = inputs.advantages.detach(), inputs.log_prob.detach()
    return (adv - inputs.token_mean(adv)) * (logp - inputs.token_mean(logp))


@register_policy_loss("clip_cov")
def clip_cov_loss(inputs: LossInputs, /, *, loss_agg_mode: str = "token-mean",
                  loss_scale_factor: Optional[float] = None, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                  clip_cov_ratio: float = 0.0002, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0,
                  generator: Optional[torch.Generator] = None) -> LossAndMetrics:
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
        clip_ratio_low, clip_ratio_high: PPO clip bounds.
        clip_cov_ratio: Fraction of valid tokens to detach.
        clip_cov_lb, clip_cov_ub: Covariance window for candidates.
        generator: Optional RNG making the selection random (verl behaviour); given per call, not a setting.
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    valid = inputs.response_mask.bool()
    log_ratio = inputs.log_ratio()
    surrogate, clipped = _clipped_surrogate(inputs.advantages, torch.exp(log_ratio), clip_ratio_low, clip_ratio_high)
    cov = _token_covariance(inputs)
    candidate = valid & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    flat_idx = torch.nonzero(candidate.flatten()).flatten()
    k = min(max(int(clip_cov_ratio * int(valid.sum().item())), 1), flat_idx.numel())
    if generator is None:
        chosen = flat_idx[torch.topk(cov.flatten()[flat_idx], k).indices]
    else:
        chosen = flat_idx[torch.randperm(flat_idx.numel(), generator=generator)[:k].to(flat_idx.device)]
    keep = torch.ones(cov.numel(), dtype=inputs.log_prob.dtype, device=inputs.log_prob.device)
    keep[chosen] = 0.0
    keep = keep.view_as(cov)
    loss = inputs.aggregate(surrogate * keep, loss_agg_mode, loss_scale_factor)
    return loss, _metrics(loss, inputs.token_share(keep == 0), ppo_kl=inputs.token_mean(-log_ratio))


@register_policy_loss("kl_cov")
def kl_cov_loss(inputs: LossInputs, /, *, loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None,
                kl_cov_ratio: float = 0.0002, ppo_kl_coef: float = 1.0) -> LossAndMetrics:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617).

    Unclipped surrogate ``-A r`` (``r = exp(logp - logp_old)``) on every token, plus a
    penalty ``ppo_kl_coef * |logp - logp_old|`` on the ``k = max(int(#valid *
    kl_cov_ratio), 1)`` valid tokens with the largest covariance
    ``(A - mean A)(logp - mean logp)`` (means over valid tokens). The selection is a
    deterministic ``topk``, as in verl. Metrics: ``ppo_kl`` = masked mean of
    ``|logp - logp_old|`` (verl reports the absolute KL here); clip fractions are 0.

    Args:
        kl_cov_ratio: Fraction of valid tokens that get the KL penalty.
        ppo_kl_coef: Penalty coefficient.
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    valid = inputs.response_mask.bool()
    log_ratio = inputs.log_ratio()
    abs_kl = log_ratio.abs()
    token_losses = -inputs.advantages * torch.exp(log_ratio)
    flat_idx = torch.nonzero(valid.flatten()).flatten()
    if flat_idx.numel() > 0:
        cov = _token_covariance(inputs).flatten()[flat_idx]
        k = max(1, int(flat_idx.numel() * kl_cov_ratio))
        selected = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        selected[flat_idx[torch.topk(cov, k).indices]] = True
        token_losses = torch.where(selected.view_as(valid), token_losses + ppo_kl_coef * abs_kl, token_losses)
    loss = inputs.aggregate(token_losses, loss_agg_mode, loss_scale_factor)
    return loss, _metrics(loss, ppo_kl=inputs.token_mean(abs_kl))


def _dppo_loss(inputs: LossInputs, inside: torch.Tensor, clip_ratio_c: float, loss_agg_mode: str,
               loss_scale_factor: Optional[float]) -> LossAndMetrics:
    """DPPO's surrogate once the trust-region test ``inside`` (bool ``[batch, response_len]``) is known:
    ``l_t = -A_t sg[min(r_t, c)] logp_t [inside_t]``."""
    log_ratio, ratio = inputs.clamped_log_ratio()
    keep = inside.detach().to(inputs.log_prob.dtype)
    weight = torch.clamp(ratio, max=clip_ratio_c).detach()
    loss = inputs.aggregate(-inputs.advantages * weight * inputs.log_prob * keep, loss_agg_mode, loss_scale_factor)
    truncated = inputs.token_mean((ratio > clip_ratio_c).to(inputs.log_prob.dtype) * keep)
    return loss, _metrics(loss, inputs.token_mean(1.0 - keep), truncated, inputs.token_mean(-log_ratio))


@register_policy_loss("dppo_tv")
def dppo_tv_loss(inputs: LossInputs, /, *, loss_agg_mode: str = "token-mean",
                 loss_scale_factor: Optional[float] = None, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                 clip_ratio_c: float = 3.0) -> LossAndMetrics:
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
        clip_ratio_low, clip_ratio_high: TV bounds ``delta_low``, ``delta_high``.
        clip_ratio_c: Truncation ``c`` of the importance ratio.
    """
    rise = inputs.log_prob.exp() - inputs.old_log_prob.exp()
    inside = torch.where(inputs.advantages > 0, rise <= clip_ratio_high, rise >= -clip_ratio_low)
    return _dppo_loss(inputs, inside, clip_ratio_c, loss_agg_mode, loss_scale_factor)


@register_policy_loss("dppo_kl")
def dppo_kl_loss(inputs: LossInputs, /, *, loss_agg_mode: str = "token-mean",
                 loss_scale_factor: Optional[float] = None, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                 clip_ratio_c: float = 3.0) -> LossAndMetrics:
    """Divergence PPO with the binary KL trust region, DPPO-Binary-KL (Qi et al. 2026, arXiv:2602.04879).

    As ``dppo_tv`` with the divergence ``D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) /
    (1 - p + 1e-8))``, the KL between the Bernoulli distributions "this token or another" of the old and the
    current policy. A token with ``A > 0`` takes part while ``D <= delta_high`` or its probability did not rise
    (``p <= p_old``), one with ``A <= 0`` while ``D <= delta_low`` or it did not fall: only moves in the
    direction the advantage pushes are bounded. ``delta_low``/``delta_high`` are ``clip_ratio_low``/
    ``clip_ratio_high`` (verl's DPPO recipe uses 0.05); ``c`` is ``clip_ratio_c``. Metrics as ``dppo_tv``.

    Args:
        clip_ratio_low, clip_ratio_high: KL bounds ``delta_low``, ``delta_high``.
        clip_ratio_c: Truncation ``c`` of the importance ratio.
    """
    log_prob, old_log_prob = inputs.log_prob, inputs.old_log_prob
    p, p_old = log_prob.exp(), old_log_prob.exp()
    binary_kl = p_old * (old_log_prob - log_prob) + (1.0 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    inside = torch.where(inputs.advantages > 0, (binary_kl <= clip_ratio_high) | (p <= p_old),
                         (binary_kl <= clip_ratio_low) | (p >= p_old))
    return _dppo_loss(inputs, inside, clip_ratio_c, loss_agg_mode, loss_scale_factor)


@register_policy_loss("sapo")
def sapo_loss(inputs: LossInputs, /, *, sapo_tau_pos: float = 1.0, sapo_tau_neg: float = 1.05) -> LossAndMetrics:
    """Soft Adaptive Policy Optimization, SAPO (Gao et al. 2025, arXiv:2511.20347).

    A smooth gate in place of the clip: ``f(r) = sigmoid(tau (r - 1)) * 4 / tau`` with
    ``r = exp(clamp(logp - logp_old, -20, 20))`` and ``tau = sapo_tau_pos`` where ``A > 0``, ``sapo_tau_neg``
    elsewhere. ``f(1) = 2 / tau`` and ``f'(r) = 4 sigmoid' (tau (r - 1))``, which is 1 at ``r = 1`` (the
    on-policy gradient is PPO's) and decays as the ratio leaves 1, faster for a larger ``tau`` (negative
    advantages get the larger one: their tokens' logits spread more). ``l_t = -f(r_t) A_t``, aggregated with
    ``seq-mean-token-mean`` whatever ``actor.loss.loss_agg_mode`` says, as the paper and verl do. Clip fractions
    are 0.

    Args:
        sapo_tau_pos: Gate temperature where ``A > 0``.
        sapo_tau_neg: Gate temperature where ``A <= 0``.
    """
    log_ratio, ratio = inputs.clamped_log_ratio()
    tau = torch.where(inputs.advantages > 0, torch.full_like(ratio, sapo_tau_pos),
                      torch.full_like(ratio, sapo_tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = inputs.aggregate(-gate * inputs.advantages, "seq-mean-token-mean")
    return loss, _metrics(loss, ppo_kl=inputs.token_mean(-log_ratio))


@register_policy_loss("dro")
def dro_loss(inputs: LossInputs, /, *, loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None,
             dro_beta: float = 0.05) -> LossAndMetrics:
    """Direct Reward Optimisation's policy term, DRO (Richemond et al. 2024, arXiv:2405.19107), as verl
    implements it: a policy gradient with a quadratic trust-region penalty instead of a ratio or a clip,
    ``l_t = -(A_t logp_t - beta / 2 (logp_t - logp_old_t)^2)``, aggregated with ``agg_loss``. (The paper
    penalises against the reference policy and learns a value baseline; here ``logp_old`` is the policy that
    sampled and the advantage comes from the estimator.) Clip fractions are 0.

    Args:
        dro_beta: Penalty coefficient ``beta`` (> 0).

    Raises:
        ValueError: ``dro_beta <= 0``.
    """
    if dro_beta <= 0:
        raise ValueError(f"dro_beta must be > 0, got {dro_beta}")
    log_ratio = inputs.log_ratio()
    token_losses = -(inputs.log_prob * inputs.advantages - 0.5 * dro_beta * log_ratio.square())
    loss = inputs.aggregate(token_losses, loss_agg_mode, loss_scale_factor)
    return loss, _metrics(loss, ppo_kl=inputs.token_mean(-log_ratio))


@register_policy_loss("luspo")
def luspo_loss(inputs: LossInputs, /, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2) -> LossAndMetrics:
    """Length-Unbiased Sequence Policy Optimization, LUSPO (arXiv:2602.05261; TRL GRPOTrainer ``loss_type``
    ``luspo``).

    GSPO's clipped sequence-ratio surrogate (``gspo``: ``s_i = exp(mean_t(logp - logp_old))`` in its
    token-level form, clamped above at ``e^10``), with each sequence weighted by its length:
    ``loss = (1 / B) sum_i sum_t m_it max(-A_it s_it, -A_it clip(s_it, 1 - eps_low, 1 + eps_high))`` over
    all ``B`` rows (empty ones too, as in TRL; with ``agg_scale``, the rows of the global mini-batch). GSPO's
    per-sequence mean makes a long response's tokens count less than a short one's; the length weight undoes
    that.

    A policy loss, not an aggregation mode: its surrogate needs GSPO's sequence ratio (TRL refuses it at token
    level), and its length weighting is fixed by the objective, so ``actor.loss.loss_agg_mode`` is not read
    (as ``gspo`` fixes its own). Metrics as ``gspo``.

    Args:
        clip_ratio_low, clip_ratio_high: ``eps_low``, ``eps_high``.
    """
    surrogate, clipfrac, ppo_kl = _sequence_clipped_surrogate(inputs, clip_ratio_low, clip_ratio_high)
    total = masked_sum(inputs.weighted(surrogate), inputs.response_mask)
    loss = normalize(total, "sequences", inputs.response_mask, inputs.agg_scale, all_rows=True)
    return loss, _metrics(loss, clipfrac, ppo_kl=ppo_kl)


@register_policy_loss("vespo")
def vespo_loss(inputs: LossInputs, /, *, loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None,
               vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0,
               vespo_lambda_neg: float = 2.0) -> LossAndMetrics:
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
        vespo_k_pos, vespo_lambda_pos: ``k``, ``lambda`` where ``A >= 0``.
        vespo_k_neg, vespo_lambda_neg: ``k``, ``lambda`` where ``A < 0``.
    """
    advantages = inputs.advantages
    log_ratio = inputs.log_ratio()
    with torch.no_grad():
        seq = masked_sum(log_ratio.clamp(-20.0, 20.0), inputs.response_mask, dim=-1).unsqueeze(-1)
        log_w = seq.clamp(math.log(1e-8), 20.0)
        nonneg = advantages >= 0
        k = torch.where(nonneg, torch.full_like(log_ratio, vespo_k_pos), torch.full_like(log_ratio, vespo_k_neg))
        lam = torch.where(nonneg, torch.full_like(log_ratio, vespo_lambda_pos),
                          torch.full_like(log_ratio, vespo_lambda_neg)).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    loss = inputs.aggregate(-phi * advantages * inputs.log_prob, loss_agg_mode, loss_scale_factor)
    return loss, _metrics(loss, ppo_kl=inputs.token_mean(-log_ratio))


@register_policy_loss("bypass_mode", old_is_behaviour=True)
def bypass_mode_loss(
    inputs: LossInputs, /, *, loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None,
    clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
    bypass_loss_type: str = "ppo_clip", bypass_is: str = "sequence", bypass_is_threshold: float = 2.0,
    bypass_is_threshold_low: Optional[float] = None, bypass_rs: Optional[str] = None,
    bypass_rs_threshold: float = 2.0, bypass_rs_threshold_low: Optional[float] = None,
) -> LossAndMetrics:
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
        clip_ratio_low, clip_ratio_high, clip_ratio_c: ``ppo_clip``'s bounds.
        bypass_loss_type: ``ppo_clip`` or ``reinforce``.
        bypass_is: ``token``, ``sequence`` or ``none``.
        bypass_is_threshold, bypass_is_threshold_low: the weights' bounds.
        bypass_rs: rejection test name (``off_policy.REJECTION_OPTIONS``) or None.
        bypass_rs_threshold, bypass_rs_threshold_low: its bounds.
    """
    if bypass_loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(f"bypass_loss_type must be ppo_clip or reinforce, got {bypass_loss_type!r}")
    mask = inputs.response_mask
    with torch.no_grad():
        log_ratio = inputs.log_ratio()
        weights = bypass_is_weights(log_ratio, mask, bypass_is, bypass_is_threshold, bypass_is_threshold_low)
        keep = torch.ones_like(log_ratio) if bypass_rs is None else rejection_keep(
            log_ratio, mask, bypass_rs, bypass_rs_threshold, bypass_rs_threshold_low)
    if bypass_loss_type == "reinforce":
        loss = inputs.aggregate(-inputs.advantages * weights * keep * inputs.log_prob, loss_agg_mode,
                                loss_scale_factor)
        metrics = _metrics(loss, ppo_kl=inputs.token_mean(-log_ratio))
    else:
        loss, metrics = ppo_clip_loss(
            replace(inputs, advantages=inputs.advantages * keep), loss_agg_mode=loss_agg_mode,
            loss_scale_factor=loss_scale_factor, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
            clip_ratio_c=clip_ratio_c)
    metrics["is_weight_mean"] = inputs.token_mean(weights)
    metrics["rejected_frac"] = inputs.token_mean(1.0 - keep)
    return loss, metrics


def policy_loss(
    mode: str, *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
    response_mask: torch.Tensor, **options: Any,
) -> LossAndMetrics:
    """Compute the policy-gradient loss registered under ``mode`` in ``POLICY_LOSSES`` (the module docstring lists
    them; the tensors, the result and the shared options are documented there and on ``LossInputs``).

    Args:
        mode: Policy-loss name.
        old_log_prob, log_prob, advantages, response_mask: ``[batch, response_len]``, as ``LossInputs``.
        **options: Keywords the chosen loss takes (``POLICY_LOSSES.get(mode).keywords``): its settings (a caller
            with params.yaml's ``actor.loss`` passes ``options_from(loss, POLICY_LOSSES.get(mode).options)``),
            ``agg_scale``, ``is_weights`` (every loss but ``bypass_mode``, which weighs by itself) and, for
            ``clip_cov``, ``generator``.

    Returns:
        ``(loss, metrics)``.

    Raises:
        KeyError: Unknown mode (the message lists the allowed names).
        TypeError: A keyword the chosen loss does not take (named in the message).
    """
    entry = POLICY_LOSSES.get(mode)
    check_keywords(f"policy loss {mode!r}", options, entry.keywords)
    inputs = LossInputs(old_log_prob, log_prob, advantages, response_mask,
                        is_weights=options.pop("is_weights", None), agg_scale=options.pop("agg_scale", None))
    return entry.fn(inputs, **options)
