"""Off-policy corrections: importance weights between the behaviour policy and the proximal policy.

The responses of a step were sampled by the *behaviour* policy (the rollout engine's weights: in an
asynchronous round a version or more behind, and even in a synchronous one a different kernel, dtype or
engine), whose log-probs come back with the rollout (``rollout_log_probs``). The PPO ratio is taken against
the *proximal* policy, the trainer's weights before the update, whose log-probs the trainer recomputes
(``old_log_probs``; the decoupled objective of AReaL, Fu et al. 2025). The gap between the two is corrected
per token with a weight ``w`` that multiplies the token's policy loss:

* ``none``: ``w = 1``;
* ``tis``, truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training"): ``w = min(pi_prox / pi_behav, cap)`` per token;
* ``mis``, sequence-level importance masking: a sequence whose ratio ``prod_t pi_prox / pi_behav`` is outside
  ``[low, high]`` gets ``w = 0`` on every token, the others ``w = 1`` (verl's rollout rejection sampling at
  the sequence level);
* ``icepop``, token-level masking (IcePop, Ling team 2025): a token whose ratio is outside ``[low, high]``
  gets ``w = 0``, the others ``w = 1``.

Weights are 0 on padding. A weight multiplies the token's policy loss before aggregation (every policy loss in
``rlcore.algos.losses`` takes them as ``is_weights``, as verl's take ``rollout_is_weights``; geo_mean weighs a
sequence by the geometric mean of its tokens' weights). Weighing the advantage instead (``A * w``) is the same
only for a loss that is positively homogeneous in the advantage, which dro (its log-ratio penalty), kl_cov (its
penalty, and the tokens its covariance selects) and clip_cov (the tokens it cuts) are not. Masked tokens (mis,
icepop) stay in the loss normaliser with a zero loss, as a zero weight does in verl (its rejection sampling drops
them from the normaliser instead). The value loss is not weighted (verl's is not: its target, the return,
is a regression target whatever policy sampled it).

The policy loss ``bypass_mode`` (verl's rollout correction with two policies: the behaviour policy is the
old one, nothing is recomputed) takes its weights between the *current* policy and the behaviour policy inside
the loss: :func:`bypass_is_weights` (token or sequence level, truncated or IcePop-masked) and
:func:`rejection_keep` (verl's rejection tests on the k1/k2/k3 divergences per token or sequence).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rlcore.algos.masked import masked_sum

# exp() of a log-ratio past this overflows float32 nowhere near a useful weight (verl clamps at 20 too)
MAX_LOG_RATIO = 20.0

Correction = Callable[[torch.Tensor, torch.Tensor, float, float, float], torch.Tensor]


def _none(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float, low: float, high: float) -> torch.Tensor:
    return torch.ones_like(log_ratio)


def _tis(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float, low: float, high: float) -> torch.Tensor:
    return log_ratio.exp().clamp(max=cap)


def _mis(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float, low: float, high: float) -> torch.Tensor:
    seq = masked_sum(log_ratio, mask, dim=-1).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    keep = ((seq >= low) & (seq <= high)).to(log_ratio.dtype)
    return keep.unsqueeze(-1).expand_as(log_ratio)


def _icepop(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float, low: float, high: float) -> torch.Tensor:
    ratio = log_ratio.exp()
    return ((ratio >= low) & (ratio <= high)).to(log_ratio.dtype)


CORRECTIONS: dict[str, Correction] = {"none": _none, "tis": _tis, "mis": _mis, "icepop": _icepop}


# what off_policy_metrics needs, as sums and maxima over the tokens and sequences seen: mergeable over micro-batches
# and ranks (sums add, maxima take the max)
SUM_KEYS = ("tokens", "weight_sum", "masked_tokens", "rows", "masked_rows", "ratio_sum")
MAX_KEYS = ("weight_max", "ratio_max")


def importance_weights(proximal_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor,
                       response_mask: torch.Tensor, correction: str, *, cap: float = 2.0, low: float = 0.5,
                       high: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights ``[batch, response_len]`` of ``correction`` (see the module docstring), and their
    statistics over the valid tokens as sums and maxima (:data:`SUM_KEYS`, :data:`MAX_KEYS`), which
    :func:`off_policy_metrics` turns into metrics once merged."""
    if correction not in CORRECTIONS:
        raise ValueError(f"unknown off-policy correction {correction!r}; choose from {', '.join(CORRECTIONS)}")
    valid = response_mask.bool()
    zero = torch.zeros((), dtype=proximal_log_prob.dtype, device=proximal_log_prob.device)
    log_ratio = torch.where(valid, proximal_log_prob - behaviour_log_prob, zero).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    weights = torch.where(valid, CORRECTIONS[correction](log_ratio, valid, cap, low, high), zero)
    rows = valid.any(-1)
    ratio = log_ratio.exp()[valid]
    w = weights[valid]
    n = int(valid.sum())
    stats = {"tokens": float(n), "weight_sum": float(w.sum()), "masked_tokens": float((w == 0).sum()),
             "rows": float(rows.sum()), "masked_rows": float((rows & ~(weights > 0).any(-1)).sum()),
             "ratio_sum": float(ratio.sum()), "weight_max": float(w.max()) if n else 0.0,
             "ratio_max": float(ratio.max()) if n else 0.0}
    return weights, stats


