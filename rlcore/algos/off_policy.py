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

Weights are 0 on padding. A weight multiplies the token's loss through its advantage (``A * w``): every
policy loss here is positively homogeneous in the advantage, so that is the weighted loss itself; masked
tokens stay in the loss normaliser, as a token with zero advantage does.
"""

from __future__ import annotations

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
