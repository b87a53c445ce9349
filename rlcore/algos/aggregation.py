"""Loss aggregation: a ``[batch, response_len]`` matrix of per-token losses to the scalar that is differentiated.

``LOSS_AGG_MODES`` selects by name (``agg_loss``, verl's ``loss_agg_mode``); each entry declares what it is
normalised by (tokens, sequences or nothing), so a micro-batch of a data-parallel mini-batch is scaled exactly
(:class:`AggScale`: the global mini-batch's token and row counts). Masks as in rlcore.algos.losses: 1 marks a
response token the loss is trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch

from rlcore.algos.masked import masked_mean, masked_sum
from rlcore.registry import Registry

Normalizer = Literal["tokens", "sequences", "none"]


@dataclass(frozen=True)
class AggScale:
    """Global normalisers of a loss computed on one micro-batch of a data-parallel mini-batch.

    With it, ``agg_loss`` returns the micro-batch's share of the global mini-batch loss times
    ``dp_size``: summed over a rank's micro-batches (gradient accumulation) and averaged over the
    ranks (DDP/FSDP gradient averaging), the gradient is that of the loss aggregated over the whole
    global mini-batch at once, however it was split (verl's ``global_batch_info``).
    """

    tokens: float
    """Valid (mask 1) tokens in the global mini-batch, all ranks."""
    rows: float
    """Rows (sequences) in the global mini-batch, all ranks, empty ones included."""
    dp_size: int = 1
    """Ranks whose gradients are averaged."""


@dataclass(frozen=True)
class AggMode:
    """A registered loss aggregation mode: what it sums, and what it divides by."""

    total: Callable[[torch.Tensor, torch.Tensor, Optional[float]], torch.Tensor]
    """``(loss_mat, loss_mask, loss_scale_factor) -> 0-dim`` sum over tokens or sequences."""
    normalizer: Normalizer
    """``tokens``: divided by the valid token count; ``sequences``: by the sequence count; ``none``.
    Under gradient accumulation a micro-batch therefore weighs its share of tokens or sequences."""


LOSS_AGG_MODES: Registry[AggMode] = Registry("loss aggregation mode")


def _row_totals(loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return masked_sum(loss_mat, loss_mask, dim=-1)


def _token_sum(loss_mat, loss_mask, loss_scale_factor):
    return masked_sum(loss_mat, loss_mask)


def _seq_token_sums(loss_mat, loss_mask, loss_scale_factor):
    return _row_totals(loss_mat, loss_mask).sum()


def _seq_token_means(loss_mat, loss_mask, loss_scale_factor):
    return masked_mean(loss_mat, loss_mask, dim=-1).sum()  # an empty row's mean is 0


def _seq_token_sums_normed(loss_mat, loss_mask, loss_scale_factor):
    scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return _row_totals(loss_mat, loss_mask).sum() / scale


LOSS_AGG_MODES.add("token-mean", AggMode(_token_sum, "tokens"))
LOSS_AGG_MODES.add("token-sum", AggMode(_token_sum, "none"))
LOSS_AGG_MODES.add("seq-mean-token-sum", AggMode(_seq_token_sums, "sequences"))
LOSS_AGG_MODES.add("seq-mean-token-mean", AggMode(_seq_token_means, "sequences"))
LOSS_AGG_MODES.add("seq-mean-token-sum-norm", AggMode(_seq_token_sums_normed, "sequences"))
# TRL's loss_type "bnpo" (GRPOTrainer) is an aggregation, not a policy loss: its per-token loss is GRPO's clipped
# surrogate (rlcore's ``vanilla``), and only the normaliser differs from TRL's "grpo" (sequence means) and "dapo"
# (global token count): the valid tokens of the batch. TRL counts them per device micro-batch, so its loss depends
# on how a mini-batch is split; here every term is normalised by the global mini-batch (``AggScale``), which makes
# "bnpo" the token mean of the whole mini-batch, the same normaliser as "token-mean".
LOSS_AGG_MODES.add("bnpo", AggMode(_token_sum, "tokens"))


def normalize(total: torch.Tensor, normalizer: Normalizer, loss_mask: torch.Tensor, scale: AggScale | None,
               *, all_rows: bool = False) -> torch.Tensor:
    """``total`` divided by the local (or, with ``scale``, global) token or sequence count, times ``dp_size``.
    Locally, sequences are the non-empty rows (all rows with ``all_rows``)."""
    if normalizer == "none":
        return total * (scale.dp_size if scale else 1)
    if scale is not None:
        count = scale.tokens if normalizer == "tokens" else scale.rows
        return total / max(float(count), 1.0) * scale.dp_size
    m = loss_mask.to(total.dtype)
    if normalizer == "tokens":
        count = m.sum()
    elif all_rows:
        count = torch.tensor(float(m.shape[0]), dtype=total.dtype, device=total.device)
    else:
        count = (m.sum(-1) > 0).to(total.dtype).sum()
    return total / count.clamp(min=1)


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str, *,
             loss_scale_factor: Optional[float] = None, scale: AggScale | None = None) -> torch.Tensor:
    """Aggregate a per-token loss matrix into a scalar (verl ``agg_loss``; Dr. GRPO, Liu et al. 2025,
    arXiv:2503.20783, motivates the length-unbiased modes).

    With ``m`` the mask, ``L_i = sum_t m_it`` and ``S`` the set of rows with ``L_i > 0``:

    * ``token-mean``: ``sum_it m_it l_it / sum_it m_it``.
    * ``bnpo`` (TRL's name): the same token mean over the whole mini-batch (TRL takes it per device
      micro-batch; see the registration for why it is an aggregation mode).
    * ``token-sum``: ``sum_it m_it l_it``.
    * ``seq-mean-token-sum``: ``mean_{i in S} sum_t m_it l_it``.
    * ``seq-mean-token-mean``: ``mean_{i in S} (sum_t m_it l_it / L_i)``.
    * ``seq-mean-token-sum-norm``: ``mean_{i in S} (sum_t m_it l_it) / loss_scale_factor``, the factor
      defaulting to ``response_len`` (``loss_mask.shape[-1]``): Dr. GRPO's constant normaliser
      ``1/G sum_i sum_t l_it / MAX_TOKENS``.

    Fully masked rows are left out of the sequence means (as verl does); an all-masked batch
    aggregates to 0 instead of NaN. With ``scale`` the denominators are the global mini-batch's
    token or row counts instead of this micro-batch's (its empty rows then count, as in verl's
    engine), and the result is multiplied by ``scale.dp_size`` (see :class:`AggScale`).

    Args:
        loss_mat: ``[batch, response_len]`` per-token losses.
        loss_mask: ``[batch, response_len]``; 1 = token counted, 0 = ignored.
        mode: A name in ``LOSS_AGG_MODES``.
        loss_scale_factor: Divisor of ``seq-mean-token-sum-norm`` (the other modes have none).
        scale: Global normalisers when ``loss_mat`` is one micro-batch of a larger mini-batch.

    Returns:
        0-dim loss tensor.
    """
    entry = LOSS_AGG_MODES.get(mode)
    return normalize(entry.total(loss_mat, loss_mask, loss_scale_factor), entry.normalizer, loss_mask, scale)
