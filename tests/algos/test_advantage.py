"""Tests for rlcore.algos.advantage: hand-worked values, properties, reference agreement."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose

from rlcore.algos.advantage import ESTIMATORS, AdvantageOptions, compute_advantage, register_estimator
from rlcore.algos.masked import masked_whiten
from rlcore.registry import options_from

from . import reference_impl as ref

F64 = torch.float64
EPS = 1e-6
GROUP_ESTIMATORS = ["grpo", "grpo_passk", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg"]


def outcome_rewards(scores, lengths, response_len):
    """Put each score on the last valid token; return (rewards, mask)."""
    rewards = torch.zeros(len(scores), response_len, dtype=F64)
    mask = torch.zeros(len(scores), response_len, dtype=F64)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1.0
        rewards[i, n - 1] = s
    return rewards, mask


def run(estimator, rewards, mask, **kw):
    return compute_advantage(estimator, token_level_rewards=rewards, response_mask=mask, **kw)


def policy_stats(mask, seed=0, vocab=5):
    """``(old_log_probs, sum_pi_squared)`` ``[batch, response_len]`` of random softmax distributions over
    ``vocab`` tokens and a random sampled token at each position (what a log-prob forward returns)."""
    gen = torch.Generator().manual_seed(500 + seed)
    logits = torch.randn(*mask.shape, vocab, generator=gen, dtype=F64) * 1.5
    token = torch.randint(0, vocab, mask.shape, generator=gen)
    log_pi = torch.log_softmax(logits, -1)
    return log_pi.gather(-1, token.unsqueeze(-1)).squeeze(-1), log_pi.exp().square().sum(-1)


def run_declared(estimator, rewards, mask, *, index=None, values=None, reward_baselines=None,
                 reward_components=None, old_log_probs=None, sum_pi_squared=None, teacher_log_probs=None, **options):
    """As the trainer calls an estimator: exactly the inputs and options it declares (policy statistics drawn
    from ``policy_stats``, a teacher's from another draw of it, and the row sums as the one reward component when
    not given)."""
    entry = ESTIMATORS.get(estimator)
    if old_log_probs is None:
        old_log_probs, sum_pi_squared = policy_stats(mask)
    if teacher_log_probs is None:
        teacher_log_probs, _ = policy_stats(mask, seed=1)
    if reward_components is None:
        reward_components = rewards.sum(-1, keepdim=True)
    available = {"index": index, "values": values, "reward_baselines": reward_baselines,
                 "reward_components": reward_components, "old_log_probs": old_log_probs,
                 "sum_pi_squared": sum_pi_squared, "teacher_log_probs": teacher_log_probs}
    inputs = {k: available[k] for k in entry.inputs}
    return run(estimator, rewards, mask, **inputs, **options_from(AdvantageOptions(**options), entry.options))


# ----------------------------------------------------------------- hand-worked


def test_grpo_hand_worked_group_1_0_0():
    rewards, mask = outcome_rewards([1.0, 0.0, 0.0], [3, 2, 1], 3)
    adv, ret = run("grpo", rewards, mask, index=["q", "q", "q"])
    # mean = 1/3; unbiased var = ((2/3)^2 + 2 * (1/3)^2) / 2 = 1/3; std = sqrt(1/3)
    std = math.sqrt(1.0 / 3.0)
    hi, lo = (2.0 / 3.0) / (std + EPS), (-1.0 / 3.0) / (std + EPS)
    expected = [[hi, hi, hi], [lo, lo, 0.0], [lo, 0.0, 0.0]]
    assert_allclose(adv.numpy(), expected, atol=1e-12)
    assert_allclose(ret.numpy(), expected, atol=1e-12)
    assert abs(hi - 1.1547) < 1e-3 and abs(lo + 0.57735) < 1e-4


def test_dr_grpo_does_not_divide_by_std():
    rewards, mask = outcome_rewards([1.0, 0.0, 0.0], [2, 2, 2], 2)
    adv, _ = run("grpo", rewards, mask, index=np.array([7, 7, 7]), norm_adv_by_std_in_grpo=False)
    assert_allclose(adv[:, 0].numpy(), [2.0 / 3.0, -1.0 / 3.0, -1.0 / 3.0], atol=1e-12)


def test_rloo_hand_worked():
    rewards, mask = outcome_rewards([1.0, 0.0, 0.0, 5.0], [1, 1, 1, 1], 1)
    adv, _ = run("rloo", rewards, mask, index=["a", "a", "a", "solo"])
    # 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5; a group of one keeps its score
    assert_allclose(adv[:, 0].numpy(), [1.0, -0.5, -0.5, 5.0], atol=1e-12)


def test_opo_length_weighted_baseline():
    rewards, mask = outcome_rewards([1.0, 0.0], [2, 4], 4)
    adv, _ = run("opo", rewards, mask, index=["g", "g"])
    # baseline = (2 * 1 + 4 * 0) / (2 + 4) = 1/3
    assert_allclose(adv.numpy(), [[2 / 3, 2 / 3, 0, 0], [-1 / 3] * 4], atol=1e-12)


def test_gpg_alpha_and_group_mean():
    rewards, mask = outcome_rewards([1.0, 0.0, 1.0, 1.0], [1, 1, 1, 1], 1)
    adv, _ = run("gpg", rewards, mask, index=[0, 0, 1, 1])
    # 3 non-zero scores in a batch of 4 -> alpha = 4/3; group means 0.5 and 1
    assert_allclose(adv[:, 0].numpy(), [4 / 3 * 0.5, 4 / 3 * -0.5, 0.0, 0.0], atol=1e-12)


def test_grpo_passk_only_best_gets_gap():
    rewards, mask = outcome_rewards([1.0, 0.0, 0.5, 0.2, 0.9], [2, 2, 2, 2, 2], 2)
    index = ["a", "a", "a", "b", "b"]
    adv, _ = run("grpo_passk", rewards, mask, index=index)
    # group a: gap 1 - 0.5 = 0.5, std of [1, 0, .5] = 0.5; group b: gap 0.7, std = 0.7 / sqrt(2)
    expected_a = 0.5 / (0.5 + EPS)
    expected_b = 0.7 / (0.7 / math.sqrt(2.0) + EPS)
    assert_allclose(adv[:, 0].numpy(), [expected_a, 0.0, 0.0, 0.0, expected_b], atol=1e-9)
    raw, _ = run("grpo_passk", rewards, mask, index=index, norm_adv_by_std_in_grpo=False)
    assert_allclose(raw[:, 1].numpy(), [0.5, 0.0, 0.0, 0.0, 0.7], atol=1e-12)


def test_grpo_passk_rejects_group_of_one():
    rewards, mask = outcome_rewards([1.0, 0.0, 1.0], [1, 1, 1], 1)
    with pytest.raises(ValueError, match="at least 2"):
        run("grpo_passk", rewards, mask, index=["a", "a", "b"])


def test_remax_hand_worked():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 2.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    adv, ret = run("remax", rewards, mask, reward_baselines=torch.tensor([0.25, 1.0], dtype=F64))
    # row 1: the 9.0 sits on padding and is ignored; returns = [2.5, 2.0]
    assert_allclose(ret.numpy(), [[1, 1, 1], [2.5, 2.0, 0]], atol=1e-12)
    assert_allclose(adv.numpy(), [[0.75, 0.75, 0.75], [1.5, 1.0, 0]], atol=1e-12)


def test_reinforce_plus_plus_hand_worked():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    adv, ret = run("reinforce_plus_plus", rewards, mask, gamma=0.5)
    # returns: row0 = [0.25, 0.5, 1]; row1 = [0.5, 1] (the padded 5.0 is cut off)
    assert_allclose(ret.numpy(), [[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]], atol=1e-12)
    # valid returns mean = 3.25 / 5 = 0.65; unbiased var = 0.45 / 4 = 0.1125
    scale = 1.0 / math.sqrt(0.1125 + 1e-8)
    expected = [[-0.4 * scale, -0.15 * scale, 0.35 * scale], [-0.15 * scale, 0.35 * scale, 0.0]]
    assert_allclose(adv.numpy(), expected, atol=1e-9)


def test_gae_hand_worked_two_tokens():
    rewards = torch.tensor([[0.0, 1.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.2]], dtype=F64)
    mask = torch.ones(1, 2, dtype=F64)
    adv, ret = run("gae", rewards, mask, values=values, gamma=1.0, lam=1.0)
    # A1 = 1 + 0 - 0.2 = 0.8; A0 = (0 + 0.2 - 0.5) + 0.8 = 0.5; returns = A + V = [1, 1]
    assert_allclose(ret.numpy(), [[1.0, 1.0]], atol=1e-12)
    # whiten [0.5, 0.8]: mean 0.65, unbiased var = 2 * 0.15^2 / 1 = 0.045
    scale = 1.0 / math.sqrt(0.045 + 1e-8)
    assert_allclose(adv.numpy(), [[-0.15 * scale, 0.15 * scale]], atol=1e-9)


def test_gae_skips_masked_hole_like_removing_it():
    rewards = torch.tensor([[0.0, 7.0, 1.0]], dtype=F64)
    values = torch.tensor([[0.5, 9.0, 0.2]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0, 1.0]], dtype=F64)
    adv, ret = run("gae", rewards, mask, values=values, gamma=0.9, lam=0.8)
    # same as the two-token sequence r=[0,1], V=[.5,.2]: A1 = .8, A0 = 0.9*.2 - .5 + .72*.8 = 0.256
    assert_allclose(ret.numpy(), [[0.256 + 0.5, 0.0, 1.0]], atol=1e-12)
    d = (0.8 - 0.256) / 2
    scale = 1.0 / math.sqrt(2 * d * d + 1e-8)
    assert_allclose(adv.numpy(), [[-d * scale, 0.0, d * scale]], atol=1e-9)


# -------------------------------------------------------------------- properties


def test_grpo_zero_mean_per_group_and_group_of_one():
    rewards, mask, _, index, _ = ref.random_batch(seed=3)
    adv, _ = run("grpo", rewards, mask, index=index)
    scalar = adv[:, 0]  # every row has at least one valid token
    for key in set(index.tolist()):
        members = [i for i, k in enumerate(index.tolist()) if k == key]
        if len(members) > 1:
            assert abs(float(scalar[members].sum())) < 1e-9
    # verl convention: a group of one has mean 0 and std 1, so A = score / (1 + eps),
    # which is 0 exactly when the score is 0.
    solo = [i for i, k in enumerate(index.tolist()) if index.tolist().count(k) == 1][0]
    assert_allclose(float(scalar[solo]), float(rewards[solo].sum()) / (1 + EPS), atol=1e-12)
    zero_rewards, zero_mask = outcome_rewards([0.0, 1.0, 0.0], [2, 2, 2], 2)
    adv0, _ = run("grpo", zero_rewards, zero_mask, index=["solo", "pair", "pair"])
    assert_allclose(adv0[0].numpy(), [0.0, 0.0], atol=0)


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS.names()))
def test_masked_tokens_are_exactly_zero(estimator):
    rewards, mask, values, _, _ = ref.random_batch(seed=11, group_sizes=(3, 2, 2, 3))
    index = ["a"] * 3 + ["b"] * 2 + ["c"] * 2 + ["d"] * 3
    adv, ret = run_declared(estimator, rewards, mask, index=index, values=values, reward_baselines=rewards[:, 0],
                            gamma=0.9)
    pad = mask == 0
    assert pad.any()
    assert torch.all(adv[pad] == 0) and torch.all(ret[pad] == 0)
    assert adv.shape == rewards.shape and ret.shape == rewards.shape


@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus", "remax"])
def test_token_estimators_ignore_padding_inputs(estimator):
    rewards, mask, values, _, _ = ref.random_batch(seed=5)
    baselines = torch.linspace(-1, 1, rewards.shape[0], dtype=F64)
    before = run_declared(estimator, rewards, mask, values=values, reward_baselines=baselines, gamma=0.95, lam=0.9)
    pad = mask == 0
    after = run_declared(
        estimator, rewards.masked_fill(pad, 123.0), mask, values=values.masked_fill(pad, -77.0),
        reward_baselines=baselines, gamma=0.95, lam=0.9,
    )
    for x, y in zip(before, after):
        assert torch.equal(x, y)


def test_missing_required_inputs_name_the_argument():
    rewards, mask, _, _, _ = ref.random_batch(seed=0)
    with pytest.raises(ValueError, match="values"):
        run("gae", rewards, mask)
    with pytest.raises(ValueError, match="reward_baselines"):
        run("remax", rewards, mask)
    for estimator in GROUP_ESTIMATORS:
        with pytest.raises(ValueError, match="index"):
            run(estimator, rewards, mask)
    with pytest.raises(ValueError, match="'reward_components'"):
        run("gdpo", rewards, mask, index=["a"] * len(rewards))
    with pytest.raises(ValueError, match="'old_log_probs', 'sum_pi_squared'"):
        run("optimal_token_baseline", rewards, mask, index=["a"] * len(rewards))


def test_unknown_estimator_lists_allowed_names():
    rewards, mask, _, _, _ = ref.random_batch(seed=0)
    with pytest.raises(KeyError) as info:
        run("ppo_magic", rewards, mask)
    for name in ("gae", "grpo", "rloo", "remax"):
        assert name in str(info.value)


def test_duplicate_estimator_name_refused():
    def twin(*, token_level_rewards, response_mask, index):
        return token_level_rewards, token_level_rewards

    with pytest.raises(ValueError, match="already registered"):
        register_estimator("grpo", needs=("index",))(twin)
    assert ESTIMATORS.get("grpo").fn.__name__ == "grpo_advantage"


def test_each_estimator_declares_what_it_needs():
    needs = {name: sorted(ESTIMATORS.get(name).inputs) for name in ESTIMATORS}
    otb = ["index", "old_log_probs", "sum_pi_squared"]
    assert needs == {"gae": ["values"], "grpo": ["index"], "grpo_passk": ["index"], "rloo": ["index"],
                     "reinforce_plus_plus": [], "reinforce_plus_plus_baseline": ["index"],
                     "remax": ["reward_baselines"], "opo": ["index"], "gpg": ["index"],
                     "gdpo": ["index", "reward_components"], "optimal_token_baseline": otb,
                     "tir_optimal_token_baseline": otb, "distill": ["index", "old_log_probs", "teacher_log_probs"]}
    assert [n for n in ESTIMATORS if ESTIMATORS.get(n).needs_critic] == ["gae"]
    assert [n for n in ESTIMATORS if ESTIMATORS.get(n).needs_greedy_baseline] == ["remax"]
    assert [n for n in ESTIMATORS if ESTIMATORS.get(n).needs_sum_pi_squared] == \
        ["optimal_token_baseline", "tir_optimal_token_baseline"]
    assert [n for n in ESTIMATORS if ESTIMATORS.get(n).needs_teacher] == ["distill"]
    assert sorted(ESTIMATORS.get("distill").options) == ["distill_reward_weight", "epsilon", "norm_adv_by_std_in_grpo"]
    assert sorted(ESTIMATORS.get("gdpo").options) == ["epsilon", "gdpo_batch_norm", "norm_adv_by_std_in_grpo",
                                                      "reward_weights"]
    assert sorted(ESTIMATORS.get("gae").options) == ["gamma", "lam"]
    assert sorted(ESTIMATORS.get("grpo").options) == ["epsilon", "norm_adv_by_std_in_grpo"]


def test_a_declaration_that_disagrees_with_the_signature_is_refused():
    def needs_values(*, token_level_rewards, response_mask, values):
        return values, values

    with pytest.raises(TypeError, match="declares needs"):
        register_estimator("liar", needs=("index",))(needs_values)

    def swallows(*, token_level_rewards, response_mask, **rest):
        return token_level_rewards, token_level_rewards

    with pytest.raises(TypeError, match="kwargs"):
        register_estimator("swallower")(swallows)
    assert "liar" not in ESTIMATORS and "swallower" not in ESTIMATORS


def test_an_unexpected_keyword_is_an_error_naming_it():
    rewards, mask, values, index, _ = ref.random_batch(seed=0)
    with pytest.raises(TypeError, match="'lamda'"):
        run("gae", rewards, mask, values=values, lamda=0.9)  # misspelled lam
    with pytest.raises(TypeError, match="'gamma'"):
        run("grpo", rewards, mask, index=index, gamma=0.9)  # grpo takes no discount
    with pytest.raises(TypeError, match="'values'"):
        run("grpo", rewards, mask, index=index, values=values)


def test_all_spec_estimators_registered():
    assert set(ESTIMATORS.names()) >= {
        "gae", "grpo", "grpo_passk", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
        "remax", "opo", "gpg", "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline",
    }


def test_index_types_are_equivalent():
    rewards, mask, _, index, _ = ref.random_batch(seed=8)
    as_str, _ = run("grpo", rewards, mask, index=index)
    codes = {k: n for n, k in enumerate(dict.fromkeys(index.tolist()))}
    as_int_list, _ = run("grpo", rewards, mask, index=[codes[k] for k in index.tolist()])
    as_int_np, _ = run("grpo", rewards, mask, index=np.array([codes[k] for k in index.tolist()]))
    assert torch.equal(as_str, as_int_list) and torch.equal(as_str, as_int_np)


def test_index_length_mismatch_raises():
    rewards, mask, _, _, _ = ref.random_batch(seed=0)
    with pytest.raises(ValueError, match="index"):
        run("grpo", rewards, mask, index=["a", "b"])


# ---------------------------------------------------------- reference agreement

SEEDS = [0, 1, 2]


def _reference(estimator, rewards, mask, values, index, baselines, gamma, lam, norm):
    if estimator == "distill":
        return ref.distill(rewards, mask, index, policy_stats(mask)[0], policy_stats(mask, seed=1)[0], 0.0, norm)
    if estimator == "gdpo":
        return ref.gdpo(rewards.sum(-1, keepdim=True), mask, index, norm_by_std=norm)
    if estimator in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        return getattr(ref, estimator)(rewards, mask, index, *policy_stats(mask))
    if estimator == "gae":
        return ref.gae(rewards, values, mask, gamma, lam)
    if estimator == "grpo":
        return ref.grpo(rewards, mask, index, norm)
    if estimator == "grpo_passk":
        return ref.grpo_passk(rewards, mask, index, norm)
    if estimator == "rloo":
        return ref.rloo(rewards, mask, index)
    if estimator == "opo":
        return ref.opo(rewards, mask, index)
    if estimator == "gpg":
        return ref.gpg(rewards, mask, index)
    if estimator == "reinforce_plus_plus":
        return ref.reinforce_plus_plus(rewards, mask, gamma)
    if estimator == "reinforce_plus_plus_baseline":
        return ref.reinforce_plus_plus_baseline(rewards, mask, index)
    if estimator == "remax":
        return ref.remax(rewards, mask, baselines)
    raise AssertionError(estimator)


# norm_adv_by_std_in_grpo only affects grpo / grpo_passk / gdpo
CASES = [
    (e, n) for e in sorted(ESTIMATORS.names())
    for n in ((True, False) if e in ("grpo", "grpo_passk", "gdpo", "distill") else (True,))
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator,norm", CASES)
def test_matches_reference(estimator, seed, norm):
    sizes = (3, 2, 2, 4) if estimator == "grpo_passk" else (3, 2, 1, 4)
    rewards, mask, values, index, _ = ref.random_batch(seed=seed, group_sizes=sizes)
    baselines = rewards[:, 0] * 0.5
    gamma, lam = 0.9, 0.8
    adv, ret = run_declared(
        estimator, rewards, mask, index=index, values=values, reward_baselines=baselines,
        gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm,
    )
    exp_adv, exp_ret = _reference(estimator, rewards, mask, values, index, baselines, gamma, lam, norm)
    assert_allclose(adv.numpy(), exp_adv, atol=1e-5, rtol=1e-5)
    assert_allclose(ret.numpy(), exp_ret, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus", "remax", "gdpo", "optimal_token_baseline",
                                       "tir_optimal_token_baseline"])
def test_token_estimators_match_reference_with_observation_tokens(estimator, seed):
    """Masks with holes inside a response (tool output, observation tokens): the discounted
    estimators skip them, carrying the return across (verl's current REINFORCE++ and GAE)."""
    rewards, mask, values, index, _ = ref.random_batch(seed=seed, holes=True)
    baselines = rewards[:, 0] * 0.5
    adv, ret = run_declared(estimator, rewards, mask, index=index, values=values, reward_baselines=baselines, gamma=0.9,
                            lam=0.8)
    exp_adv, exp_ret = _reference(estimator, rewards, mask, values, index, baselines, 0.9, 0.8, True)
    assert_allclose(adv.numpy(), exp_adv, atol=1e-5, rtol=1e-5)
    assert_allclose(ret.numpy(), exp_ret, atol=1e-5, rtol=1e-5)


def test_outcome_scores_with_ties_match_reference():
    """Binary rewards produce ties in groups (passk gap 0, grpo std 0 groups)."""
    rewards, mask = outcome_rewards([1, 1, 0, 0, 0, 1, 1, 1], [3, 1, 2, 3, 3, 2, 1, 3], 3)
    index = ["a", "a", "a", "b", "b", "c", "c", "c"]
    for estimator, fn in (("grpo", ref.grpo), ("grpo_passk", ref.grpo_passk)):
        adv, _ = run(estimator, rewards, mask, index=index)
        assert_allclose(adv.numpy(), fn(rewards, mask, index)[0], atol=1e-5)
    adv, _ = run("grpo", rewards, mask, index=index)
    assert torch.all(adv[3:8] == 0)  # all-equal groups get exactly 0


def test_float32_inputs_work():
    rewards, mask, values, index, _ = ref.random_batch(seed=4, dtype=torch.float32)
    adv, ret = run("gae", rewards, mask, values=values, gamma=0.99, lam=0.95)
    assert adv.dtype == torch.float32
    exp_adv, exp_ret = ref.gae(rewards, values, mask, 0.99, 0.95)
    assert_allclose(adv.numpy(), exp_adv, atol=1e-4)
    adv, _ = run("grpo", rewards, mask.bool(), index=index)
    assert adv.dtype == torch.float32


# ------------------------------------------------------------------ gdpo


def test_gdpo_keeps_apart_what_grpo_collapses_by_hand():
    """GDPO's motivating case (its Figure 2): two binary rewards, two rollouts per prompt. Prompt p gets
    component scores (0, 0) and (1, 0), prompt q (0, 0) and (1, 1). GRPO on the sums (0, 1) and (0, 2) gives both
    groups the same advantages; GDPO credits q's better rollout twice as much."""
    components = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0]], dtype=F64)
    rewards, mask = outcome_rewards(components.sum(-1).tolist(), [1, 1, 1, 1], 1)
    index = ["p", "p", "q", "q"]
    grpo, _ = run("grpo", rewards, mask, index=index)
    assert_allclose(grpo[:2, 0].numpy(), grpo[2:, 0].numpy(), atol=1e-6)  # collapsed (up to eps in the std)
    a = 0.5 / (math.sqrt(0.5) + EPS)  # (1 - 1/2) / (unbiased std of (0, 1) + eps)
    gdpo, _ = run("gdpo", rewards, mask, index=index, reward_components=components, gdpo_batch_norm=False)
    assert_allclose(gdpo[:, 0].numpy(), [-a, a, -2 * a, 2 * a], atol=1e-12)
    # the batch whitening: mean 0, unbiased variance (a^2 + a^2 + 4a^2 + 4a^2) / 3 over the four tokens
    whitened, _ = run("gdpo", rewards, mask, index=index, reward_components=components)
    scale = 1.0 / math.sqrt(10 * a * a / 3 + 1e-8)
    assert_allclose(whitened[:, 0].numpy(), [-a * scale, a * scale, -2 * a * scale, 2 * a * scale], atol=1e-12)
    weighted, _ = run("gdpo", rewards, mask, index=index, reward_components=components, reward_weights=(1.0, 3.0),
                      gdpo_batch_norm=False)
    assert_allclose(weighted[:, 0].numpy(), [-a, a, -4 * a, 4 * a], atol=1e-12)


