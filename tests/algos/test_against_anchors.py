"""rlcore's estimators and losses against the anchors' own functions, on random inputs.

The anchors' code is loaded from trimmed copies kept as test fixtures (``tests/algos/anchors/``; each file's
header names its repository, commit and licence): verl for gdpo, optimal_token_baseline,
tir_optimal_token_baseline, dppo_tv, dppo_kl, sapo, dro and bypass_mode; TRL's GRPOTrainer for bnpo, luspo and
vespo. Inputs are float64 with right padding, holes inside responses (observation tokens), groups of one and rows
without a valid token; values and gradients must agree to 1e-5. Where rlcore differs on purpose (a rejected
token stays in the loss normaliser, returns are 0 on masked tokens), the test says so and compares what the
difference leaves equal.
"""

from __future__ import annotations

import pytest
import torch
from numpy.testing import assert_allclose

from rlcore.algos.advantage import compute_advantage
from rlcore.algos.losses import POLICY_LOSSES, policy_loss
from rlcore.algos.off_policy import importance_weights

from . import reference_impl as ref
from .anchors import trl_grpo_loss as trl
from .anchors import verl_core_algos as verl

F64 = torch.float64
TOL = dict(atol=1e-5, rtol=1e-5)
SEEDS = [0, 1, 2, 3]
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def batch(seed: int, holes: bool = True):
    """rewards, mask, index: groups of 3, 2, 1 and 4 rows, holes in the responses, and two rows without a valid
    token (row 4, the second of the pair; row 7, in the group of four)."""
    rewards, mask, _, index, _ = ref.random_batch(seed=seed, group_sizes=(3, 2, 1, 4), holes=holes)
    mask[4] = 0.0
    mask[7] = 0.0
    return rewards, mask, index


def policy_stats(mask: torch.Tensor, seed: int, vocab: int = 6):
    """Log-prob of a sampled token and sum of squared probabilities of random softmax distributions."""
    gen = torch.Generator().manual_seed(77 + seed)
    log_pi = torch.log_softmax(torch.randn(*mask.shape, vocab, generator=gen, dtype=F64) * 2.0, -1)
    token = torch.randint(0, vocab, mask.shape, generator=gen)
    return log_pi.gather(-1, token.unsqueeze(-1)).squeeze(-1), log_pi.exp().square().sum(-1)


def loss_inputs(seed: int):
    """old and current log-probs (< 0), token advantages, and the mask of :func:`batch`."""
    _, mask, _ = batch(seed)
    gen = torch.Generator().manual_seed(300 + seed)
    old = -torch.rand(mask.shape, generator=gen, dtype=F64) * 2.5 - 0.05
    new = (old + torch.randn(mask.shape, generator=gen, dtype=F64) * 0.4).clamp(max=-1e-4)
    adv = torch.randn(mask.shape, generator=gen, dtype=F64)
    return old, new, adv, mask


