"""Tests for rlcore.algos.losses: hand-worked values, properties, reference agreement."""

from __future__ import annotations

import math
import re

import pytest
import torch
from numpy.testing import assert_allclose

from rlcore.algos import losses
from rlcore.algos.aggregation import LOSS_AGG_MODES, AggScale, agg_loss
from rlcore.algos.entropy import entropy_from_logits
from rlcore.algos.kl import KL_ESTIMATORS, kl_penalty
from rlcore.algos.losses import POLICY_LOSSES, policy_loss, register_policy_loss
from rlcore.algos.masked import masked_mean, masked_var, masked_whiten
from rlcore.algos.value_loss import value_loss
from rlcore.config import PolicyLossConfig
from rlcore.registry import options_from

from . import reference_impl as ref

F64 = torch.float64
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "bnpo"]


NEW_LOSSES = ("dppo_tv", "dppo_kl", "sapo", "dro", "luspo", "vespo", "bypass_mode")


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
    """As a worker calls a loss: params.yaml's ``actor.loss`` section, its nulls resolved for these responses, of
    which the loss takes the options it declares."""
    options = options_from(PolicyLossConfig(**settings).resolved(mask.shape[-1]), POLICY_LOSSES.get(mode).options)
    return call(mode, old, new, adv, mask, **options)


def test_every_loss_option_is_a_key_of_actor_loss_and_every_key_is_read():
    """params.yaml's ``actor.loss`` declares each loss option once: every keyword a registered loss takes as a setting
    is one of its keys, and each of its keys but the loss's name and ``clip_ratio`` (the default of both clip
    bounds, filled in by ``resolved``) is read by some loss."""
    keys = set(PolicyLossConfig.model_fields)
    read = set().union(*(POLICY_LOSSES.get(name).options for name in POLICY_LOSSES.names()))
    assert read <= keys, sorted(read - keys)
    assert keys - read == {"name", "clip_ratio"}


def test_resolved_fills_the_clip_bounds_and_the_divisor_and_keeps_what_is_set():
    loss = PolicyLossConfig(clip_ratio=0.3, clip_ratio_high=0.4).resolved(response_length=12)
    assert (loss.clip_ratio_low, loss.clip_ratio_high, loss.loss_scale_factor) == (0.3, 0.4, 12.0)
    assert PolicyLossConfig(loss_scale_factor=5.0).resolved(12).loss_scale_factor == 5.0


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


def test_a_loss_must_take_its_inputs_first_and_positional_only():
    """Its keywords are its options (read from ``actor.loss``): the inputs must not be one of them."""
    with pytest.raises(TypeError, match="positional-only"):
        register_policy_loss("inputs_by_keyword")(lambda *, inputs, clip_ratio_low=0.2: None)
    assert "inputs_by_keyword" not in POLICY_LOSSES


def test_the_module_docstring_counts_and_names_every_registered_loss():
    """The module docstring is where a reader finds the list of losses (it once said 16 with 14 registered)."""
    intro = losses.__doc__.split("\n\n")[0]
    assert f"the {len(POLICY_LOSSES)} ways" in intro
    assert set(re.findall(r"``(\w+)``", intro)) - {"POLICY_LOSSES"} == set(POLICY_LOSSES.names())


def test_all_spec_names_registered():
    assert set(POLICY_LOSSES.names()) >= {"vanilla", "gspo", "geo_mean", "gpg", "cispo", "clip_cov", "kl_cov",
                                          "dppo_tv", "dppo_kl", "sapo", "dro", "luspo", "vespo", "bypass_mode"}
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


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "geo_mean", "cispo", "dppo_tv", "dppo_kl", "sapo", "dro", "luspo",
                                  "vespo", "bypass_mode"])
def test_policy_loss_gradient_is_the_same_in_micro_batches(mode):
    """The gradient of a loss over the whole batch equals the summed gradients of its micro-batches
    computed with the global normalisers, also for gspo and geo_mean whose own aggregation is a
    sequence mean while the configured mode is token-mean."""
    old, new, adv, mask = loss_inputs(seed=6, group_sizes=(3, 3))
    adv = adv[:, :1].expand_as(adv).clone()
    new = new.clamp(max=-1e-3)
    whole = new.clone().requires_grad_(True)
    call_with(mode, old, whole, adv, mask)[0].backward()
    parts = new.clone().requires_grad_(True)
    scale = AggScale(tokens=float(mask.sum()), rows=6.0, dp_size=1)
    for a, b in ((0, 2), (2, 6)):
        options = options_from(PolicyLossConfig().resolved(mask.shape[-1]), POLICY_LOSSES.get(mode).options)
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
    if mode in ("dppo_tv", "dppo_kl"):
        return ref.dppo(old, new, adv, mask, agg, low, high, c, mode[-2:], lsf)
    if mode == "sapo":
        return ref.sapo(old, new, adv, mask, 1.0, 1.05), {}
    if mode == "dro":
        return ref.dro(old, new, adv, mask, agg, 0.05, lsf), {}
    if mode == "luspo":
        return ref.luspo(old, new, adv, mask, low, high), {}
    if mode == "vespo":
        return ref.vespo(old, new, adv, mask, agg, 2.0, 3.0, 3.0, 2.0, lsf), {}
    if mode == "bypass_mode":  # defaults: ppo_clip, sequence weights truncated at 2 (reported only), no rejection
        return ref.bypass(old, new, adv, mask, agg, "ppo_clip", "sequence", 2.0, None, None, 2.0, None, low, high, c,
                          lsf)
    raise AssertionError(mode)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode", sorted(POLICY_LOSSES.names()))
