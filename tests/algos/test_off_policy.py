"""rlcore.algos.off_policy: each correction's weights and metrics against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from numpy.testing import assert_allclose

from rlcore.algos.losses import policy_loss
from rlcore.algos.off_policy import importance_weights, merge_stats, off_policy_metrics

# Token ratios pi_prox / pi_behav of three sequences (the third has one padding position, the second too):
#   row 0: 0.25, 1, 4      (product 1.0)
#   row 1: 1.5, 0.8, pad   (product 1.2)
#   row 2: 3, 1, pad       (product 3.0)
RATIOS = [[0.25, 1.0, 4.0], [1.5, 0.8, 1.0], [3.0, 1.0, 1.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0]], dtype=torch.float64)


def log_probs() -> tuple[torch.Tensor, torch.Tensor]:
    behaviour = torch.full((3, 3), math.log(0.2), dtype=torch.float64)
    proximal = behaviour + torch.tensor(RATIOS, dtype=torch.float64).log()
    proximal[1, 2] = 50.0  # garbage in padding must change nothing
    behaviour[2, 2] = -80.0
    return proximal, behaviour


def weights_of(correction: str, **bounds) -> tuple[torch.Tensor, dict]:
    proximal, behaviour = log_probs()
    w, stats = importance_weights(proximal, behaviour, MASK, correction, **bounds)
    return w, off_policy_metrics(stats)


def test_truncated_is_caps_each_token_ratio():
    w, m = weights_of("tis", cap=2.0)
    assert_allclose(w.numpy(), [[0.25, 1.0, 2.0], [1.5, 0.8, 0.0], [2.0, 1.0, 0.0]], rtol=1e-12)
    assert_allclose(m["off_policy/is_weight_mean"], (0.25 + 1 + 2 + 1.5 + 0.8 + 2 + 1) / 7, rtol=1e-12)
    assert m["off_policy/is_weight_max"] == pytest.approx(2.0)
    assert m["off_policy/masked_token_frac"] == 0.0 and m["off_policy/masked_seq_frac"] == 0.0
    assert_allclose(m["off_policy/ratio_mean"], (0.25 + 1 + 4 + 1.5 + 0.8 + 3 + 1) / 7, rtol=1e-12)
    assert m["off_policy/ratio_max"] == pytest.approx(4.0)


def test_sequence_masking_drops_whole_sequences_outside_the_bounds():
    w, m = weights_of("mis", low=0.5, high=2.0)  # products 1.0, 1.2 kept; 3.0 masked
    assert_allclose(w.numpy(), [[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    assert m["off_policy/masked_seq_frac"] == pytest.approx(1 / 3)
    assert m["off_policy/masked_token_frac"] == pytest.approx(2 / 7)
    assert m["off_policy/is_weight_mean"] == pytest.approx(5 / 7)
    w, m = weights_of("mis", low=0.5, high=1.1)  # now 1.2 is out too
    assert_allclose(w.numpy(), [[1, 1, 1], [0, 0, 0], [0, 0, 0]])
    assert m["off_policy/masked_seq_frac"] == pytest.approx(2 / 3)


def test_icepop_masks_single_tokens_outside_the_bounds():
    w, m = weights_of("icepop", low=0.5, high=2.0)  # 0.25, 4 and 3 are out
    assert_allclose(w.numpy(), [[0, 1, 0], [1, 1, 0], [0, 1, 0]])
    assert m["off_policy/masked_token_frac"] == pytest.approx(3 / 7)
    assert m["off_policy/masked_seq_frac"] == 0.0  # every sequence keeps a token
    assert m["off_policy/is_weight_mean"] == pytest.approx(4 / 7)


def test_none_weighs_every_valid_token_one_and_padding_zero():
    w, m = weights_of("none")
    assert_allclose(w.numpy(), MASK.numpy())
    assert m["off_policy/is_weight_mean"] == 1.0 and m["off_policy/masked_token_frac"] == 0.0


def test_on_policy_samples_get_weight_one_under_every_correction():
    lp = torch.log(torch.tensor([[0.3, 0.6], [0.9, 0.1]], dtype=torch.float64))
    mask = torch.ones(2, 2)
    for correction in ("none", "tis", "mis", "icepop"):
        w, stats = importance_weights(lp, lp.clone(), mask, correction)
        assert_allclose(w.numpy(), 1.0, err_msg=correction)
        assert off_policy_metrics(stats)["off_policy/ratio_max"] == pytest.approx(1.0)


def test_huge_log_ratios_stay_finite():
    proximal = torch.tensor([[0.0, 0.0]])
    behaviour = torch.tensor([[-500.0, 0.0]])  # a ratio of e^500: a token the rollout almost never samples
    w, stats = importance_weights(proximal, behaviour, torch.ones(1, 2), "tis", cap=3.0)
    assert w.tolist() == [[3.0, 1.0]]
    assert math.isfinite(off_policy_metrics(stats)["off_policy/ratio_max"])
    w, _ = importance_weights(proximal, behaviour, torch.ones(1, 2), "mis", low=0.5, high=2.0)
    assert w.tolist() == [[0.0, 0.0]]


def test_weighting_the_advantages_weighs_each_tokens_ppo_loss():
    """The trainer applies the weights as advantages * w: for the clipped PPO loss that is sum_t w_t * l_t / n."""
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]], dtype=torch.float64))
    new = torch.log(torch.tensor([[0.75, 0.5, 0.25]], dtype=torch.float64))  # ratios 1.5, 1, 0.5
    adv = torch.tensor([[1.0, -2.0, -1.0]], dtype=torch.float64)
    w = torch.tensor([[2.0, 0.5, 0.0]], dtype=torch.float64)
    loss, _ = policy_loss("vanilla", old_log_prob=old, log_prob=new, advantages=adv * w,
                          response_mask=torch.ones(1, 3), loss_agg_mode="token-mean", clip_ratio_low=0.2,
                          clip_ratio_high=0.2, clip_ratio_c=3.0)
    # token losses max(-A r, -A clip(r, 0.8, 1.2)): 1.5 -> max(-1.5, -1.2) = -1.2; 1 -> 2; 0.5 -> max(0.5, 0.8) = 0.8
    assert float(loss) == pytest.approx((2.0 * -1.2 + 0.5 * 2.0 + 0.0 * 0.8) / 3)


def test_statistics_merged_over_parts_equal_those_of_the_whole():
    """Micro-batches and ranks each weigh their rows; merged, their statistics are the whole batch's."""
    proximal, behaviour = log_probs()
    _, whole = importance_weights(proximal, behaviour, MASK, "mis", low=0.5, high=2.0)
    parts = [importance_weights(proximal[i:i + 1], behaviour[i:i + 1], MASK[i:i + 1], "mis", low=0.5, high=2.0)[1]
             for i in range(3)]
    merged = merge_stats(merge_stats(parts[0], parts[1]), parts[2])
    assert merged == pytest.approx(whole)
    assert off_policy_metrics(merged)["off_policy/masked_seq_frac"] == pytest.approx(1 / 3)
