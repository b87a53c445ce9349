"""Tests for rlcore.algos.losses: hand-worked values, properties, reference agreement."""

from __future__ import annotations

import math

import pytest
import torch
from numpy.testing import assert_allclose

from rlcore.algos.entropy import entropy_from_logits
from rlcore.algos.losses import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    AggScale,
    PolicyLossOptions,
    agg_loss,
    kl_penalty,
    policy_loss,
    value_loss,
)
from rlcore.algos.masked import masked_mean, masked_var, masked_whiten
from rlcore.registry import options_from

from . import reference_impl as ref

F64 = torch.float64
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def t(rows):
    return torch.tensor(rows, dtype=F64)


def loss_inputs(seed, group_sizes=(3, 2, 1, 4), response_len=7):
    """Random float64 policy-loss inputs with right padding and uneven lengths."""
    _, mask, _, _, _ = ref.random_batch(seed=seed, group_sizes=group_sizes, response_len=response_len)
    gen = torch.Generator().manual_seed(1000 + seed)
    old = -torch.rand(mask.shape, generator=gen, dtype=F64) * 3.0
    new = old + torch.randn(mask.shape, generator=gen, dtype=F64) * 0.6
    adv = torch.randn(mask.shape, generator=gen, dtype=F64)
    return old, new, adv, mask


def call(mode, old, new, adv, mask, **kw):
    return policy_loss(mode, old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, **kw)


def call_with(mode, old, new, adv, mask, **settings):
    """As a worker calls a loss: typed settings, of which the loss takes the options it declares."""
    options = options_from(PolicyLossOptions(**settings), POLICY_LOSSES.get(mode).options)
    return call(mode, old, new, adv, mask, **options)


# ----------------------------------------------------------------- hand-worked


def test_vanilla_ppo_clip_and_dual_clip_by_hand():
    old = t([[0.0, 0.0, 0.0, 0.0]])
    new = t([[math.log(1.5), math.log(4.0), math.log(0.5), math.log(1.1)]])
    adv = t([[1.0, -1.0, -1.0, 2.0]])
    mask = torch.ones(1, 4, dtype=F64)
    loss, metrics = call("vanilla", old, new, adv, mask)
    # tok0: A=1, r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped)
    # tok1: A=-1, r=4 -> max(4, 1.2) = 4 -> dual clip min(4, 3) = 3
    # tok2: A=-1, r=0.5 -> max(0.5, 0.8) = 0.8 (clipped), 0.8 < 3
    # tok3: A=2, r=1.1 -> -2.2 (inside the clip range)
    assert_allclose(loss.item(), (-1.2 + 3.0 + 0.8 - 2.2) / 4, atol=1e-12)
    assert_allclose(float(metrics["pg_clipfrac"]), 2 / 4, atol=1e-12)
    assert_allclose(float(metrics["pg_clipfrac_lower"]), 1 / 4, atol=1e-12)
    kl = -(math.log(1.5) + math.log(4.0) + math.log(0.5) + math.log(1.1)) / 4
    assert_allclose(float(metrics["ppo_kl"]), kl, atol=1e-12)


def test_vanilla_clip_higher_is_asymmetric():
    old, mask = t([[0.0]]), t([[1.0]])
    new = t([[math.log(1.25)]])
    symmetric, _ = call("vanilla", old, new, t([[1.0]]), mask)
    higher, m = call("vanilla", old, new, t([[1.0]]), mask, clip_ratio_high=0.28)
    assert_allclose(symmetric.item(), -1.2, atol=1e-12)
    assert_allclose(higher.item(), -1.25, atol=1e-12)
    assert float(m["pg_clipfrac"]) == 0.0
    low, _ = call("vanilla", old, t([[math.log(0.7)]]), t([[-1.0]]), mask, clip_ratio_low=0.1)
    assert_allclose(low.item(), 0.9, atol=1e-12)  # max(0.7, clip(0.7, 0.9, 1.2) = 0.9)


