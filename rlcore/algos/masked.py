"""Masked reductions shared by the advantage estimators and the losses.

Every function takes a value tensor and a 0/1 (or bool) ``mask`` of the same shape,
conventionally ``[batch, response_len]``, where 1 marks a real response token and 0 marks
padding or an observation token that must not influence the result. Values at masked
positions are replaced by 0 with ``torch.where`` before reducing, so even ``inf``/``nan``
stored in padding cannot leak into a result.
"""

from __future__ import annotations

from typing import Optional

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is non-zero, weighted by ``mask``.

    Formula: ``sum_i mask_i * x_i`` with masked entries of ``x`` treated as 0.

    Args:
        x: Values, any shape (typically ``[batch, response_len]``).
        mask: Same shape as ``x``; 1 = include, 0 = ignore.
        dim: Dimension to reduce; ``None`` reduces everything to a 0-dim tensor.

    Returns:
        The masked sum, with ``dim`` reduced.
    """
    keep = mask.bool()
    safe = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
    weighted = safe * mask.to(x.dtype)
    return weighted.sum() if dim is None else weighted.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1.

    Formula: ``sum_i mask_i x_i / max(sum_i mask_i, 1)``. Dividing by ``max(count, 1)``
    (instead of verl's ``count + 1e-8``) gives an exact mean when tokens exist and 0 when
    none do.

    Args:
        x: Values, any shape (typically ``[batch, response_len]``).
        mask: Same shape as ``x``; 1 = include, 0 = ignore.
        dim: Dimension to reduce; ``None`` reduces everything.

    Returns:
        The masked mean, with ``dim`` reduced.
    """
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all positions where ``mask`` is 1 (a single scalar).

    Formula: ``v = mean_mask((x - mean_mask(x))^2)``, times the Bessel correction
    ``n / (n - 1)`` (``n`` = number of masked-in entries) when ``unbiased``.

    Args:
        x: Values, any shape (typically ``[batch, response_len]``).
        mask: Same shape as ``x``; 1 = include, 0 = ignore.
        unbiased: Apply the Bessel correction (verl's default).

    Returns:
        0-dim tensor with the variance.

    Raises:
        ValueError: If no entry is masked in, or exactly one is and ``unbiased`` is set
            (the corrected variance would divide by zero), as in verl.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.to(x.dtype).sum()
        if n == 0:
            raise ValueError("masked_var: the mask selects no element")
        if n == 1:
            raise ValueError("masked_var: the mask selects one element; unbiased variance is undefined")
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Standardise ``x`` with the mean and unbiased variance of its masked-in entries.

    Formula: ``(x - mu) / sqrt(var + 1e-8)``; when ``shift_mean`` is False the mean is
    added back: ``(x - mu) / sqrt(var + 1e-8) + mu`` (verl's ``masked_whiten``).

    Args:
        x: Values, any shape (typically ``[batch, response_len]``).
        mask: Same shape as ``x``; 1 = include in the statistics, 0 = ignore.
        shift_mean: If True the result has mean 0 over the mask.

    Returns:
        Tensor shaped like ``x``. Masked positions are NOT zeroed here; callers multiply
        by the mask when they need exact zeros there.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean
