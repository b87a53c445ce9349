"""Even work across data-parallel ranks (verl's ``balance_batch``).

``Dispatch.DP_COMPUTE`` hands rank ``r`` the ``r``-th contiguous chunk of a Batch. Every rank
then waits for the slowest at each collective of an update, so a rank that happens to hold the
long responses sets the pace. Reordering the rows once per step, before the first call that
depends on response lengths, gives every rank about the same number of tokens. Groups (the
``n`` responses of one prompt) stay whole, so a rank still runs each prompt once in a packed
forward. No Ray.
"""

from __future__ import annotations

import numpy as np
import torch

from rlcore.engine.sequence import response_attention
from rlcore.protocol import Batch


def balanced_partition(costs: np.ndarray, n_parts: int) -> list[np.ndarray]:
    """Split items into ``n_parts`` parts of equal count with sums as even as the greedy rule
    makes them: items by decreasing cost, each to the part with the smallest sum that still has
    room (longest-processing-time first, capped at ``len(costs) // n_parts`` items per part).

    Args:
        costs: ``[items]`` non-negative work per item; ``items`` divisible by ``n_parts``.
        n_parts: Number of parts (ranks).

    Returns:
        ``n_parts`` arrays of item indices, each sorted ascending (items keep their relative order).
    """
    if len(costs) % n_parts:
        raise ValueError(f"cannot split {len(costs)} items into {n_parts} parts of equal count")
    room = len(costs) // n_parts
    parts: list[list[int]] = [[] for _ in range(n_parts)]
    sums = np.zeros(n_parts)
    for item in np.argsort(-np.asarray(costs, dtype=np.float64), kind="stable"):
        open_parts = [p for p in range(n_parts) if len(parts[p]) < room]
        best = min(open_parts, key=lambda p: (sums[p], p))
        parts[best].append(int(item))
        sums[best] += costs[item]
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def balanced_row_order(group_costs: np.ndarray, group_size: int, n_ranks: int) -> np.ndarray | None:
    """Row order that gives each rank whole groups of about equal total cost.

    Args:
        group_costs: ``[groups]`` work of each group of ``group_size`` consecutive rows.
        group_size: Rows per group (``rollout.n``).
        n_ranks: Data-parallel ranks the Batch is chunked over.

    Returns:
        ``[groups * group_size]`` row indices, rank 0's rows first; None when the groups do not
        divide evenly over the ranks (the Batch is then best left as it is).
    """
    if len(group_costs) % n_ranks:
        return None
    groups = np.concatenate(balanced_partition(group_costs, n_ranks))
    return (groups[:, None] * group_size + np.arange(group_size)[None, :]).reshape(-1)


def group_token_costs(batch: Batch, n: int) -> np.ndarray:
    """Tokens a packed forward runs for each group of ``n`` rows: its prompt once, each distinct
    response once (``rlcore.engine.packed``); ``[groups]``."""
    groups = len(batch) // n
    mask = response_attention(batch).bool()  # every token a forward runs (a trajectory's observations too)
    keyed = torch.where(mask, batch["responses"], -1)
    group_id = torch.arange(groups).repeat_interleave(n)
    distinct = torch.unique(torch.cat([group_id[:, None], keyed], 1), dim=0)  # [distinct rows, 1 + len]
    response_tokens = torch.bincount(distinct[:, 0], weights=(distinct[:, 1:] >= 0).sum(-1).double(),
                                     minlength=groups)
    return (response_tokens + batch["prompt_mask"][::n].sum(-1)).numpy()


def balance_over_ranks(batch: Batch, n: int, n_ranks: int) -> tuple[Batch, float]:
    """``batch`` with whole groups reordered so the ``n_ranks`` chunks hold about equal token counts
    (``group_token_costs``); and the largest rank's share of tokens over the mean share after
    reordering (1.0 = even)."""
    costs = group_token_costs(batch, n)
    order = balanced_row_order(costs, n, n_ranks)
    if order is None:
        return batch, float("nan")
    batch = batch.select(order)
    per_rank = costs[order[::n] // n].reshape(n_ranks, -1).sum(-1)
    return batch, float(per_rank.max() / max(per_rank.mean(), 1e-9))