def test_vanilla_gradient_vanishes_when_clipped():
    old = t([[0.0, 0.0]])
    new = t([[math.log(1.5), math.log(1.1)]]).requires_grad_(True)
    loss, _ = call("vanilla", old, new, t([[1.0, 1.0]]), torch.ones(1, 2, dtype=F64))
    loss.backward()
    # d/dlogp of -A r / 2 = -A r / 2 for the unclipped token, 0 for the clipped one
    assert_allclose(new.grad.numpy(), [[0.0, -1.1 / 2]], atol=1e-12)


def test_gspo_sequence_ratio_and_gradient_by_hand():
    old = t([[-1.0, -2.0], [-1.0, -3.0]])
    new = t([[-0.9, -2.1], [-0.95, 5.0]]).requires_grad_(True)
    adv = t([[1.0, 1.0], [-2.0, -2.0]])
    mask = t([[1, 1], [1, 0]])
    loss, metrics = call("gspo", old, new, adv, mask)
    # row0: s = exp((0.1 - 0.1) / 2) = 1; row1: s = exp(0.05) (padding excluded)
    # always a mean over sequences of token means: ((-1 - 1) / 2 + 2 s1 / 1) / 2
    s1 = math.exp(0.05)
    assert_allclose(loss.item(), (-1.0 + 2.0 * s1) / 2, atol=1e-12)
    loss.backward()
    # grad of -A * s_i * exp(logp - sg[logp]) is -A * s_i / (rows * L_i) per valid token
    assert_allclose(new.grad.numpy(), [[-1 / 4, -1 / 4], [s1, 0.0]], atol=1e-12)
    with pytest.raises(TypeError, match="loss_agg_mode"):  # gspo fixes its own aggregation
        call("gspo", old, new, adv, mask, loss_agg_mode="token-mean")
    assert float(metrics["pg_clipfrac"]) == 0.0 and float(metrics["pg_clipfrac_lower"]) == 0.0


def test_gspo_clips_sequence_ratio():
    old = t([[0.0, 0.0]])
    new = t([[0.5, 0.5]])  # s = e^0.5 = 1.6487 > 1.2
    ones = torch.ones(1, 2, dtype=F64)
    loss, metrics = call("gspo", old, new, t([[1.0, 1.0]]), ones)
    assert_allclose(loss.item(), -1.2, atol=1e-12)
    assert_allclose(float(metrics["pg_clipfrac"]), 1.0, atol=0)


def test_geo_mean_by_hand():
    old = t([[0.0, 0.0]])
    new = t([[0.3, -0.1]])
    loss, metrics = call("geo_mean", old, new, t([[1.0, 1.0]]), torch.ones(1, 2, dtype=F64))
    # A > 0: log-ratios clipped from above only: [min(.3, .2), min(-.1, -.1)] = [.2, -.1]
    # rho = exp(0.1 / 2); loss = -1 * rho
    assert_allclose(loss.item(), -math.exp(0.05), rtol=1e-7)
    assert_allclose(float(metrics["pg_clipfrac"]), 0.5, atol=0)
    assert float(metrics["pg_clipfrac_lower"]) == 0.0


def test_cispo_keeps_gradient_of_clipped_tokens():
    old = t([[0.0, 0.0]])
    new = t([[math.log(2.0), math.log(1.1)]]).requires_grad_(True)
    adv = t([[1.0, -1.0]])
    loss, metrics = call("cispo", old, new, adv, torch.ones(1, 2, dtype=F64))
    # weights: clip(2, .8, 1.2) = 1.2 (clipped), 1.1; loss = mean(-w A logp)
    expected = (-1.2 * 1.0 * math.log(2.0) + 1.1 * math.log(1.1)) / 2
    assert_allclose(loss.item(), expected, atol=1e-12)
    loss.backward()
    assert_allclose(new.grad.numpy(), [[-1.2 / 2, 1.1 / 2]], atol=1e-12)
    assert_allclose(float(metrics["pg_clipfrac"]), 0.5, atol=0)


def test_gpg_loss_by_hand():
    new = t([[-1.0, -2.0], [-0.5, 9.0]])
    adv = t([[1.0, 1.0], [-2.0, 3.0]])
    loss, metrics = call("gpg", new, new, adv, t([[1, 1], [1, 0]]), loss_agg_mode="seq-mean-token-sum")
    # row sums of -A logp: (1 + 2) and (-1); seq-mean = 1
    assert_allclose(loss.item(), 1.0, atol=1e-12)
    assert float(metrics["pg_clipfrac"]) == 0.0 and float(metrics["ppo_kl"]) == 0.0


def _cov_inputs():
    logp = t([[0.6, -0.4, -0.1, -0.1]])
    adv = t([[3.0, -3.0, 0.0, 0.0]])
    # means are 0, so covariance = A * logp = [1.8, 1.2, 0, 0]
    return logp, adv, torch.ones(1, 4, dtype=F64)


def test_clip_cov_detaches_top_covariance_token():
    logp, adv, mask = _cov_inputs()
    new = logp.clone().requires_grad_(True)
    loss, metrics = call("clip_cov", logp, new, adv, mask)
    # k = max(int(0.0002 * 4), 1) = 1 -> token 0 (cov 1.8, inside (1, 5)) is zeroed
    # remaining losses -A r = [., 3, 0, 0] -> token-mean = 3 / 4
    assert_allclose(loss.item(), 0.75, atol=1e-12)
    assert_allclose(float(metrics["pg_clipfrac"]), 0.25, atol=0)
    loss.backward()
    assert new.grad[0, 0].item() == 0.0 and new.grad[0, 1].item() != 0.0
    again, _ = call("clip_cov", logp, logp, adv, mask)
    assert again.item() == loss.item()  # deterministic without a generator
    two, m2 = call("clip_cov", logp, logp, adv, mask, clip_cov_ratio=0.5)
    assert_allclose(two.item(), 0.0, atol=1e-12)  # both candidates (1.8, 1.2) zeroed
    assert_allclose(float(m2["pg_clipfrac"]), 0.5, atol=0)
    random_pick, _ = call("clip_cov", logp, logp, adv, mask, generator=torch.Generator().manual_seed(0))
    assert random_pick.item() in (0.75, -0.75)  # one of the two candidates


def test_kl_cov_penalises_top_covariance_token():
    logp, adv, mask = _cov_inputs()
    old = logp - t([[0.1, 0.1, 0.0, 0.0]])
    loss, metrics = call("kl_cov", old, logp, adv, mask)
    # -A r = [-3e^.1, 3e^.1, 0, 0]; token 0 gets + 1.0 * |0.1| -> sum = 0.1; mean 0.025
    assert_allclose(loss.item(), 0.025, atol=1e-12)
    assert_allclose(float(metrics["ppo_kl"]), 0.2 / 4, atol=1e-12)
    loss2, _ = call("kl_cov", old, logp, adv, mask, ppo_kl_coef=3.0)
    assert_allclose(loss2.item(), 0.3 / 4, atol=1e-12)


def test_kl_penalty_kinds_by_hand():
    logp, refp = t([[math.log(0.5)]]), t([[math.log(0.25)]])
    ln2 = math.log(2.0)
    expected = {"kl": ln2, "k1": ln2, "abs": ln2, "mse": 0.5 * ln2**2, "k2": 0.5 * ln2**2,
                "low_var_kl": 0.5 + ln2 - 1.0, "k3": 0.5 + ln2 - 1.0}
    for kind, value in expected.items():
        assert_allclose(kl_penalty(logp, refp, kind).item(), value, atol=1e-12)
    assert_allclose(kl_penalty(t([[0.0]]), t([[-1.0]]), "abs").item(), 1.0, atol=0)
    # k3 clamps: log-ratio 50 -> clamped to 20, e^20 - 21 -> clamped to 10
    assert kl_penalty(t([[-50.0]]), t([[0.0]]), "k3").item() == 10.0