@pytest.mark.parametrize("norm", [True, False])
def test_gdpo_with_one_component_is_grpo_then_whitened(norm):
    """The trainer's fallback (no reward components: the sequence scores, weight 1): without the batch
    whitening GDPO is GRPO exactly; with it, GRPO's advantages whitened over the valid tokens."""
    rewards, mask, _, index, _ = ref.random_batch(seed=3, holes=True)
    grpo, _ = run("grpo", rewards, mask, index=index, norm_adv_by_std_in_grpo=norm)
    scores = rewards.sum(-1, keepdim=True)
    plain, _ = run("gdpo", rewards, mask, index=index, reward_components=scores, reward_weights=(1.0,),
                   norm_adv_by_std_in_grpo=norm, gdpo_batch_norm=False)
    assert torch.equal(plain, grpo)
    whitened, _ = run("gdpo", rewards, mask, index=index, reward_components=scores, norm_adv_by_std_in_grpo=norm)
    assert_allclose(whitened.numpy(), (masked_whiten(grpo, mask) * mask).numpy(), atol=1e-12)


def test_gdpo_refuses_mismatched_components_and_weights():
    rewards, mask, _, index, _ = ref.random_batch(seed=0)
    comps = torch.zeros(len(rewards), 2, dtype=F64)
    with pytest.raises(ValueError, match="3 reward_weights for 2 reward components"):
        run("gdpo", rewards, mask, index=index, reward_components=comps, reward_weights=(1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match=r"reward_components must be \[batch=10"):
        run("gdpo", rewards, mask, index=index, reward_components=comps[:3])


# ---------------------------------------------------------- optimal token baseline


def test_distill_by_hand():
    """The teacher's log-prob of each sampled token minus the student's, alone or with the reward's GRPO advantage
    (here a group of 2 with rewards 1, 0: +-0.7071 with the unbiased std sqrt(1/2))."""
    rewards, mask = outcome_rewards([1.0, 0.0], [2, 1], 2)
    student = torch.tensor([[-0.5, -1.0], [-2.0, 9.0]], dtype=F64)  # 9.0: past the response (masked)
    teacher = torch.tensor([[-0.25, -3.0], [-1.0, -9.0]], dtype=F64)
    kw = {"index": ["q", "q"], "old_log_probs": student, "teacher_log_probs": teacher}
    adv, ret = run("distill", rewards, mask, **kw)
    assert_allclose(adv.numpy(), [[0.25, -2.0], [1.0, 0.0]], atol=1e-12)
    assert torch.equal(adv, ret)
    mixed, _ = run("distill", rewards, mask, distill_reward_weight=0.5, **kw)
    g = 0.5 / (math.sqrt(0.5) + EPS)
    assert_allclose(mixed.numpy(), [[0.25 + 0.5 * g, -2.0 + 0.5 * g], [1.0 - 0.5 * g, 0.0]], atol=1e-12)


def test_distill_alone_ignores_the_reward():
    rewards, mask, _, index, _ = ref.random_batch(seed=3)
    student, _ = policy_stats(mask)
    teacher, _ = policy_stats(mask, seed=4)
    kw = {"index": index, "old_log_probs": student, "teacher_log_probs": teacher}
    a, _ = run("distill", rewards, mask, **kw)
    b, _ = run("distill", rewards * -7.0 + 3.0 * mask, mask, **kw)
    assert torch.equal(a, b)


def test_optimal_token_baseline_by_hand():
    """Two responses of length 2; rewards 1 and 0 on the last token. Row 0 samples tokens with pi = 0.5 from a
    distribution with sum pi^2 = 0.5 (w = 1 - 1 + 0.5 = 0.5 per token, W = 0.5, 1.0); row 1 with pi = 0.25
    (w = 1 - 0.5 + 0.5 = 1.0, W = 1, 2). B_0 = 1 * 0.5 / 1.5 = 1/3 and B_1 = 1 * 1 / 3 = 1/3 (the 1e-8 aside):
    A = 2/3 on row 0, -1/3 on row 1. Groups of one keep their returns."""
    rewards, mask = outcome_rewards([1.0, 0.0, 2.0], [2, 2, 2], 2)
    old = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.25], [0.5, 0.5]], dtype=F64))
    sum_sq = torch.full((3, 2), 0.5, dtype=F64)
    adv, ret = run("optimal_token_baseline", rewards, mask, index=["g", "g", "solo"], old_log_probs=old,
                   sum_pi_squared=sum_sq)
    assert_allclose(adv.numpy(), [[2 / 3, 2 / 3], [-1 / 3, -1 / 3], [2.0, 2.0]], atol=1e-7)
    assert_allclose(ret.numpy(), [[1, 1], [0, 0], [2, 2]], atol=0)


