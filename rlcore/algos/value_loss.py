"""The critic's loss: PPO's clipped value-function loss, aggregated as the policy loss is."""

from __future__ import annotations

from typing import Optional

import torch

from rlcore.algos.aggregation import AggScale, agg_loss
from rlcore.algos.masked import masked_mean

def value_loss(
    vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, *,
    cliprange_value: float, loss_agg_mode: str = "token-mean", agg_scale: Optional[AggScale] = None,
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
        agg_scale: Global normalisers of a micro-batch (``AggScale``).

    Returns:
        ``(loss, clipfrac)``, both 0-dim tensors (``clipfrac`` detached).
    """
    vclipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    unclipped_loss = (vpreds - returns) ** 2
    clipped_loss = (vclipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(unclipped_loss, clipped_loss), response_mask, loss_agg_mode,
                          scale=agg_scale)
    clipfrac = masked_mean((clipped_loss > unclipped_loss).to(vpreds.dtype), response_mask).detach()
    return loss, clipfrac