def test_agg_modes_by_hand():
    loss = t([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    assert_allclose(agg_loss(loss, mask, "token-mean").item(), 10 / 4, atol=1e-12)
    assert_allclose(agg_loss(loss, mask, "seq-mean-token-sum").item(), (6 + 4) / 2, atol=1e-12)
    assert_allclose(agg_loss(loss, mask, "seq-mean-token-mean").item(), (2 + 4) / 2, atol=1e-12)
    assert_allclose(agg_loss(loss, mask, "token-sum").item(), 10.0, atol=1e-12)
    # Dr. GRPO: mean over sequences of token sums, over a constant (default: the row width, 3)
    assert_allclose(agg_loss(loss, mask, "seq-mean-token-sum-norm").item(), (6 + 4) / 2 / 3, atol=1e-12)
    assert_allclose(agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=5).item(), 1.0, atol=1e-12)


def test_seq_mean_token_sum_norm_does_not_grow_with_the_batch():
    """Doubling the batch with copies of its rows leaves a mean over sequences unchanged (the old
    definition, a total divided by a constant, doubled)."""
    loss, mask = t([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]]), t([[1, 1, 1], [1, 0, 0]])
    one = agg_loss(loss, mask, "seq-mean-token-sum-norm").item()
    two = agg_loss(torch.cat([loss, loss]), torch.cat([mask, mask]), "seq-mean-token-sum-norm").item()
    assert_allclose(two, one, atol=1e-12)


def test_agg_skips_fully_masked_rows():
    loss = t([[1.0, 2.0], [7.0, 7.0]])
    mask = t([[1, 1], [0, 0]])
    assert_allclose(agg_loss(loss, mask, "seq-mean-token-mean").item(), 1.5, atol=1e-12)
    assert_allclose(agg_loss(loss, mask, "seq-mean-token-sum").item(), 3.0, atol=1e-12)
    assert agg_loss(loss, torch.zeros_like(mask), "token-mean").item() == 0.0


def test_value_loss_by_hand():
    vpreds, values, returns = t([[1.0, 0.0]]), t([[0.5, 0.0]]), t([[2.0, 1.0]])
    loss, clipfrac = value_loss(vpreds, returns, values, torch.ones(1, 2, dtype=F64), cliprange_value=0.2)
    # tok0: clipped vpred 0.7 -> max(1, 1.69) = 1.69; tok1: max(1, 1) = 1
    assert_allclose(loss.item(), 0.5 * (1.69 + 1.0) / 2, atol=1e-12)
    assert_allclose(clipfrac.item(), 0.5, atol=0)


def test_entropy_by_hand_and_stable():
    logits = t([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, float("-inf"), float("-inf")], [1000.0, 0.0, 0.0, 0.0]])
    ent = entropy_from_logits(logits)
    assert_allclose(ent[:2].numpy(), [math.log(4.0), math.log(2.0)], atol=1e-12)
    assert torch.isfinite(ent).all() and abs(ent[2].item()) < 1e-12
    x = torch.randn(3, 5, 11, dtype=F64)
    p = torch.softmax(x, -1)
    assert_allclose(entropy_from_logits(x).numpy(), (-(p * p.log()).sum(-1)).numpy(), atol=1e-12)
    assert entropy_from_logits(x).shape == (3, 5)


def test_masked_helpers_by_hand():
    x, mask = t([[1.0, 3.0, 99.0]]), t([[1, 1, 0]])
    assert masked_mean(x, mask).item() == 2.0
    assert_allclose(masked_mean(x, mask, dim=-1).numpy(), [2.0])
    assert masked_var(x, mask).item() == 2.0  # ((1)^2 + (1)^2) / (2 - 1)
    assert_allclose(masked_whiten(x, mask)[0, :2].numpy(), [-1 / math.sqrt(2 + 1e-8), 1 / math.sqrt(2 + 1e-8)])
    step = 1 / math.sqrt(2 + 1e-8)
    assert_allclose(masked_whiten(x, mask, shift_mean=False)[0, :2].numpy(), [2 - step, 2 + step])
    with pytest.raises(ValueError):
        masked_var(x, t([[1, 0, 0]]))


