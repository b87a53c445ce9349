# ruff: noqa
"""Test fixture: TRL GRPOTrainer's policy-loss computation, trimmed to a function of tensors.

NOT part of rlcore; only tests/algos/test_against_anchors.py imports it, to compare rlcore's bnpo, luspo and
vespo with TRL's on random inputs.

Source: https://github.com/huggingface/trl, commit f2cd57710ae345ea6428ae95363267fcf38a3dc8 (2026-07-24),
trl/trainer/grpo_trainer.py: ``GRPOTrainer.get_gamma_weights`` (lines 2943-2989) and the parts of
``GRPOTrainer._compute_loss`` from the importance ratio to the loss aggregation (lines 3054-3066, 3078-3109 and
3123-3150). Licence: Apache License 2.0 (Copyright The HuggingFace Team), http://www.apache.org/licenses/LICENSE-2.0.

Changes from the source: the lines are copied unchanged except that the trainer's attributes become this
function's arguments (``self.loss_type`` -> ``loss_type``, ``self.args.vespo_k_pos`` -> ``vespo_k_pos``, ...,
``inputs["num_items_in_batch"]`` -> ``num_items_in_batch``), gradient accumulation and the process count are 1,
the model is in training mode, and no vLLM importance-sampling ratio is given. The parts left out (the
off-policy mask, the entropy mask, the KL term, the vLLM correction, the entropy bonus and the metrics) are
switched off in the configurations compared.
"""

import math

import torch


@torch.no_grad()
def get_gamma_weights(
    advantages: torch.Tensor,
    log_ratio_per_token: torch.Tensor,
    mask: torch.Tensor,
    importance_sampling_ratio: torch.Tensor | None,  # (B, T)
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> torch.Tensor:
    """
    Computes the Gamma weights for the VESPO loss. For reference:
        φ(w) = e^λ × w^k × e^{-λw} is the gamma weighting (normalized so φ(1)=1)
            with w = sequence-level importance sampling ratio
    note: we will compute φ(w) in log space

    φ(w) is detached via @torch.no_grad(), only acts as gradient scaling coefficient

    VESPO loss = -φ(w) × A × log_prob, gradient naturally gives φ(w) × A × ∇log π
    """
    # reducing clamp range directly to log(1e-8) ~ -18.42, to avoid recomputing log_w=log(w.clamp(min=1e-8)) later
    # This is solely for matching truthfully the original implementation, otherwise keeping -20 could be fine.
    lower_clamp = math.log(1e-8)

    # Sequence-level log ratio Σ log(π_θ/π_old) (not a mean like for `log_importance_weights`)
    log_ratio_clamped = torch.clamp(log_ratio_per_token, -20.0, 20.0)
    seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)  # (B, 1)

    # Apply token-level TIS or MIS correction (in log space)
    if importance_sampling_ratio is not None:
        log_is_ratio = torch.clamp(torch.log(importance_sampling_ratio), lower_clamp, 20.0)
        # log(w) = log(π_θ/π_old) + log(π_old/π_sampler)
        seq_log_ratio += torch.sum(log_is_ratio, dim=-1, keepdim=True)

    log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
    w_seq = torch.exp(log_w_seq)

    # compute k and lambda based on advantage sign
    is_nonneg_adv = advantages >= 0
    k_seq = torch.where(is_nonneg_adv, k_pos, k_neg)
    lambda_seq = torch.where(is_nonneg_adv, lambda_pos, lambda_neg).clamp(min=1e-4)

    # log(φ(w)) = λ + k × log(w) - λ × w
    log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
    phi_seq = torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)

    return phi_seq  # (B, 1)


def grpo_loss(per_token_logps, old_per_token_logps, advantages, mask, *, loss_type, importance_sampling_level,
              epsilon_low=0.2, epsilon_high=0.2, delta=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
              vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
              num_items_in_batch=None, max_completion_length=None):
    """TRL's policy loss for ``loss_type``; ``advantages`` is ``(B, 1)`` or ``(B, T)``."""
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    elif importance_sampling_level == "sequence":
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    else:
        raise ValueError(
            f"Unknown importance sampling level: {importance_sampling_level}. Possible values are 'token' "
            "and 'sequence'."
        )

    coef_1 = torch.exp(log_importance_weights)

    # From here, log_importance_weights (and all subsequent tensors, coef_1, coef_2, etc.) shape depends on
    # importance_sampling_level: "token" level: (B, T); "sequence" level: (B, 1)
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        # Two-sided clipping
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)

        per_token_loss1 = coef_1 * advantages
        per_token_loss2 = coef_2 * advantages
        per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    elif loss_type == "sapo":
        temperatures = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * advantages
    elif loss_type == "vespo":
        phi_seq = get_gamma_weights(
            advantages=advantages,
            log_ratio_per_token=log_ratio,
            mask=mask,
            importance_sampling_ratio=None,
            k_pos=vespo_k_pos,
            lambda_pos=vespo_lambda_pos,
            k_neg=vespo_k_neg,
            lambda_neg=vespo_lambda_neg,
        )
        per_token_loss = -phi_seq * advantages * per_token_logps
    else:
        raise ValueError(f"Unknown loss type: {loss_type}")

    mode = "train"
    if loss_type in ["grpo", "sapo"]:
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        normalizer = 1 if mode == "train" else 1.0  # no accum in eval
        policy_loss = loss.detach()
        loss = loss / normalizer
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        normalizer = 1 if mode == "train" else 1.0  # no accum in eval
        policy_loss = loss.detach()
        loss = loss / normalizer
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
        normalizer = 1 if mode == "train" else 1.0  # no accum in eval
        policy_loss = loss.detach()
        loss = loss / normalizer
    elif loss_type in ["cispo", "dapo", "vespo"]:
        normalizer = num_items_in_batch.clamp(min=1.0) / 1
        loss = (per_token_loss * mask).sum() / normalizer
        policy_loss = loss.detach()
    elif loss_type == "luspo":
        # Unless importance_sampling_level="token" (not recommended here), per_token_loss is expected to be (B, 1)
        loss = (per_token_loss * mask.sum(1, keepdim=True)).mean()
        normalizer = 1 if mode == "train" else 1.0
        policy_loss = loss.detach()
        loss = loss / normalizer
    else:
        raise ValueError(f"Unknown loss type: {loss_type}")
    return loss
