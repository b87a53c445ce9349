"""Statistics of the policy's next-token distributions as plain tensor expressions: the entropy (the update takes it
in chunks with its log-probs, ``rlcore.engine.logits``) and the sum of squared probabilities (the optimal token
baseline's realised energy). Pure tensor math."""

from __future__ import annotations

import torch


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


def sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``sum_v softmax(logits)_v^2`` at each position, in log space: ``exp(logsumexp(2 z) - 2 logsumexp(z))``
    (no probability is squared directly, so tiny ones neither underflow nor lose the sum's precision).

    Args:
        logits: ``[..., vocab]`` unnormalised scores.

    Returns:
        ``[...]`` in ``[1 / vocab, 1]``.
    """
    return torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * torch.logsumexp(logits, dim=-1))