def merge_stats(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """The statistics of two sets of tokens together."""
    return {**{k: a[k] + b[k] for k in SUM_KEYS}, **{k: max(a[k], b[k]) for k in MAX_KEYS}}


def off_policy_metrics(stats: dict[str, float]) -> dict[str, float]:
    """``off_policy/is_weight_mean`` and ``_max``, ``off_policy/masked_token_frac`` (valid tokens with weight
    0), ``off_policy/masked_seq_frac`` (sequences with tokens whose every weight is 0), ``off_policy/ratio_mean``
    and ``_max`` (the raw token ratio ``pi_prox / pi_behav`` before any cap); no tokens: nothing weighed."""
    tokens, rows = stats["tokens"], stats["rows"]
    if not tokens:
        return {"off_policy/is_weight_mean": 1.0, "off_policy/is_weight_max": 1.0, "off_policy/masked_token_frac": 0.0,
                "off_policy/masked_seq_frac": 0.0, "off_policy/ratio_mean": 1.0, "off_policy/ratio_max": 1.0}
    return {"off_policy/is_weight_mean": stats["weight_sum"] / tokens, "off_policy/is_weight_max": stats["weight_max"],
            "off_policy/masked_token_frac": stats["masked_tokens"] / tokens,
            "off_policy/masked_seq_frac": stats["masked_rows"] / rows if rows else 0.0,
            "off_policy/ratio_mean": stats["ratio_sum"] / tokens, "off_policy/ratio_max": stats["ratio_max"]}


# ------------------------------------------------------------------ bypass mode (the policy loss ``bypass_mode``)
# verl's rollout correction when the old policy *is* the behaviour policy (no proximal forward): weights and
# rejection masks between the current policy (detached) and the rollout's log-probs, computed inside the loss.

IS_LEVELS = ("none", "token", "sequence")
# rejection statistics of the log-ratio d = log(pi / pi_rollout), per token
_DIVERGENCES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda d: -d, "k2": lambda d: 0.5 * d.square(), "k3": lambda d: d.exp() - 1.0 - d}
REJECTION_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                     "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def bypass_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, upper: float,
                      lower: float | None = None) -> torch.Tensor:
    """Importance weights ``[batch, response_len]`` of the current policy over the rollout's, 0 on padding.

    ``token``: ``exp(d_t)``; ``sequence``: ``exp(sum_t m d_t)`` on every token of the row (``d`` clamped to
    +-20 first, as a sum for ``sequence``). Without ``lower`` they are truncated at ``upper`` (TIS); with it,
    weights outside ``[lower, upper]`` become 0 (IcePop). ``level`` ``none`` gives 1 on every valid token.
    """
    m = mask.to(log_ratio.dtype)
    if level == "none":
        return m.clone()
    if level == "token":
        raw = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    elif level == "sequence":
        raw = masked_sum(log_ratio, mask, dim=-1).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp().unsqueeze(-1)
        raw = raw.expand_as(log_ratio)
    else:
        raise ValueError(f"unknown importance-sampling level {level!r}; choose from {', '.join(IS_LEVELS)}")
    raw = raw * m
    if lower is None:
        return raw.clamp(max=upper)
    return torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))


def rejection_keep(log_ratio: torch.Tensor, mask: torch.Tensor, option: str, upper: float,
                   lower: float | None = None) -> torch.Tensor:
    """1 for each token (or every token of each sequence) that passes the rejection test ``option``, else 0.

    ``option`` is ``<level>_<k>``: the divergence ``k1 = -d``, ``k2 = d^2 / 2`` or ``k3 = e^d - 1 - d``
    (``d = log(pi / pi_rollout)`` clamped to +-20) per ``token``, or its ``seq_sum`` / ``seq_mean`` /
    ``seq_max`` over the valid tokens of a row. ``k1`` passes when it lies in ``[log lower, log upper]``
    (``lower`` defaults to ``1 / upper``), the others when they are at most ``upper``.
    """
    if option not in REJECTION_OPTIONS:
        raise ValueError(f"unknown rejection option {option!r}; choose from {', '.join(REJECTION_OPTIONS)}")
    level, kind = option.rsplit("_", 1)
    stat = _DIVERGENCES[kind](log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    if level == "seq_sum":
        stat = masked_sum(stat, mask, dim=-1).unsqueeze(-1)
    elif level == "seq_mean":
        count = mask.to(stat.dtype).sum(-1).clamp(min=1)
        stat = (masked_sum(stat, mask, dim=-1) / count).unsqueeze(-1)
    elif level == "seq_max":
        peak = torch.where(mask.bool(), stat, torch.full_like(stat, -math.inf)).amax(-1)
        stat = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak).unsqueeze(-1)
    if kind == "k1":
        low = 1.0 / upper if lower is None else lower
        keep = (stat >= math.log(low)) & (stat <= math.log(upper))
    else:
        keep = stat <= upper
    return keep.expand_as(log_ratio).to(log_ratio.dtype)