# -------------------------------------------------------------------- properties


@pytest.mark.parametrize("mode", sorted(POLICY_LOSSES.names()))
@pytest.mark.parametrize("agg", AGG_MODES)
def test_masked_tokens_do_not_contribute(mode, agg):
    old, new, adv, mask = loss_inputs(seed=21)
    pad = mask == 0
    assert pad.any()
    new_a = new.clone().requires_grad_(True)
    loss_a, metrics_a = call_with(mode, old, new_a, adv, mask, loss_agg_mode=agg)
    new_b = new.masked_fill(pad, 30.0).requires_grad_(True)
    old_b, adv_b = old.masked_fill(pad, -40.0), adv.masked_fill(pad, 1e3)
    loss_b, metrics_b = call_with(mode, old_b, new_b, adv_b, mask, loss_agg_mode=agg)
    assert torch.isfinite(loss_a)
    assert_allclose(loss_a.item(), loss_b.item(), rtol=1e-12, atol=1e-12)
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        assert_allclose(float(metrics_a[key]), float(metrics_b[key]), rtol=1e-12, atol=1e-12)
    loss_b.backward()
    assert torch.all(new_b.grad[pad] == 0)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_agg_ignores_masked_values(agg):
    _, loss_mat, _, mask = loss_inputs(seed=2)
    perturbed = loss_mat.masked_fill(mask == 0, float("inf"))
    assert agg_loss(loss_mat, mask, agg).item() == agg_loss(perturbed, mask, agg).item()


def test_value_loss_ignores_masked_tokens():
    old, new, adv, mask = loss_inputs(seed=9)
    pad = mask == 0
    a = value_loss(new, adv, old, mask, cliprange_value=0.3)
    b = value_loss(new.masked_fill(pad, 9.0), adv.masked_fill(pad, -9.0), old, mask, cliprange_value=0.3)
    assert a[0].item() == b[0].item() and a[1].item() == b[1].item()


def test_token_mean_equals_seq_mean_token_mean_for_one_sequence():
    gen = torch.Generator().manual_seed(3)
    loss_mat = torch.randn(1, 9, generator=gen, dtype=F64)
    mask = t([[1, 1, 1, 1, 1, 1, 0, 0, 0]])
    a = agg_loss(loss_mat, mask, "token-mean").item()
    b = agg_loss(loss_mat, mask, "seq-mean-token-mean").item()
    assert_allclose(a, b, rtol=1e-12)
    assert_allclose(a, loss_mat[0, :6].mean().item(), rtol=1e-12)


def test_metrics_are_detached_and_complete():
    old, new, adv, mask = loss_inputs(seed=1)
    new = new.requires_grad_(True)
    for mode in POLICY_LOSSES.names():
        loss, metrics = call(mode, old, new, adv, mask)
        assert loss.dim() == 0 and loss.requires_grad
        for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
            value = metrics[key]
            assert not (isinstance(value, torch.Tensor) and value.requires_grad)


def test_registries_refuse_duplicates_and_list_names():
    for registry, taken in ((POLICY_LOSSES, "vanilla"), (KL_ESTIMATORS, "k3"), (LOSS_AGG_MODES, "token-mean")):
        with pytest.raises(ValueError, match="already registered"):
            registry.register(taken)(lambda *a, **k: None)
    old, new, adv, mask = loss_inputs(seed=0)
    with pytest.raises(KeyError) as info:
        call("ppo_plus_magic", old, new, adv, mask)
    assert "vanilla" in str(info.value) and "gspo" in str(info.value) and "cispo" in str(info.value)
    with pytest.raises(KeyError, match="low_var_kl"):
        kl_penalty(new, old, "k9")
    with pytest.raises(KeyError, match="seq-mean-token-mean"):
        agg_loss(new, mask, "token-median")
    with pytest.raises(TypeError, match="clip_cov_rati"):
        call("clip_cov", old, new, adv, mask, clip_cov_rati=0.1)
    with pytest.raises(TypeError, match="clip_ratio_c"):  # a real option, but not one cispo takes
        call("cispo", old, new, adv, mask, clip_ratio_c=3.0)


