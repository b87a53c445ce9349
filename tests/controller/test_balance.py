"""Tests for rlcore.controller.balance and the PPO step's use of it (``balance_over_ranks``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from rlcore.controller.balance import balance_over_ranks, balanced_partition, balanced_row_order, group_token_costs
from rlcore.protocol import Batch


def test_a_hand_worked_partition():
    # by decreasing cost: 10 -> part 0, 8 -> part 1, 1 (item 1) -> part 1 (9 < 10), 1 (item 2) -> part 0 (part 1 full)
    parts = balanced_partition(np.array([10.0, 1.0, 1.0, 8.0]), 2)
    assert [p.tolist() for p in parts] == [[0, 2], [1, 3]]


def optimal_max(costs: np.ndarray) -> float:
    """The smallest possible larger half over all splits into two equal-count halves (brute force)."""
    total, half = costs.sum(), len(costs) // 2
    return min(max(costs[list(c)].sum(), total - costs[list(c)].sum())
               for c in itertools.combinations(range(len(costs)), half))


@pytest.mark.parametrize("seed", range(20))
def test_parts_have_equal_counts_cover_every_item_once_and_stay_near_the_optimum(seed):
    costs = np.random.default_rng(seed).integers(1, 60, size=8).astype(float)
    parts = balanced_partition(costs, 2)
    assert [len(p) for p in parts] == [4, 4]
    assert sorted(np.concatenate(parts).tolist()) == list(range(8))
    worst = max(costs[p].sum() for p in parts)
    # greedy largest-first with a cardinality cap is within 4/3 of the best split (Kellerer & Woeginger)
    assert worst <= 4 / 3 * optimal_max(costs) + 1e-9


def test_unequal_counts_are_refused_and_the_row_order_is_none():
    with pytest.raises(ValueError, match="5 items into 2 parts"):
        balanced_partition(np.ones(5), 2)
    assert balanced_row_order(np.ones(3), 4, 2) is None


def test_row_order_keeps_groups_whole_and_in_their_rank():
    # groups 0..3 of 3 rows; costs put groups 0 and 3 together (100 + 1) against 1 and 2 (60 + 50)
    order = balanced_row_order(np.array([100.0, 60.0, 50.0, 1.0]), 3, 2)
    assert order.tolist() == [0, 1, 2, 9, 10, 11, 3, 4, 5, 6, 7, 8]


def grouped_batch() -> Batch:
    """Four groups of two rows; groups 0 and 1 have long responses, 2 and 3 short ones, so the
    contiguous halves are lopsided (rank 0 would get all the long ones). Group d's two responses
    are the same, so a packed forward runs it once."""
    lengths = [6, 6, 5, 5, 1, 1, 4, 4]
    response_mask = torch.tensor([[1] * k + [0] * (6 - k) for k in lengths])
    responses = (torch.arange(8)[:, None] * 10 + torch.arange(6)[None, :]) * response_mask
    responses[7] = responses[6]
    prompt_mask = torch.tensor([[0, 1, 1]] * 8)  # two prompt tokens each
    return Batch({"prompt_mask": prompt_mask, "responses": responses, "response_mask": response_mask,
                  "row": torch.arange(8)}, {"uid": np.repeat(np.array(["a", "b", "c", "d"], dtype=object), 2)})


def test_group_costs_count_each_prompt_and_each_distinct_response_once():
    assert group_token_costs(grouped_batch(), 2).tolist() == [2 + 12, 2 + 10, 2 + 2, 2 + 4]


def test_balance_over_ranks_evens_out_the_tokens_per_rank():
    batch = grouped_batch()
    costs = {"a": 2 + 12, "b": 2 + 10, "c": 2 + 2, "d": 2 + 4}  # prompt once plus the distinct responses
    before = [sum(costs[u] for u in set(h["uid"])) for h in batch.chunk(2)]
    assert before == [26, 10]
    out, imbalance = balance_over_ranks(batch, 2, 2)
    halves = out.chunk(2)
    after = [sum(costs[u] for u in set(h["uid"])) for h in halves]
    assert sorted(after) == [18, 18]  # a+c and b+d
    assert imbalance == pytest.approx(1.0)
    assert sorted(out["row"].tolist()) == list(range(8))  # a permutation of the rows
    for h in halves:  # each group whole, on one rank
        uids = h["uid"].tolist()
        assert uids[0::2] == uids[1::2]