# ------------------------------------------------------------------------ estimators (verl)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_gdpo_matches_verl(seed, norm):
    """verl reads each component from the non-tensor batch (``algorithm.gdpo_reward_keys``) and places it on
    the last response token; rlcore takes them as one ``[batch, n_components]`` tensor."""
    rewards, mask, index = batch(seed)
    gen = torch.Generator().manual_seed(seed)
    comps = (torch.rand(len(mask), 3, generator=gen, dtype=F64) < 0.5).to(F64) + 0.1 * torch.randn(
        len(mask), 3, generator=gen, dtype=F64)
    weights = [1.0, 0.5, 2.0]
    config = verl.AlgoConfig(gdpo_reward_keys=["fmt", "acc", "len"], gdpo_reward_weights=weights)
    non_tensor = {key: comps[:, k].numpy() for k, key in enumerate(["fmt", "acc", "len"])}
    prompts = torch.zeros(len(mask), 4)
    tensors = {"prompts": prompts, "attention_mask": torch.cat([torch.ones(len(mask), 4), mask], dim=1).long()}
    expected, _ = verl.compute_gdpo_outcome_advantage(
        token_level_rewards=rewards.clone(), response_mask=mask, index=index, norm_adv_by_std_in_grpo=norm,
        config=config, non_tensor_batch=non_tensor, batch=tensors)
    adv, ret = compute_advantage("gdpo", token_level_rewards=rewards, response_mask=mask, index=index,
                                 reward_components=comps, reward_weights=tuple(weights), norm_adv_by_std_in_grpo=norm)
    assert_allclose(adv.numpy(), expected.numpy(), **TOL)
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_gdpo_without_components_matches_verl(seed):
    """Without components verl normalises the token-level rewards' sum: the trainer's fallback
    (``token_level_rewards.sum(-1)`` as the one component)."""
    rewards, mask, index = batch(seed)
    expected, _ = verl.compute_gdpo_outcome_advantage(token_level_rewards=rewards.clone(), response_mask=mask,
                                                      index=index)
    adv, _ = compute_advantage("gdpo", token_level_rewards=rewards, response_mask=mask, index=index,
                               reward_components=rewards.sum(-1, keepdim=True))
    assert_allclose(adv.numpy(), expected.numpy(), **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("name,anchor", [
    ("optimal_token_baseline", verl.compute_optimal_token_baseline_advantage),
    ("tir_optimal_token_baseline", verl.compute_multi_turn_optimal_token_baseline_advantage)])
def test_optimal_token_baselines_match_verl(name, anchor, zero_tail, seed):
    """Advantages everywhere; returns on the valid tokens (verl leaves the reward-to-go at masked positions
    inside a response, rlcore's estimators return 0 on every masked token)."""
    rewards, mask, index = batch(seed)
    old, sum_sq = policy_stats(mask, seed)
    exp_adv, exp_ret = anchor(token_level_rewards=rewards, response_mask=mask, index=index, old_log_probs=old,
                              sum_pi_squared=sum_sq, handle_zero_tail=zero_tail)
    adv, ret = compute_advantage(name, token_level_rewards=rewards, response_mask=mask, index=index,
                                 old_log_probs=old, sum_pi_squared=sum_sq, handle_zero_tail=zero_tail)
    assert_allclose(adv.numpy(), exp_adv.numpy(), **TOL)
    assert_allclose(ret.numpy(), (exp_ret * mask).numpy(), **TOL)


def test_the_anchor_inputs_exercise_the_zero_tail_and_empty_rows():
    """Guard: the zero tail changes some advantages on these inputs, and the multi-turn form differs from the
    positional one (holes and the empty row of a pair)."""
    rewards, mask, index = batch(0)
    old, sum_sq = policy_stats(mask, 0)
    kw = dict(token_level_rewards=rewards, response_mask=mask, index=index, old_log_probs=old, sum_pi_squared=sum_sq)
    with_tail, _ = compute_advantage("optimal_token_baseline", **kw)
    without, _ = compute_advantage("optimal_token_baseline", handle_zero_tail=False, **kw)
    tir, _ = compute_advantage("tir_optimal_token_baseline", **kw)
    assert not torch.allclose(with_tail, without) and not torch.allclose(with_tail, tir)


# ------------------------------------------------------------------------------ losses (verl)


def verl_actor_config(**policy_loss):
    return verl.ActorConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0,
                            tau_neg=1.05, global_batch_info={}, policy_loss=verl.PolicyLossConfig(**policy_loss))


