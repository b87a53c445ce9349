"""Advantage estimators for RL post-training of language models.

Conventions shared by every estimator:

* ``token_level_rewards``: float ``[batch, response_len]``, the reward placed on response
  tokens (outcome rewards usually sit on the last valid token).
* ``response_mask``: 0/1 (or bool) ``[batch, response_len]``; 1 marks a token the policy
  generated and is trained on, 0 marks right padding or an observation token.
* ``index``: length-``batch`` sequence (numpy array or list of str/int) of prompt ids;
  samples sharing an id form one group (the ``n`` responses to one prompt).
* Outcome estimators use the sequence score ``s_i = sum_t token_level_rewards[i, t]``
  and broadcast one scalar advantage over the response tokens.
* Every estimator returns ``(advantages, returns)``, both ``[batch, response_len]`` and
  exactly 0 wherever ``response_mask`` is 0.

The formulas follow verl's ``trainer/ppo/core_algos.py`` reference definitions; group
statistics use the unbiased standard deviation, and a group of one sample gets mean 0 and
std 1 (so its advantage is ``s / (1 + eps)`` for GRPO, not 0).

Estimators live in the ``ESTIMATORS`` registry as :class:`Estimator` entries that declare what
they need: the data inputs beyond rewards and mask (``index`` for group baselines, ``values``
from a critic, ``reward_baselines`` from a greedy rollout, ``reward_components`` for per-reward
normalisation, ``old_log_probs`` and ``sum_pi_squared`` from a log-prob forward, ``teacher_log_probs`` from a
teacher's) and the options they take (read by name from :class:`AdvantageOptions`). The trainer asks the entry
(``needs_critic``, ``needs_greedy_baseline``, ``needs_teacher``) instead of keeping lists of names, and
:func:`compute_advantage` passes each estimator exactly what it declares: an unexpected keyword is an error naming
it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Sequence

import torch

from rlcore.algos.masked import masked_whiten
from rlcore.registry import Registry, check_keywords, keyword_names

AdvantageFn = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]

# What an estimator may need beyond token_level_rewards and response_mask.
DATA_INPUTS = frozenset({"index", "values", "reward_baselines", "reward_components", "old_log_probs",
                         "sum_pi_squared", "teacher_log_probs"})


@dataclass(frozen=True)
class AdvantageOptions:
    """Every option an estimator may take; each estimator reads the ones it declares."""

    gamma: float = 1.0
    """Discount factor (gae, reinforce_plus_plus)."""
    lam: float = 1.0
    """GAE lambda (gae)."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide by the group std (grpo, grpo_passk); False gives Dr. GRPO."""
    epsilon: float = 1e-6
    """Added to group standard deviations."""
    f_norm: float = 1.0
    """GPG normaliser (gpg)."""
    reward_weights: tuple[float, ...] = ()
    """Weight of each reward component in the sum (gdpo); empty = 1.0 for every component."""
    gdpo_batch_norm: bool = True
    """Whiten gdpo's weighted sum over the batch's valid tokens (the paper's last step); False keeps the
    sum, so a single component gives grpo exactly."""
    handle_zero_tail: bool = True
    """(tir_)optimal_token_baseline: the longest response of a group, where it runs past every other one,
    gets baseline 0 there (verl's default)."""
    distill_reward_weight: float = 0.0
    """distill: weight of the task reward's GRPO advantage added to the teacher's per-token signal (0: the teacher's
    signal alone)."""


@dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator and what it needs."""

    fn: AdvantageFn
    inputs: frozenset[str]
    """Data inputs it reads, among ``DATA_INPUTS``."""
    options: frozenset[str]
    """Fields of :class:`AdvantageOptions` it takes."""

    @property
    def needs_critic(self) -> bool:
        """It reads critic ``values``: the trainer runs a critic worker group."""
        return "values" in self.inputs

    @property
    def needs_greedy_baseline(self) -> bool:
        """It reads ``reward_baselines``: the trainer scores one greedy rollout per prompt."""
        return "reward_baselines" in self.inputs

    @property
    def needs_sum_pi_squared(self) -> bool:
        """It reads ``sum_pi_squared``: the trainer runs a log-prob forward that also returns each token's
        ``sum_v pi(v)^2`` before the advantages (the update's own forward comes too late)."""
        return "sum_pi_squared" in self.inputs

    @property
    def needs_teacher(self) -> bool:
        """It reads ``teacher_log_probs``: the trainer runs a teacher's worker group and its log-prob forward on each
        batch before the advantages."""
        return "teacher_log_probs" in self.inputs

    @property
    def reads_old_log_probs(self) -> bool:
        """It reads ``old_log_probs``: they must be known on the controller before the advantages."""
        return "old_log_probs" in self.inputs


ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")
_OPTION_NAMES = frozenset(f.name for f in fields(AdvantageOptions))


def register_estimator(name: str, *, needs: tuple[str, ...] = ()) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register an estimator under ``name``; ``needs`` names the ``DATA_INPUTS`` it reads, which must be
    exactly the data inputs of its signature (every other keyword is an ``AdvantageOptions`` field)."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        params = keyword_names(fn)
        declared = frozenset(needs)
        if declared - DATA_INPUTS or (params & DATA_INPUTS) != declared:
            raise TypeError(f"estimator {name!r} declares needs {sorted(declared)} but its signature takes "
                            f"{sorted(params & DATA_INPUTS)} (allowed: {sorted(DATA_INPUTS)})")
        options = params - DATA_INPUTS - {"token_level_rewards", "response_mask"}
        if options - _OPTION_NAMES:
            raise TypeError(f"estimator {name!r} takes {sorted(options - _OPTION_NAMES)}, "
                            "which are not AdvantageOptions fields")
        ESTIMATORS.add(name, Estimator(fn, declared, options))
        return fn

    return decorator


# --------------------------------------------------------------------------- helpers


def _zero_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Exact zeros where ``mask`` is 0 (robust to inf/nan at those positions)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _float_mask(response_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if response_mask.shape != like.shape:
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} != token_level_rewards shape {tuple(like.shape)}"
        )
    return response_mask.to(dtype=like.dtype)


def _group_ids(index: Sequence, batch: int, estimator: str, device: torch.device) -> torch.Tensor:
    """Map prompt ids to dense group ids ``[batch]`` (order of first appearance)."""
    keys = index.tolist() if hasattr(index, "tolist") else list(index)
    if len(keys) != batch:
        raise ValueError(f"index has {len(keys)} entries but the batch has {batch} samples")
    dense: dict = {}
    ids = [dense.setdefault(k, len(dense)) for k in keys]
    return torch.tensor(ids, dtype=torch.long, device=device)