def test_all_spec_names_registered():
    assert set(POLICY_LOSSES.names()) >= {"vanilla", "gspo", "geo_mean", "gpg", "cispo", "clip_cov", "kl_cov"}
    assert set(KL_ESTIMATORS.names()) >= {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k3+", "low_var_kl+"}
    assert set(LOSS_AGG_MODES.names()) == set(AGG_MODES)


# ---------------------------------------------------------- reference agreement

SEEDS = [0, 1, 2]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", sorted(KL_ESTIMATORS.names()))
def test_kl_matches_reference(seed, kind):
    old, new, _, _ = loss_inputs(seed)
    new = new.clone().requires_grad_(True)
    with torch.no_grad():
        new[0, 0] = old[0, 0] + 25.0  # exercise the k3 clamps
    value = kl_penalty(new, old, kind)
    assert_allclose(value.detach().numpy(), ref.kl(new, old, kind), atol=1e-5, rtol=1e-5)
    value.sum().backward()
    # d/dlogp of each estimator, by hand; a "+" variant has k2's gradient, logp - logp_ref
    d = (new - old).detach()
    x = (old - new).detach()
    plain = {"kl": torch.ones_like(d), "k1": torch.ones_like(d), "abs": torch.sign(d), "mse": d, "k2": d,
             "low_var_kl": 1 - torch.exp(x), "k3": 1 - torch.exp(x)}
    expected = d if kind.endswith("+") else plain[kind]
    if kind in ("low_var_kl", "k3"):  # the clamps cut the gradient where they bind
        expected = torch.where((x.abs() < 20) & ((torch.exp(x) - x - 1).abs() < 10), expected, torch.zeros_like(d))
    assert_allclose(new.grad.numpy(), expected.numpy(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_agg_matches_reference(seed, agg):
    _, loss_mat, _, mask = loss_inputs(seed)
    mask = mask.clone()
    mask[-1] = 0  # a fully masked row: left out of the sequence means
    assert_allclose(agg_loss(loss_mat, mask, agg).item(), ref.agg(loss_mat, mask, agg), atol=1e-5, rtol=1e-5)
    assert_allclose(agg_loss(loss_mat, mask, agg, loss_scale_factor=4096.0).item(),
                    ref.agg(loss_mat, mask, agg, 4096.0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batches_on_ranks_add_up_to_the_global_aggregate(agg):
    """Split a batch into 2 ranks x 3 micro-batches: with AggScale holding the global token and row
    counts, summing each rank's micro-batch losses and averaging over the ranks (what gradient
    accumulation and DDP/FSDP averaging do) gives the aggregate over the whole batch, for every mode.
    The batch has no fully masked row (whose rows the global count keeps, as verl's engine does)."""
    _, loss_mat, _, mask = loss_inputs(seed=4, group_sizes=(4, 4, 4))  # 12 rows
    scale = AggScale(tokens=float(mask.sum()), rows=12.0, dp_size=2)
    per_rank = []
    for rank_rows in (slice(0, 6), slice(6, 12)):
        micros = [(rank_rows.start + i, rank_rows.start + j) for i, j in ((0, 1), (1, 4), (4, 6))]
        per_rank.append(sum(agg_loss(loss_mat[a:b], mask[a:b], agg, scale=scale) for a, b in micros))
    assert_allclose(float(sum(per_rank) / 2), ref.agg(loss_mat, mask, agg), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "geo_mean", "cispo"])
def test_policy_loss_gradient_is_the_same_in_micro_batches(mode):
    """The gradient of a loss over the whole batch equals the summed gradients of its micro-batches
    computed with the global normalisers, also for gspo and geo_mean whose own aggregation is a
    sequence mean while the configured mode is token-mean."""
    old, new, adv, mask = loss_inputs(seed=6, group_sizes=(3, 3))
    adv = adv[:, :1].expand_as(adv).clone()
    whole = new.clone().requires_grad_(True)
    call_with(mode, old, whole, adv, mask)[0].backward()
    parts = new.clone().requires_grad_(True)
    scale = AggScale(tokens=float(mask.sum()), rows=6.0, dp_size=1)
    for a, b in ((0, 2), (2, 6)):
        options = options_from(PolicyLossOptions(), POLICY_LOSSES.get(mode).options)
        call(mode, old[a:b], parts[a:b], adv[a:b], mask[a:b], agg_scale=scale, **options)[0].backward()
    assert_allclose(parts.grad.numpy(), whole.grad.numpy(), atol=1e-12)


def _reference_loss(mode, old, new, adv, mask, agg, low, high, c, lsf):
    if mode == "vanilla":
        return ref.vanilla(old, new, adv, mask, agg, low, high, c, lsf)
    if mode == "gspo":
        return ref.gspo(old, new, adv, mask, low, high)
    if mode == "geo_mean":
        return ref.geo_mean(old, new, adv, mask, low, high)
    if mode == "gpg":
        return ref.gpg_loss(new, adv, mask, agg, lsf)
    if mode == "cispo":
        return ref.cispo(old, new, adv, mask, agg, low, high, lsf)
    if mode == "clip_cov":  # a wider window and ratio than the defaults, so several tokens qualify
        return ref.clip_cov(old, new, adv, mask, agg, low, high, 0.15, 0.05, 5.0, lsf)
    if mode == "kl_cov":
        return ref.kl_cov(old, new, adv, mask, agg, 0.15, 2.0, lsf)
    raise AssertionError(mode)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode", sorted(POLICY_LOSSES.names()))
def test_policy_losses_match_reference(mode, agg, seed):
    old, new, adv, mask = loss_inputs(seed)
    if mode in ("gspo", "geo_mean"):  # sequence-level advantages, as these methods assume
        adv = adv[:, :1].expand_as(adv).clone()
    low, high, c, lsf = 0.2, 0.28, 3.0, 5.0
    loss, metrics = call_with(mode, old, new, adv, mask, loss_agg_mode=agg, loss_scale_factor=lsf, clip_ratio_low=low,
                              clip_ratio_high=high, clip_ratio_c=c, clip_cov_ratio=0.15, clip_cov_lb=0.05,
                              kl_cov_ratio=0.15, ppo_kl_coef=2.0)
    exp_loss, exp_metrics = _reference_loss(mode, old, new, adv, mask, agg, low, high, c, lsf)
    assert_allclose(loss.item(), exp_loss, atol=1e-5, rtol=1e-5)
    for key, value in exp_metrics.items():
        assert_allclose(float(metrics[key]), value, atol=1e-5, rtol=1e-5)


def test_reference_inputs_exercise_the_covariance_selection():
    """Guard: with the settings above, clip_cov cuts some but not all of its candidates."""
    for seed in SEEDS:
        old, new, adv, mask = loss_inputs(seed)
        _, metrics = call("clip_cov", old, new, adv, mask, clip_cov_ratio=0.15, clip_cov_lb=0.05)
        assert 0 < float(metrics["pg_clipfrac"]) < 0.5


def test_value_loss_matches_reference():
    old, new, adv, mask = loss_inputs(seed=7)
    loss, clipfrac = value_loss(new, adv, old, mask, cliprange_value=0.3)
    exp_loss, exp_clipfrac = ref.value_loss(new, adv, old, mask, 0.3)
    assert_allclose(loss.item(), exp_loss, atol=1e-9)
    assert_allclose(clipfrac.item(), exp_clipfrac, atol=1e-9)
    assert 0 < exp_clipfrac < 1


def test_reference_inputs_exercise_clipping():
    """Guard: the random inputs above must actually hit the clipped branches."""
    fractions = [call("vanilla", *loss_inputs(seed))[1] for seed in SEEDS]
    assert sum(float(m["pg_clipfrac"]) for m in fractions) > 0
    assert sum(float(m["pg_clipfrac_lower"]) for m in fractions) > 0