def test_policy_losses_match_reference(mode, agg, seed):
    old, new, adv, mask = loss_inputs(seed)
    if mode in ("gspo", "geo_mean", "luspo"):  # sequence-level advantages, as these methods assume
        adv = adv[:, :1].expand_as(adv).clone()
    if mode in NEW_LOSSES:  # log-probs: the random ones may exceed 0, and the binary KL needs p < 1
        new = new.clamp(max=-1e-3)
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


def test_reference_inputs_exercise_the_new_losses_branches():
    """Guard: on the reference inputs DPPO's trust region leaves tokens out and truncates ratios inside it,
    and VESPO's weights are far from 1 (the sequences' ratios are)."""
    for mode in ("dppo_tv", "dppo_kl"):
        truncated = 0.0
        for seed in SEEDS:
            old, new, adv, mask = loss_inputs(seed)
            _, m = call(mode, old, new.clamp(max=-1e-3), adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
            assert 0 < float(m["pg_clipfrac"]) < 0.9
            truncated += float(m["pg_clipfrac_lower"])
        assert truncated > 0
    old, new, adv, mask = loss_inputs(0)
    seq = ((new - old) * mask).sum(-1).exp()
    assert seq.min() < 0.3 and seq.max() > 2.5


# ------------------------------------------------------------------ new losses by hand


def test_dppo_tv_trust_region_by_hand():
    """p_old = 0.5 everywhere. Token 0 rises to 0.7 (+0.2 > 0.15) with A > 0: outside; token 1 rises to 0.6 with
    A > 0: inside, l = -A min(1.2, c) logp; token 2 falls to 0.3 (-0.2 < -0.15) with A < 0: outside; token 3
    rises to 0.7 with A < 0: inside (only falls are bounded for A < 0)."""
    old = torch.log(t([[0.5, 0.5, 0.5, 0.5]]))
    new = torch.log(t([[0.7, 0.6, 0.3, 0.7]])).requires_grad_(True)
    adv, mask = t([[1.0, 2.0, -1.0, -3.0]]), t([[1, 1, 1, 1]])
    loss, m = call("dppo_tv", old, new, adv, mask, clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=1.3)
    expected = (-2.0 * 1.2 * math.log(0.6) + 3.0 * 1.3 * math.log(0.7)) / 4  # token 3's ratio 1.4 truncated at 1.3
    assert_allclose(loss.item(), expected, rtol=1e-12)
    assert_allclose(float(m["pg_clipfrac"]), 0.5) and assert_allclose(float(m["pg_clipfrac_lower"]), 0.25)
    loss.backward()  # d/dlogp: -A w [inside] / N, with w = min(r, c) held constant
    assert_allclose(new.grad.numpy(), [[0.0, -2.0 * 1.2 / 4, 0.0, 3.0 * 1.3 / 4]], rtol=1e-12)


def test_dppo_kl_bounds_only_the_pushed_direction_by_hand():
    """p_old = 0.5 -> p = 0.9: binary KL = 0.5 log(0.5/0.9) + 0.5 log(0.5/0.1) = 0.5108 > 0.3. With A > 0 the
    token is outside (its probability rose too far); with A < 0 it is inside (a rise is not what A < 0 pushes)."""
    old, new = torch.log(t([[0.5, 0.5]])), torch.log(t([[0.9, 0.9]]))
    kl = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log((0.5 + 1e-8) / (0.1 + 1e-8))
    assert kl > 0.3
    _, m = call("dppo_kl", old, new, t([[1.0, -1.0]]), t([[1, 1]]), clip_ratio_low=0.3, clip_ratio_high=0.3,
                clip_ratio_c=10.0)
    assert_allclose(float(m["pg_clipfrac"]), 0.5)
    _, m = call("dppo_kl", old, new, t([[1.0, -1.0]]), t([[1, 1]]), clip_ratio_low=0.6, clip_ratio_high=0.6,
                clip_ratio_c=10.0)
    assert float(m["pg_clipfrac"]) == 0.0


def test_sapo_gate_by_hand_and_its_on_policy_gradient_is_ppo():
    """On policy (r = 1) the gate is 2 / tau and its slope 1: the gradient is the policy gradient -A / N, as
    PPO's; at r = 2 with tau = 1 the gate is 4 sigmoid(1) and its slope 4 sigmoid'(1), a decayed gradient."""
    old = t([[-1.0, -1.0, -1.0]])
    new = old.clone().requires_grad_(True)
    adv, mask = t([[1.0, -2.0, 0.5]]), t([[1, 1, 1]])
    loss, _ = call("sapo", old, new, adv, mask, sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    assert_allclose(loss.item(), -(1.0 * 2 / 1.0 - 2.0 * 2 / 2.0 + 0.5 * 2 / 1.0) / 3, rtol=1e-12)
    loss.backward()
    assert_allclose(new.grad.numpy(), -adv.numpy() / 3, rtol=1e-12)
    far = (old + math.log(2.0)).requires_grad_(True)
    loss, _ = call("sapo", old, far, t([[1.0, 0.0, 0.0]]), t([[1, 0, 0]]), sapo_tau_pos=1.0)
    sig = 1 / (1 + math.exp(-1.0))
    assert_allclose(loss.item(), -4 * sig, rtol=1e-12)
    loss.backward()
    assert_allclose(far.grad[0, 0].item(), -4 * sig * (1 - sig) * 2.0, rtol=1e-12)  # dr/dlogp = r = 2


def test_dro_penalty_by_hand():
    old = t([[-1.0, -0.7, -0.2]])
    new = t([[-0.8, -0.9, -0.1]]).requires_grad_(True)
    adv, mask = t([[2.0, -1.5, 9.0]]), t([[1, 1, 0]])
    loss, _ = call("dro", old, new, adv, mask, dro_beta=0.5)
    expected = (-(-0.8 * 2.0 - 0.25 * 0.04) - (-0.9 * -1.5 - 0.25 * 0.04)) / 2
    assert_allclose(loss.item(), expected, rtol=1e-12)
    loss.backward()  # -(A - beta (logp - logp_old)) / N
    assert_allclose(new.grad.numpy(), [[-(2.0 - 0.5 * 0.2) / 2, -(-1.5 + 0.5 * 0.2) / 2, 0.0]], rtol=1e-12)
    with pytest.raises(ValueError, match="dro_beta must be > 0"):
        call("dro", old, new, adv, mask, dro_beta=0.0)


def test_luspo_is_gspo_weighted_by_length():
    """For one sequence GSPO is its token mean and LUSPO its token sum: LUSPO = L * GSPO; over a batch LUSPO
    is the mean over rows of those sums (an empty row counts as a row with nothing to add)."""
    old, new, adv, mask = loss_inputs(seed=5, group_sizes=(2, 2))
    adv = adv[:, :1].expand_as(adv).clone()
    for i in range(len(mask)):
        row = slice(i, i + 1)
        gspo, _ = call("gspo", old[row], new[row], adv[row], mask[row])
        luspo, _ = call("luspo", old[row], new[row], adv[row], mask[row])
        assert_allclose(luspo.item(), mask[i].sum().item() * gspo.item(), rtol=1e-12)
    mask[1] = 0.0
    whole, _ = call("luspo", old, new, adv, mask)
    rows = [call("luspo", old[i:i + 1], new[i:i + 1], adv[i:i + 1], mask[i:i + 1])[0].item() for i in range(4)]
    assert_allclose(whole.item(), sum(rows) / 4, rtol=1e-12)


def test_vespo_weight_by_hand():
    """One sequence of two tokens with log-ratios 0.1 and 0.2: w = e^0.3; with A >= 0, phi = e^3 w^2 e^(-3w);
    with A < 0, phi = e^2 w^3 e^(-2w). On policy (w = 1) phi = 1 and VESPO is the plain policy gradient (gpg)."""
    old = t([[-1.0, -2.0]])
    new = (old + t([[0.1, 0.2]])).requires_grad_(True)
    mask = t([[1, 1]])
    w = math.exp(0.3)
    for a, k, lam in ((1.5, 2.0, 3.0), (-1.5, 3.0, 2.0)):
        loss, _ = call("vespo", old, new, t([[a, a]]), mask)
        phi = math.exp(lam) * w ** k * math.exp(-lam * w)
        assert_allclose(loss.item(), -phi * a * (new[0, 0].item() + new[0, 1].item()) / 2, rtol=1e-12)
    on_policy = old.clone().requires_grad_(True)
    adv = t([[0.7, -0.4]])
    vespo, _ = call("vespo", old, on_policy, adv, mask)
    vespo.backward()
    plain = old.clone().requires_grad_(True)
    gpg, _ = call("gpg", old, plain, adv, mask)
    gpg.backward()
    assert_allclose(vespo.item(), gpg.item(), rtol=1e-12)
    assert_allclose(on_policy.grad.numpy(), plain.grad.numpy(), rtol=1e-12)


def test_bypass_mode_by_hand():
    """Rollout log-probs old, current new = old + (0.5, -0.1, 0.0) on one row. Token weights: e^0.5 = 1.65,
    e^-0.1, 1; truncated at 1.5: (1.5, e^-0.1, 1). REINFORCE: l = -w A logp. A token_k1 rejection with ratio band
    [1/1.2, 1.2] rejects the first token (ratio 1.65), whose loss is then 0 (it stays in the token count)."""
    old = t([[-1.0, -2.0, -0.5]])
    new = (old + t([[0.5, -0.1, 0.0]])).requires_grad_(True)
    adv, mask = t([[1.0, 2.0, -1.0]]), t([[1, 1, 1]])
    w = [1.5, math.exp(-0.1), 1.0]
    kw = dict(bypass_loss_type="reinforce", bypass_is="token", bypass_is_threshold=1.5)
    loss, m = call("bypass_mode", old, new, adv, mask, **kw)
    logp = new.detach()[0].tolist()
    assert_allclose(loss.item(), -sum(wi * a * lp for wi, a, lp in zip(w, [1.0, 2.0, -1.0], logp)) / 3, rtol=1e-12)
    assert_allclose(float(m["is_weight_mean"]), sum(w) / 3, rtol=1e-12)
    loss, m = call("bypass_mode", old, new, adv, mask, bypass_rs="token_k1", bypass_rs_threshold=1.2, **kw)
    assert_allclose(loss.item(), -sum(wi * a * lp for wi, a, lp in zip(w[1:], [2.0, -1.0], logp[1:])) / 3,
                    rtol=1e-12)
    assert_allclose(float(m["rejected_frac"]), 1 / 3)
    # sequence weights: exp(0.4) for every token, under the threshold 2
    loss, m = call("bypass_mode", old, new, adv, mask, bypass_loss_type="reinforce", bypass_is="sequence")
    assert_allclose(float(m["is_weight_mean"]), math.exp(0.4), rtol=1e-12)
    # ppo_clip with no rejection is vanilla PPO against the rollout policy
    clip, _ = call("bypass_mode", old, new, adv, mask)
    vanilla, _ = call("vanilla", old, new, adv, mask)
    assert clip.item() == vanilla.item()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
@pytest.mark.parametrize("is_level,is_low", [("token", None), ("sequence", None), ("token", 0.7), ("none", None)])
@pytest.mark.parametrize("rs,rs_upper,rs_low", [(None, 2.0, None), ("token_k1", 1.5, None), ("seq_mean_k1", 1.3, 0.9),
                                                ("token_k2", 0.05, None), ("seq_sum_k3", 0.15, None),
                                                ("seq_max_k2", 0.1, None), ("seq_mean_k3", 0.02, None)])
def test_bypass_mode_matches_reference(seed, loss_type, is_level, is_low, rs, rs_upper, rs_low):
    old, new, adv, mask = loss_inputs(seed)
    new = old + (new - old) * 0.5  # ratios near 1, so the bands keep some tokens and reject others
    loss, m = call_with("bypass_mode", old, new, adv, mask, bypass_loss_type=loss_type, bypass_is=is_level,
                        bypass_is_threshold=1.6, bypass_is_threshold_low=is_low, bypass_rs=rs,
                        bypass_rs_threshold=rs_upper, bypass_rs_threshold_low=rs_low)
    exp_loss, exp_m = ref.bypass(old, new, adv, mask, "token-mean", loss_type, is_level, 1.6, is_low, rs, rs_upper,
                                 rs_low, 0.2, 0.2, 3.0)
    assert_allclose(loss.item(), exp_loss, atol=1e-9, rtol=1e-9)
    for key, value in exp_m.items():
        assert_allclose(float(m[key]), value, atol=1e-9, rtol=1e-9)
    if rs is not None:
        assert 0 < float(m["rejected_frac"]) < 1, "the rejection test should keep some tokens and reject others"


def test_sum_pi_squared_by_hand_and_stable():
    """Uniform over 4 tokens: 4 * (1/4)^2 = 1/4; logits (log 3, 0) give p = (3/4, 1/4): 9/16 + 1/16 = 5/8; a logit
    of 1e4 beside 0s gives 1 without overflow."""
    from rlcore.algos.entropy import sum_pi_squared_from_logits

    logits = t([[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, -math.inf, -math.inf], [1e4, 0.0, 0.0, 0.0]])
    assert_allclose(sum_pi_squared_from_logits(logits).numpy(), [0.25, 0.625, 1.0], rtol=1e-12)