def test_optimal_token_baseline_zero_tail_by_hand():
    """Lengths 1 and 2: position 1 only has the longer response, whose baseline there would be its own
    return (advantage 0); the zero tail gives it baseline 0 instead (advantage = its return)."""
    rewards, mask = outcome_rewards([1.0, 3.0], [1, 2], 2)
    old = torch.log(torch.full((2, 2), 0.5, dtype=F64))
    sum_sq = torch.full((2, 2), 0.5, dtype=F64)  # w = 0.5 everywhere: B_0 = (1 * 0.5 + 3 * 0.5) / 1 = 2
    kw = dict(index=["g", "g"], old_log_probs=old, sum_pi_squared=sum_sq)
    adv, _ = run("optimal_token_baseline", rewards, mask, **kw)
    assert_allclose(adv.numpy(), [[-1.0, 0.0], [1.0, 3.0]], atol=1e-7)
    adv, _ = run("optimal_token_baseline", rewards, mask, handle_zero_tail=False, **kw)
    assert_allclose(adv.numpy(), [[-1.0, 0.0], [1.0, 0.0]], atol=1e-7)


def test_tir_optimal_token_baseline_aligns_valid_tokens_by_hand():
    """Row 0 = [valid, observation, valid], row 1 = [valid, valid, pad]; reward 1 on row 0's last valid token,
    0 on row 1; w = 0.5 everywhere. By position, position 2 holds only row 0 (zero tail: baseline 0) and position 1
    only row 1; by valid token, both rows have tokens 0 and 1 and share B_k = 1 * W / (2 W) = 1/2."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
    kw = dict(index=["g", "g"], old_log_probs=torch.log(torch.full((2, 3), 0.5, dtype=F64)),
              sum_pi_squared=torch.full((2, 3), 0.5, dtype=F64))
    tir, ret = run("tir_optimal_token_baseline", rewards, mask, **kw)
    assert_allclose(tir.numpy(), [[0.5, 0.0, 0.5], [-0.5, -0.5, 0.0]], atol=1e-7)
    assert_allclose(ret.numpy(), [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]], atol=0)
    by_position, _ = run("optimal_token_baseline", rewards, mask, **kw)  # equal lengths (2, 2): no zero tail
    assert_allclose(by_position.numpy(), [[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]], atol=1e-7)


def test_tir_optimal_token_baseline_leaves_empty_rows_out_of_their_group():
    """A group of a response and an empty row: the response is alone (baseline 0, advantage = its return) in
    the multi-turn form; the positional form counts the empty row, which contributes no weight, so the response
    is its own baseline (advantage 0)."""
    rewards, mask = outcome_rewards([2.0, 0.0], [2, 1], 2)
    mask[1] = 0.0
    kw = dict(index=["g", "g"], old_log_probs=torch.log(torch.full((2, 2), 0.5, dtype=F64)),
              sum_pi_squared=torch.full((2, 2), 0.5, dtype=F64))
    tir, _ = run("tir_optimal_token_baseline", rewards, mask, handle_zero_tail=False, **kw)
    assert_allclose(tir.numpy(), [[2.0, 2.0], [0.0, 0.0]], atol=1e-7)
    positional, _ = run("optimal_token_baseline", rewards, mask, handle_zero_tail=False, **kw)
    assert_allclose(positional.numpy(), [[0.0, 0.0], [0.0, 0.0]], atol=1e-6)


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baseline_with_equal_weights_is_the_group_mean_return(estimator):
    """Property: with the same realised energy on every token of every response (here pi = 0.5, sum pi^2 =
    0.5) and equal lengths, B_t is the group's mean reward-to-go at t, so the advantages of a group sum to 0 at
    every position."""
    gen = torch.Generator().manual_seed(9)
    rewards = torch.randn(6, 4, generator=gen, dtype=F64)
    mask = torch.ones(6, 4, dtype=F64)
    index = ["a"] * 3 + ["b"] * 3
    adv, ret = run(estimator, rewards, mask, index=index, old_log_probs=torch.log(torch.full((6, 4), 0.5, dtype=F64)),
                   sum_pi_squared=torch.full((6, 4), 0.5, dtype=F64))
    for rows in (slice(0, 3), slice(3, 6)):
        assert_allclose(adv[rows].sum(0).numpy(), 0.0, atol=1e-7)
        assert_allclose((ret[rows] - adv[rows]).numpy(), ret[rows].mean(0, keepdim=True).expand(3, 4).numpy(),
                        atol=1e-7)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", ["gdpo", "optimal_token_baseline", "tir_optimal_token_baseline"])
def test_new_estimators_match_reference_with_empty_rows_and_components(estimator, seed):
    """Holes, a group of one, and two rows without a valid token (one in a group of two, whose other row is then
    alone in the multi-turn form); gdpo with three weighted reward components."""
    rewards, mask, _, index, _ = ref.random_batch(seed=seed, group_sizes=(3, 2, 1, 4), holes=True)
    mask[4] = 0.0  # the second row of the pair
    mask[7] = 0.0  # a row of the group of four
    stats = policy_stats(mask, seed)
    if estimator == "gdpo":
        comps = torch.randn(len(rewards), 3, generator=torch.Generator().manual_seed(seed), dtype=F64)
        adv, ret = run("gdpo", rewards, mask, index=index, reward_components=comps, reward_weights=(1.0, 0.5, 2.0))
        exp_adv, exp_ret = ref.gdpo(comps, mask, index, weights=[1.0, 0.5, 2.0])
    else:
        adv, ret = run(estimator, rewards, mask, index=index, old_log_probs=stats[0], sum_pi_squared=stats[1])
        exp_adv, exp_ret = getattr(ref, estimator)(rewards, mask, index, *stats)
    assert_allclose(adv.numpy(), exp_adv, atol=1e-9, rtol=1e-9)
    assert_allclose(ret.numpy(), exp_ret, atol=1e-9, rtol=1e-9)
    assert torch.all(adv[4] == 0) and torch.all(adv[7] == 0)