def _group_mean_std(scores: torch.Tensor, gid: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
    """Per-sample group mean, unbiased group std and group size, each ``[batch]``.

    Groups of one sample get mean 0 and std 1 (verl's convention).
    """
    n_groups = int(gid.max().item()) + 1 if gid.numel() else 0
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, torch.ones_like(scores))
    total = torch.zeros_like(count).index_add_(0, gid, scores)
    mean = total / count
    sq = torch.zeros_like(count).index_add_(0, gid, (scores - mean[gid]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[gid], std[gid], count[gid]


def _broadcast(scalar: torch.Tensor, mask: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
    adv = _zero_masked(scalar.unsqueeze(-1) * mask, mask)
    return adv, adv


# ------------------------------------------------------------------------ estimators


@register_estimator("gae", needs=("values",))
def gae_advantage(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, values: torch.Tensor,
    gamma: float = 1.0, lam: float = 1.0,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    Backwards over the valid tokens of each row:
    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``,
    where ``V_next``/``A_next`` belong to the next position whose mask is 1 (0 past the
    end). Masked positions are skipped: their rewards and values never enter a valid
    token's result (verl's "skip values and TD-error on observation tokens").
    ``returns = A + V``; advantages are then whitened over the mask
    (``masked_whiten``, unbiased variance, mean shifted to 0).

    Args:
        token_level_rewards: ``[batch, response_len]`` per-token rewards.
        response_mask: ``[batch, response_len]``; 1 = valid response token.
        values: ``[batch, response_len]`` critic values V(s_t). Required.
        gamma: Discount factor.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, each ``[batch, response_len]``, 0 on masked tokens.

    Raises:
        ValueError: If ``values`` is missing or has the wrong shape.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    if values.shape != token_level_rewards.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != rewards shape {tuple(token_level_rewards.shape)}")
    values = values.to(token_level_rewards.dtype)
    next_value = torch.zeros_like(token_level_rewards[:, 0])
    last_adv = torch.zeros_like(next_value)
    columns = []
    for t in reversed(range(token_level_rewards.shape[1])):
        valid = mask[:, t].bool()
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        last_adv = torch.where(valid, delta + gamma * lam * last_adv, last_adv)
        next_value = torch.where(valid, values[:, t], next_value)
        columns.append(last_adv)
    advantages = torch.stack(columns[::-1], dim=1)
    returns = _zero_masked(advantages + values, mask)
    advantages = _zero_masked(masked_whiten(advantages, mask), mask)
    return advantages, returns


@register_estimator("grpo", needs=("index",))
def grpo_advantage(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
    norm_adv_by_std_in_grpo: bool = True, epsilon: float = 1e-6,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    ``A_i = (s_i - mean_g) / (std_g + eps)`` with the group's mean and unbiased std;
    with ``norm_adv_by_std_in_grpo=False`` it is Dr. GRPO (Liu et al. 2025,
    arXiv:2503.20783): ``A_i = s_i - mean_g``. A group of one has mean 0, std 1.

    Args:
        token_level_rewards: ``[batch, response_len]``; ``s_i`` is the row sum.
        response_mask: ``[batch, response_len]``; 1 = valid response token.
        index: ``[batch]`` prompt ids defining the groups. Required.
        norm_adv_by_std_in_grpo: Divide by the group std (GRPO) or not (Dr. GRPO).
        epsilon: Added to the std.

    Returns:
        ``(advantages, returns)`` (the same tensor), ``[batch, response_len]``, ``A_i``
        broadcast over valid tokens.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    scores = token_level_rewards.sum(dim=-1)
    gid = _group_ids(index, scores.shape[0], "grpo", scores.device)
    mean, std, _ = _group_mean_std(scores, gid)
    adv = scores - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    return _broadcast(adv, mask)


@register_estimator("grpo_passk", needs=("index",))
def grpo_passk_advantage(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
    norm_adv_by_std_in_grpo: bool = True, epsilon: float = 1e-6,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """Pass@k GRPO advantage (Chen et al. 2025, arXiv:2503.19595).

    Only the best response of each group is credited: ``A_best = s_max - s_second_max``,
    divided by ``(std_g + eps)`` (unbiased group std) when ``norm_adv_by_std_in_grpo``;
    every other response gets 0. On a tie for the maximum the advantage is 0 anyway.

    Args:
        token_level_rewards: ``[batch, response_len]``; ``s_i`` is the row sum.
        response_mask: ``[batch, response_len]``; 1 = valid response token.
        index: ``[batch]`` prompt ids; every group needs at least 2 samples. Required.
        norm_adv_by_std_in_grpo: Divide by the group std.
        epsilon: Added to the std.

    Returns:
        ``(advantages, returns)`` (the same tensor), ``[batch, response_len]``.

    Raises:
        ValueError: If ``index`` is missing or a group has fewer than 2 samples.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    scores = token_level_rewards.sum(dim=-1)
    gid = _group_ids(index, scores.shape[0], "grpo_passk", scores.device)
    adv = torch.zeros_like(scores)
    for g in range(int(gid.max().item()) + 1 if gid.numel() else 0):
        members = torch.nonzero(gid == g).flatten()
        if members.numel() < 2:
            raise ValueError(f"grpo_passk needs at least 2 samples per group; group #{g} has {members.numel()}")
        group = scores[members]
        top2 = torch.topk(group, 2).values
        gap = top2[0] - top2[1]
        if norm_adv_by_std_in_grpo:
            gap = gap / (group.std() + epsilon)
        adv[members[torch.argmax(group)]] = gap
    return _broadcast(adv, mask)


@register_estimator("rloo", needs=("index",))
def rloo_advantage(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """REINFORCE Leave-One-Out advantage (Ahmadian et al. 2024, arXiv:2402.14740).

    For a group of ``n > 1``: ``A_i = s_i - mean_{j != i} s_j = (s_i - mean_g) * n / (n - 1)``;
    a group of one keeps ``A_i = s_i``.

    Args:
        token_level_rewards: ``[batch, response_len]``; ``s_i`` is the row sum.
        response_mask: ``[batch, response_len]``; 1 = valid response token.
        index: ``[batch]`` prompt ids defining the groups. Required.

    Returns:
        ``(advantages, returns)`` (the same tensor), ``[batch, response_len]``.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    scores = token_level_rewards.sum(dim=-1)
    gid = _group_ids(index, scores.shape[0], "rloo", scores.device)
    mean, _, n = _group_mean_std(scores, gid)
    scale = n / (n - 1).clamp(min=1)
    adv = torch.where(n > 1, scores * scale - mean * scale, scores)
    return _broadcast(adv, mask)


@register_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantage(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """REINFORCE++ advantage (Hu 2025, arXiv:2501.03262).

    Discounted return over the valid tokens, computed backwards: ``G_t = r_t + gamma * G_next`` where
    ``G_next`` is the return at the next valid position (0 past the end). Masked positions (padding,
    or observation tokens inside a multi-turn response) are skipped: the running return is carried
    across them unchanged and their rewards are dropped, the same convention as GAE here and verl's
    current ``compute_reinforce_plus_plus_outcome_advantage``. Advantages are the returns whitened
    over the mask (batch-level normalisation).

    Args:
        token_level_rewards: ``[batch, response_len]`` per-token rewards.
        response_mask: ``[batch, response_len]``; 1 = valid response token.
        gamma: Discount factor.

    Returns:
        ``(advantages, returns)``, each ``[batch, response_len]``, 0 on masked tokens.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    columns = []
    for t in reversed(range(token_level_rewards.shape[1])):
        valid = mask[:, t].bool()
        running = torch.where(valid, token_level_rewards[:, t] + gamma * running, running)
        columns.append(running)
    returns = _zero_masked(torch.stack(columns[::-1], dim=1), mask)
    advantages = _zero_masked(masked_whiten(returns, mask), mask)
    return advantages, returns


@register_estimator("reinforce_plus_plus_baseline", needs=("index",))
def reinforce_plus_plus_baseline_advantage(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """REINFORCE++ with a group-mean baseline (Hu 2025, arXiv:2501.03262).

    ``a_i = s_i - mean_g`` (a group of one has mean 0), broadcast over the valid tokens,
    then whitened over all valid tokens of the batch (``masked_whiten``).

    Args:
        token_level_rewards: ``[batch, response_len]``; ``s_i`` is the row sum.
        response_mask: ``[batch, response_len]``; 1 = valid response token.
        index: ``[batch]`` prompt ids defining the groups. Required.

    Returns:
        ``(advantages, returns)`` (the same tensor), ``[batch, response_len]``.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    scores = token_level_rewards.sum(dim=-1)
    gid = _group_ids(index, scores.shape[0], "reinforce_plus_plus_baseline", scores.device)
    mean, _, _ = _group_mean_std(scores, gid)
    tiled = (scores - mean).unsqueeze(-1) * mask
    adv = _zero_masked(masked_whiten(tiled, mask), mask)
    return adv, adv


@register_estimator("remax", needs=("reward_baselines",))
def remax_advantage(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, reward_baselines: torch.Tensor,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """ReMax advantage (Li et al. 2023, arXiv:2310.10505).

    ``G_t = sum_{t' >= t} mask_t' r_t'`` (reverse cumulative sum of masked rewards) and
    ``A_t = G_t - b`` on valid tokens, where ``b`` is the reward of the greedy response.

    Args:
        token_level_rewards: ``[batch, response_len]`` per-token rewards.
        response_mask: ``[batch, response_len]``; 1 = valid response token.
        reward_baselines: ``[batch]`` greedy-decoding rewards ``b``. Required.

    Returns:
        ``(advantages, returns)``, each ``[batch, response_len]``, 0 on masked tokens.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    baselines = reward_baselines
    if baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(f"reward_baselines must have shape [batch], got {tuple(baselines.shape)}")
    masked_rewards = _zero_masked(token_level_rewards, mask)
    returns = _zero_masked(masked_rewards.flip(-1).cumsum(-1).flip(-1), mask)
    advantages = _zero_masked(returns - baselines.to(returns.dtype).unsqueeze(-1) * mask, mask)
    return advantages, returns


@register_estimator("opo", needs=("index",))
def opo_advantage(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """On-Policy RL with Optimal reward baseline (Hao et al. 2025, arXiv:2505.23585).

    Length-weighted group baseline ``b_g = sum_j L_j s_j / sum_j L_j`` (``L_j`` = number of
    valid tokens of response ``j``); ``A_i = s_i - b_g``; a group of one has ``b = 0``.

    Args:
        token_level_rewards: ``[batch, response_len]``; ``s_i`` is the row sum.
        response_mask: ``[batch, response_len]``; 1 = valid response token.
        index: ``[batch]`` prompt ids defining the groups. Required.

    Returns:
        ``(advantages, returns)`` (the same tensor), ``[batch, response_len]``.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    scores = token_level_rewards.sum(dim=-1)
    lengths = mask.sum(dim=-1)
    gid = _group_ids(index, scores.shape[0], "opo", scores.device)
    n_groups = int(gid.max().item()) + 1 if gid.numel() else 0
    weighted = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, lengths * scores)
    total_len = torch.zeros_like(weighted).index_add_(0, gid, lengths)
    count = torch.zeros_like(weighted).index_add_(0, gid, torch.ones_like(scores))
    baseline = torch.where(count > 1, weighted / total_len, torch.zeros_like(weighted))
    return _broadcast(scores - baseline[gid], mask)


@register_estimator("gpg", needs=("index",))
def gpg_advantage(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
    f_norm: float = 1.0,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """Group Policy Gradient advantage (Chu et al. 2025, arXiv:2504.02546).

    ``A_i = alpha * (s_i - mean_g) / f_norm`` with ``alpha = batch / max(#{i: s_i != 0}, 1)``
    (the whole-batch correction for groups without signal); a group of one has mean 0.

    Args:
        token_level_rewards: ``[batch, response_len]``; ``s_i`` is the row sum.
        response_mask: ``[batch, response_len]``; 1 = valid response token.
        index: ``[batch]`` prompt ids defining the groups. Required.
        f_norm: Normaliser (verl uses 1.0).

    Returns:
        ``(advantages, returns)`` (the same tensor), ``[batch, response_len]``.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    scores = token_level_rewards.sum(dim=-1)
    gid = _group_ids(index, scores.shape[0], "gpg", scores.device)
    mean, _, _ = _group_mean_std(scores, gid)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores).item()), 1)
    return _broadcast(alpha * (scores - mean) / f_norm, mask)


@register_estimator("gdpo", needs=("index", "reward_components"))
def gdpo_advantage(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
    reward_components: torch.Tensor, reward_weights: tuple[float, ...] = (), norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6, gdpo_batch_norm: bool = True,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """Group reward-Decoupled normalisation Policy Optimization, GDPO (Liu et al. 2026, arXiv:2601.05242).

    Each reward component ``k`` is normalised within its group on its own, as GRPO normalises one score:
    ``a_ik = (c_ik - mean_g c_k) / (std_g c_k + eps)`` (unbiased std; without the division when
    ``norm_adv_by_std_in_grpo`` is False; a group of one has mean 0 and std 1). The weighted sum
    ``a_i = sum_k w_k a_ik`` is broadcast over the valid tokens and, with ``gdpo_batch_norm``, whitened over
    every valid token of the batch (``masked_whiten``), so its scale does not grow with the number of
    components. Summing before normalising (GRPO on ``sum_k w_k c_ik``) maps different combinations of
    component scores to the same advantage; normalising each first keeps them apart.

    With one component equal to the sequence score, the result is GRPO's advantage, whitened over the batch
    (exactly GRPO's with ``gdpo_batch_norm=False``). ``token_level_rewards`` only sets the dtype: the
    components carry the rewards (a KL penalty placed in the token rewards does not reach them, as in verl).

    Args:
        token_level_rewards: ``[batch, response_len]``; its dtype is the result's.
        response_mask: ``[batch, response_len]``; 1 = valid response token.
        index: ``[batch]`` prompt ids defining the groups. Required.
        reward_components: ``[batch, n_components]`` each component's unweighted sequence score. Required.
        reward_weights: ``w_k``, one per component; empty = 1.0 each.
        norm_adv_by_std_in_grpo: Divide each component by its group std.
        epsilon: Added to the group stds.
        gdpo_batch_norm: Whiten the weighted sum over the batch's valid tokens.

    Returns:
        ``(advantages, returns)`` (the same tensor), ``[batch, response_len]``, 0 on masked tokens.

    Raises:
        ValueError: Components not ``[batch, n]``, or a number of weights other than ``n``.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    batch = token_level_rewards.shape[0]
    comps = reward_components.to(token_level_rewards.dtype)
    if comps.dim() != 2 or comps.shape[0] != batch or comps.shape[1] == 0:
        raise ValueError(f"gdpo: reward_components must be [batch={batch}, n_components >= 1], "
                         f"got {tuple(reward_components.shape)}")
    if reward_weights and len(reward_weights) != comps.shape[1]:
        raise ValueError(f"gdpo: {len(reward_weights)} reward_weights for {comps.shape[1]} reward components")
    weights = reward_weights or (1.0,) * comps.shape[1]
    gid = _group_ids(index, batch, "gdpo", comps.device)
    total = torch.zeros(batch, dtype=comps.dtype, device=comps.device)
    for k, w in enumerate(weights):
        mean, std, _ = _group_mean_std(comps[:, k], gid)
        centred = comps[:, k] - mean
        total = total + w * (centred / (std + epsilon) if norm_adv_by_std_in_grpo else centred)
    adv = _zero_masked(total.unsqueeze(-1) * mask, mask)
    if gdpo_batch_norm:
        adv = _zero_masked(masked_whiten(adv, mask), mask)
    return adv, adv


def _reward_to_go(token_level_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``G_t = sum_{t' >= t} m_t' r_t'`` per row (valid rewards only)."""
    return _zero_masked(token_level_rewards, mask).flip(-1).cumsum(-1).flip(-1)


def _realized_energy(old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``W_t = sum_{j <= t} m_j (1 - 2 pi_j + sum_v pi_j(v)^2)``: the squared norm of the log-softmax gradient
    at the sampled token, ``||e_y - pi||^2``, accumulated along the response."""
    w = 1.0 - 2.0 * old_log_probs.exp() + sum_pi_squared
    return _zero_masked(w.to(mask.dtype), mask).cumsum(-1)


def _token_baselines(returns: torch.Tensor, energy: torch.Tensor, valid: torch.Tensor, groups: list[list[int]],
                     handle_zero_tail: bool) -> torch.Tensor:
    """Per column ``t`` of aligned ``[batch, width]`` arrays, each group's ``B_t = sum_i G_it W_it v_it /
    (sum_i W_it v_it + 1e-8)`` for its rows; groups of one get 0. With ``handle_zero_tail`` a group's single
    longest row (``sum_t v_it``) gets 0 from the second-longest row's length on."""
    baselines = torch.zeros_like(returns)
    lengths = valid.sum(-1)
    for rows in groups:
        if len(rows) < 2:
            continue
        idx = torch.tensor(rows, device=returns.device)
        w, v = energy[idx], valid[idx]
        baselines[idx] = ((returns[idx] * w * v).sum(0) / ((w * v).sum(0) + 1e-8)).expand(len(rows), -1)
        if handle_zero_tail:
            ordered = torch.sort(lengths[idx]).values
            longest, second = int(ordered[-1]), int(ordered[-2])
            if longest > second:
                baselines[rows[int(torch.argmax(lengths[idx]))], second:] = 0.0
    return baselines


def _groups_of(index: Sequence, batch: int, estimator: str, device: torch.device,
               keep: torch.Tensor | None = None) -> list[list[int]]:
    """Row numbers of each group, in order of first appearance; with ``keep`` only the rows it marks."""
    gid = _group_ids(index, batch, estimator, device).tolist()
    groups: dict[int, list[int]] = {}
    for row, g in enumerate(gid):
        if keep is None or bool(keep[row]):
            groups.setdefault(g, []).append(row)
    return list(groups.values())


@register_estimator("optimal_token_baseline", needs=("index", "old_log_probs", "sum_pi_squared"))
def optimal_token_baseline_advantage(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
    old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor, handle_zero_tail: bool = True,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """Optimal Token Baseline, OTB (Li et al. 2026, arXiv:2602.07078).

    A baseline per token position from the group's rewards-to-go, weighted by each response's realised
    energy so far (a forward-only proxy of its gradient's squared norm):
    ``G_it = sum_{t' >= t} m r``, ``W_it = sum_{j <= t} m_ij (1 - 2 pi_ij + sum_v pi_ij(v)^2)``
    (``pi_ij = exp(old_log_probs)``), ``B_t = sum_{i in g} G_it W_it m_it / (sum_{i in g} W_it m_it + 1e-8)``,
    ``A_it = (G_it - B_t) m_it``. Positions are absolute (column ``t``); a group of one gets ``B = 0``; with
    ``handle_zero_tail`` the group's single longest response gets ``B = 0`` from the second-longest one's
    length on (no other response estimates the baseline there).

    Args:
        token_level_rewards: ``[batch, response_len]`` per-token rewards.
        response_mask: ``[batch, response_len]``; 1 = valid response token.
        index: ``[batch]`` prompt ids defining the groups. Required.
        old_log_probs: ``[batch, response_len]`` log-probs of the sampled tokens. Required.
        sum_pi_squared: ``[batch, response_len]`` ``sum_v pi(v)^2`` of each position's distribution. Required.
        handle_zero_tail: Zero the baseline of the longest response past the second-longest.

    Returns:
        ``(advantages, returns)``, each ``[batch, response_len]``, 0 on masked tokens.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    returns = _reward_to_go(token_level_rewards, mask)
    energy = _realized_energy(old_log_probs.to(mask.dtype), sum_pi_squared.to(mask.dtype), mask)
    groups = _groups_of(index, mask.shape[0], "optimal_token_baseline", mask.device)
    baselines = _token_baselines(returns, energy, mask, groups, handle_zero_tail)
    return _zero_masked(returns - baselines, mask), _zero_masked(returns, mask)


@register_estimator("tir_optimal_token_baseline", needs=("index", "old_log_probs", "sum_pi_squared"))
def tir_optimal_token_baseline_advantage(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence,
    old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor, handle_zero_tail: bool = True,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """Optimal Token Baseline for multi-turn (tool-integrated) responses (Li et al. 2026, arXiv:2602.07078).

    As ``optimal_token_baseline``, but token ``t`` means the ``t``-th *valid* token of each response: masked
    positions inside a response (observation tokens of a multi-turn rollout) are skipped, so the responses of a
    group are compared turn-aligned by what the policy generated. Rows without a valid token leave their group
    (a group left with one row gets ``B = 0``).

    Args:
        token_level_rewards: ``[batch, response_len]`` per-token rewards.
        response_mask: ``[batch, response_len]``; 1 = valid response token (0 also inside, for observations).
        index: ``[batch]`` prompt ids defining the groups. Required.
        old_log_probs: ``[batch, response_len]`` log-probs of the sampled tokens. Required.
        sum_pi_squared: ``[batch, response_len]`` ``sum_v pi(v)^2`` of each position's distribution. Required.
        handle_zero_tail: Zero the baseline of the longest response past the second-longest (in valid tokens).

    Returns:
        ``(advantages, returns)``, each ``[batch, response_len]``, 0 on masked tokens.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    valid = mask.bool()
    returns = _reward_to_go(token_level_rewards, mask)
    energy = _realized_energy(old_log_probs.to(mask.dtype), sum_pi_squared.to(mask.dtype), mask)
    # column k of the compact arrays holds each row's k-th valid token
    rank = torch.where(valid, mask.cumsum(-1).long() - 1, torch.zeros_like(valid, dtype=torch.long))

    def compact(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x).scatter_add_(1, rank, _zero_masked(x, mask))

    groups = _groups_of(index, mask.shape[0], "tir_optimal_token_baseline", mask.device, keep=valid.any(-1))
    baselines = _token_baselines(compact(returns), compact(energy), compact(mask), groups, handle_zero_tail)
    advantages = returns - torch.gather(baselines, 1, rank)
    return _zero_masked(advantages, mask), _zero_masked(returns, mask)


# ------------------------------------------------------------------------- dispatcher


@register_estimator("distill", needs=("index", "old_log_probs", "teacher_log_probs"))
def distill_advantage(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence, old_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor, distill_reward_weight: float = 0.0, norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """On-policy distillation (Agarwal et al. 2024, GKD, arXiv:2306.13649; Thinking Machines' on-policy distillation
    and NeMo-RL's ``opd``): each token the student sampled is scored by a teacher, and the per-token reverse KL
    estimate ``log pi_student - log pi_teacher`` of that token, negated, is its advantage, with no discount (each
    token's own; the policy gradient of these advantages lowers KL(student || teacher) on the student's own
    samples). With ``distill_reward_weight`` w > 0 the task reward's GRPO advantage, times w, is added to every
    token: ``A_t = (log pi_teacher(y_t) - log pi_student(y_t)) + w * A_grpo``.

    Args:
        token_level_rewards: ``[batch, response_len]``; ``s_i`` is the row sum (the task reward, for w > 0).
        response_mask: ``[batch, response_len]``; 1 = valid response token.
        index: ``[batch]`` prompt ids defining the groups of the reward's advantage.
        old_log_probs: ``[batch, response_len]`` the student's log-probs of its sampled tokens (the policy that
            sampled them, or the proximal policy of a stale batch).
        teacher_log_probs: ``[batch, response_len]`` the teacher's log-probs of the same tokens.
        distill_reward_weight: w above; 0 = the teacher's signal alone.
        norm_adv_by_std_in_grpo: Divide the reward's advantage by the group std (GRPO) or not (Dr. GRPO).
        epsilon: Added to the std.

    Returns:
        ``(advantages, returns)`` (the same tensor), ``[batch, response_len]``, 0 on masked tokens.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    if old_log_probs.shape != mask.shape or teacher_log_probs.shape != mask.shape:
        raise ValueError(f"old_log_probs {tuple(old_log_probs.shape)} and teacher_log_probs "
                         f"{tuple(teacher_log_probs.shape)} must be the rewards' shape {tuple(mask.shape)}")
    adv = _zero_masked((teacher_log_probs - old_log_probs).to(mask.dtype) * mask, mask)
    if distill_reward_weight:
        reward_adv, _ = grpo_advantage(token_level_rewards=token_level_rewards, response_mask=response_mask,
                                       index=index, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, epsilon=epsilon)
        adv = adv + distill_reward_weight * reward_adv
    return adv, adv


def compute_advantage(
    estimator: str, *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, **inputs_and_options: Any,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """Compute ``(advantages, returns)`` with the estimator registered as ``estimator``, under
    ``torch.no_grad()`` (advantages are targets).

    Args:
        estimator: A name in ``ESTIMATORS`` (``gae``, ``grpo``, ``grpo_passk``, ``rloo``,
            ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``remax``, ``opo``,
            ``gpg``, ``gdpo``, ``optimal_token_baseline``, ``tir_optimal_token_baseline``, ``distill``).
        token_level_rewards: ``[batch, response_len]`` float rewards on response tokens.
        response_mask: ``[batch, response_len]`` 0/1 mask; 1 = valid response token.
        **inputs_and_options: Exactly the data inputs the estimator declares (``index``: ``[batch]``
            prompt ids, a numpy array or list of str/int; ``values``: ``[batch, response_len]`` critic
            values; ``reward_baselines``: ``[batch]`` greedy rewards; ``reward_components``:
            ``[batch, n_components]`` sequence scores; ``old_log_probs`` and ``sum_pi_squared``:
            ``[batch, response_len]`` from a log-prob forward; ``teacher_log_probs``: ``[batch, response_len]`` from a
            teacher's) and any of the options it takes
            (``AdvantageOptions`` fields, e.g. ``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``).

    Returns:
        ``(advantages, returns)``, each ``[batch, response_len]``, exactly 0 where
        ``response_mask`` is 0.

    Raises:
        KeyError: Unknown estimator (the message lists the allowed names).
        ValueError: A data input the estimator needs is missing (named in the message).
        TypeError: A keyword the estimator does not take (named in the message).
    """
    entry = ESTIMATORS.get(estimator)
    check_keywords(f"advantage estimator {estimator!r}", inputs_and_options, entry.inputs | entry.options)
    missing = sorted(entry.inputs - {k for k, v in inputs_and_options.items() if v is not None})
    if missing:
        raise ValueError(f"advantage estimator {estimator!r} requires the argument(s) {', '.join(map(repr, missing))}")
    if token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must be [batch, response_len], got {tuple(token_level_rewards.shape)}")
    with torch.no_grad():
        return entry.fn(token_level_rewards=token_level_rewards, response_mask=response_mask, **inputs_and_options)