def both(anchor_fn, rl_mode, old, new, adv, mask, agg, *, rl_options, anchor_kwargs=None):
    """(rlcore loss, anchor loss, rlcore grad, anchor grad, rlcore metrics, anchor metrics)."""
    a = new.clone().requires_grad_(True)
    if "loss_agg_mode" in POLICY_LOSSES.get(rl_mode).options:  # sapo fixes its own
        rl_options = {**rl_options, "loss_agg_mode": agg}
    loss, metrics = policy_loss(rl_mode, old_log_prob=old, log_prob=a, advantages=adv, response_mask=mask,
                                **rl_options)
    loss.backward()
    b = new.clone().requires_grad_(True)
    exp_loss, exp_metrics = anchor_fn(old, b, adv, mask, agg, **(anchor_kwargs or {}))
    exp_loss.backward()
    return loss, exp_loss, a.grad, b.grad, metrics, exp_metrics


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
def test_dppo_matches_verl(mode, agg, seed):
    old, new, adv, mask = loss_inputs(seed)
    anchor = verl.compute_policy_loss_dppo_tv if mode == "dppo_tv" else verl.compute_policy_loss_dppo_kl
    loss, exp, grad, exp_grad, m, exp_m = both(
        anchor, mode, old, new, adv, mask, agg, anchor_kwargs={"config": verl_actor_config()},
        rl_options=dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0))
    assert_allclose(loss.item(), exp.item(), **TOL)
    assert_allclose(grad.numpy(), exp_grad.numpy(), **TOL)
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        assert_allclose(float(m[key]), exp_m[f"actor/{key}"], **TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_sapo_matches_verl(seed):
    """SAPO's aggregation is fixed (seq-mean-token-mean) in both."""
    old, new, adv, mask = loss_inputs(seed)
    new = old + (new - old) * 3  # ratios far enough from 1 for the gates to differ from the policy gradient
    loss, exp, grad, exp_grad, m, exp_m = both(
        verl.compute_policy_loss_sapo, "sapo", old, new, adv, mask, "token-mean",
        anchor_kwargs={"config": verl_actor_config()}, rl_options=dict(sapo_tau_pos=1.0, sapo_tau_neg=1.05))
    assert_allclose(loss.item(), exp.item(), **TOL)
    assert_allclose(grad.numpy(), exp_grad.numpy(), **TOL)
    assert_allclose(float(m["ppo_kl"]), exp_m["actor/ppo_kl"], **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_dro_matches_verl(agg, seed):
    old, new, adv, mask = loss_inputs(seed)
    loss, exp, grad, exp_grad, m, exp_m = both(
        verl.compute_policy_loss_dro, "dro", old, new, adv, mask, agg,
        anchor_kwargs={"config": verl_actor_config(dro_beta=0.3)}, rl_options=dict(dro_beta=0.3))
    assert_allclose(loss.item(), exp.item(), **TOL)
    assert_allclose(grad.numpy(), exp_grad.numpy(), **TOL)
    assert_allclose(float(m["ppo_kl"]), exp_m["actor/ppo_kl"], **TOL)


BYPASS_CASES = [  # loss type, IS level, IS threshold (verl's spec), rejection option, its threshold (verl's spec)
    ("ppo_clip", None, 2.0, None, None),
    ("ppo_clip", "sequence", 2.0, None, None),
    ("reinforce", "token", 1.5, None, None),
    ("reinforce", "sequence", 3.0, None, None),
    ("reinforce", "token", "0.8_1.3", None, None),
    ("reinforce", "token", 2.0, "token_k1", "0.8_1.25"),
    ("reinforce", "sequence", 2.0, "seq_mean_k3", 0.02),
    ("ppo_clip", None, 2.0, "seq_sum_k1", 1.5),
    ("ppo_clip", "token", 2.0, "seq_max_k2", 0.08),
    ("reinforce", None, 2.0, "token_k2", 0.03),
]


def _spec(threshold):
    """verl's threshold spec (a float, or "lower_upper") as rlcore's (upper, lower)."""
    if isinstance(threshold, str):
        low, high = threshold.split("_")
        return float(high), float(low)
    return threshold, None


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("loss_type,is_level,is_threshold,rs,rs_threshold", BYPASS_CASES)
def test_bypass_mode_matches_verl(loss_type, is_level, is_threshold, rs, rs_threshold, agg, seed):
    """Without rejection the losses and gradients are verl's. With it, verl drops rejected tokens from the loss
    and from its normaliser, rlcore zeroes their loss and keeps them in the normaliser (its off-policy
    convention, so micro-batches add up with the global counts): under token-sum the two agree, under token-mean
    rlcore's loss is verl's times (kept tokens / valid tokens), and for the sequence means (whose normalisers
    count rows) the test checks the per-token gradient direction through token-sum instead."""
    old, new, adv, mask = loss_inputs(seed)
    new = old + (new - old) * 0.5
    correction = verl._Bag(loss_type=loss_type, rollout_is=is_level, rollout_is_threshold=is_threshold,
                           rollout_is_batch_normalize=False, rollout_rs=rs, rollout_rs_threshold=rs_threshold)
    config = verl_actor_config(rollout_correction=correction)
    is_upper, is_lower = _spec(is_threshold)
    rs_upper, rs_lower = _spec(rs_threshold) if rs is not None else (2.0, None)
    options = dict(bypass_loss_type=loss_type, bypass_is=is_level or "none", bypass_is_threshold=is_upper,
                   bypass_is_threshold_low=is_lower, bypass_rs=rs, bypass_rs_threshold=rs_upper,
                   bypass_rs_threshold_low=rs_lower, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    if rs is not None and agg == "seq-mean-token-mean":
        agg = "token-sum"
    loss, exp, grad, exp_grad, m, _ = both(verl.compute_policy_loss_bypass_mode, "bypass_mode", old, new, adv, mask,
                                           agg, anchor_kwargs={"config": config}, rl_options=options)
    factor = 1.0
    if rs is not None and agg == "token-mean":
        kept = verl.compute_rollout_rejection_mask(new - old, mask, rs, rs_threshold)[0]
        factor = float(kept.sum() / mask.sum())
    assert_allclose(loss.item(), exp.item() * factor, **TOL)
    assert_allclose(grad.numpy(), exp_grad.numpy() * factor, **TOL)


@pytest.mark.parametrize("rs,rs_threshold", sorted({(c[3], c[4]) for c in BYPASS_CASES if c[3] is not None}))
def test_the_bypass_inputs_reject_some_tokens_and_keep_others(rs, rs_threshold):
    """Guard: over the seeds, each rejection test of BYPASS_CASES rejects some valid tokens and keeps others."""
    kept, valid = 0.0, 0.0
    for seed in SEEDS:
        old, new, _, mask = loss_inputs(seed)
        kept += float(verl.compute_rollout_rejection_mask((new - old) * 0.5, mask, rs, rs_threshold)[0].sum())
        valid += float(mask.sum())
    assert 0 < kept < valid


# ------------------------------------------------------------------------------ losses (TRL)


@pytest.mark.parametrize("seed", SEEDS)
def test_bnpo_matches_trl(seed):
    """TRL's bnpo is GRPO's clipped surrogate (no dual clip) divided by the batch's valid tokens: rlcore's
    ``vanilla`` with the ``bnpo`` aggregation and a dual-clip bound too large to bind. (TRL divides per device
    micro-batch; on one batch the two are the same.)"""
    old, new, adv, mask = loss_inputs(seed)
    a, b = new.clone().requires_grad_(True), new.clone().requires_grad_(True)
    loss, _ = policy_loss("vanilla", old_log_prob=old, log_prob=a, advantages=adv, response_mask=mask,
                          loss_agg_mode="bnpo", clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1e9)
    exp = trl.grpo_loss(b, old, adv, mask, loss_type="bnpo", importance_sampling_level="token", epsilon_low=0.2,
                        epsilon_high=0.28)
    loss.backward()
    exp.backward()
    assert_allclose(loss.item(), exp.item(), **TOL)
    assert_allclose(a.grad.numpy(), b.grad.numpy(), **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["luspo", "vespo"])
def test_luspo_and_vespo_match_trl(mode, seed):
    """One advantage per sequence (TRL's ``(B, 1)``, broadcast over the tokens for rlcore); LUSPO at TRL's
    sequence importance-sampling level, VESPO at token level (each as TRL requires) with TRL's normaliser for
    VESPO, the batch's valid tokens (``token-mean``)."""
    old, new, adv, mask = loss_inputs(seed)
    seq_adv = adv[:, :1]
    a, b = new.clone().requires_grad_(True), new.clone().requires_grad_(True)
    options = dict(clip_ratio_low=0.2, clip_ratio_high=0.28) if mode == "luspo" else dict(loss_agg_mode="token-mean")
    loss, _ = policy_loss(mode, old_log_prob=old, log_prob=a, advantages=seq_adv.expand_as(adv), response_mask=mask,
                          **options)
    exp = trl.grpo_loss(b, old, seq_adv, mask, loss_type=mode,
                        importance_sampling_level="sequence" if mode == "luspo" else "token", epsilon_low=0.2,
                        epsilon_high=0.28, num_items_in_batch=mask.sum())
    loss.backward()
    exp.backward()
    assert_allclose(loss.item(), exp.item(), **TOL)
    assert_allclose(a.grad.numpy(), b.grad.numpy(), **TOL)


def test_the_trl_inputs_spread_the_sequence_ratios():
    """Guard: VESPO's weights and LUSPO's clip see sequence ratios well below and above 1."""
    ratios = torch.cat([torch.exp(((new - old) * mask).sum(-1)) for old, new, _, mask in map(loss_inputs, SEEDS)])
    assert ratios.min() < 0.7 and ratios.max() > 1.5


# ------------------------------------------------------------- off-policy weights on the loss (verl, TRL)

# verl's own function for each loss rlcore shares with it, and the options both read (verl's from its config)
VERL_LOSSES = {
    "vanilla": verl.compute_policy_loss_vanilla, "gspo": verl.compute_policy_loss_gspo,
    "geo_mean": verl.compute_policy_loss_geo_mean, "gpg": verl.compute_policy_loss_gpg,
    "cispo": verl.compute_policy_loss_cispo, "clip_cov": verl.compute_policy_loss_clip_cov,
    "kl_cov": verl.compute_policy_loss_kl_cov, "dppo_tv": verl.compute_policy_loss_dppo_tv,
    "dppo_kl": verl.compute_policy_loss_dppo_kl, "sapo": verl.compute_policy_loss_sapo,
    "dro": verl.compute_policy_loss_dro,
}
# wide covariance windows and ratios, so that clip_cov cuts and kl_cov penalises several tokens of these inputs
COV_OPTIONS = dict(clip_cov_ratio=0.1, clip_cov_lb=0.1, clip_cov_ub=5.0, kl_cov_ratio=0.1, ppo_kl_coef=1.0)


def behaviour_weights(old: torch.Tensor, mask: torch.Tensor, correction: str, seed: int) -> torch.Tensor:
    """rlcore's importance weights of ``correction`` for a behaviour policy drawn around the proximal one
    (``old``): TIS truncates some, MIS and IcePop zero some sequences and tokens."""
    gen = torch.Generator().manual_seed(500 + seed)
    behaviour = old + torch.randn(old.shape, generator=gen, dtype=F64) * 0.3
    weights, _ = importance_weights(old, behaviour, mask, correction, cap=1.2, low=0.8, high=1.25)
    return weights


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("correction", ["tis", "mis", "icepop"])
@pytest.mark.parametrize("mode", sorted(VERL_LOSSES))
def test_off_policy_weights_weigh_each_token_loss_as_verls_rollout_is_weights_do(mode, correction, agg, seed):
    """``actor.off_policy`` with every policy loss verl has: rlcore's ``is_weights`` against verl's
    ``rollout_is_weights`` on the same weights, values and gradients; clip_cov's cut tokens drawn at random in
    both from the same seed (verl draws them with torch's global generator)."""
    old, new, adv, mask = loss_inputs(seed)
    weights = behaviour_weights(old, mask, correction, seed)
    options = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, sapo_tau_pos=1.0, sapo_tau_neg=1.05,
                   dro_beta=0.3, is_weights=weights, **COV_OPTIONS)
    options = {k: v for k, v in options.items() if k in POLICY_LOSSES.get(mode).keywords}
    if mode == "clip_cov":
        options["generator"] = torch.Generator().manual_seed(11)
        torch.manual_seed(11)
    loss, exp, grad, exp_grad, _, _ = both(
        VERL_LOSSES[mode], mode, old, new, adv, mask, agg, rl_options=options,
        anchor_kwargs={"config": verl_actor_config(dro_beta=0.3, **COV_OPTIONS), "rollout_is_weights": weights})
    assert_allclose(loss.item(), exp.item(), **TOL)
    assert_allclose(grad.numpy(), exp_grad.numpy(), **TOL)


@pytest.mark.parametrize("mode", ["dro", "kl_cov", "clip_cov"])
def test_weighing_the_advantage_is_not_the_weighted_loss_where_a_loss_is_not_homogeneous_in_it(mode):
    """Why the weights go on the loss: for these three, ``A * w`` (what rlcore did before) gives another loss
    than verl's weighted one on some of the inputs (dro's penalty is not scaled; the covariance selects other
    tokens), while the weights on the loss match verl on all of them."""
    options = {k: v for k, v in dict(dro_beta=0.3, clip_ratio_low=0.2, clip_ratio_high=0.28, **COV_OPTIONS).items()
               if k in POLICY_LOSSES.get(mode).keywords}
    draw = (lambda: {"generator": torch.Generator().manual_seed(11)}) if mode == "clip_cov" else dict
    gaps = []
    for seed in SEEDS:
        for correction in ("tis", "mis", "icepop"):
            old, new, adv, mask = loss_inputs(seed)
            weights = behaviour_weights(old, mask, correction, seed)
            on_loss, _ = policy_loss(mode, old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                                     is_weights=weights, **options, **draw())
            on_advantage, _ = policy_loss(mode, old_log_prob=old, log_prob=new, advantages=adv * weights,
                                          response_mask=mask, **options, **draw())
            torch.manual_seed(11)  # verl's clip_cov draws with the global generator
            exp, _ = VERL_LOSSES[mode](old, new, adv, mask, "token-mean", rollout_is_weights=weights,
                                       config=verl_actor_config(dro_beta=0.3, **COV_OPTIONS))
            assert_allclose(on_loss.item(), exp.item(), **TOL)
            gaps.append(abs(on_advantage.item() - exp.item()))
    assert max(gaps) > 1e-4  # ten times the tolerance the match is held to


@pytest.mark.parametrize("mode", ["luspo", "vespo"])
def test_luspo_and_vespo_weigh_each_token_loss(mode):
    """TRL has no weights of this kind for them (it folds a vLLM ratio into vespo's own weight): each token's loss
    is positively homogeneous in its advantage there, so the weighted loss equals the loss of ``A * w``, token by
    token, which is worked out without the weights."""
    old, new, adv, mask = loss_inputs(1)
    weights = behaviour_weights(old, mask, "tis", 1)
    weighted, _ = policy_loss(mode, old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                              is_weights=weights)
    scaled, _ = policy_loss(mode, old_log_prob=old, log_prob=new, advantages=adv * weights, response_mask=mask)
    plain, _ = policy_loss(mode, old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask)
    assert_allclose(weighted.item(), scaled.item(), **TOL)
    assert abs(weighted.item() - plain.item()) > 1e-3


def test_every_policy_loss_takes_off_policy_weights_but_the_one_that_weighs_by_itself():
    """config.py refuses ``actor.off_policy`` with exactly the losses that cannot take the weights."""
    from rlcore.names import BEHAVIOUR_OLD_POLICY_LOSSES

    without = sorted(name for name in POLICY_LOSSES.names() if not POLICY_LOSSES.get(name).takes_is_weights)
    assert without == sorted(BEHAVIOUR_OLD_POLICY_LOSSES) == ["bypass_mode"]
