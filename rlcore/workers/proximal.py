"""The proximal (old) policy of an actor update and what is measured against it, each by one function here.

Where the old log-probs come from is the update's spec, chosen by the round from ``actor.recompute_log_prob``,
``ppo.mode`` and the update's shape (:data:`SOURCES`): the rollout's own (the policy that sampled is the one being
trained), a trainer forward run before the update (sent as ``old_log_probs``), or the update's own first forward
(one epoch of one mini-batch: no optimizer step comes before any row's forward). Whichever it is, the update
computes from it:

* the importance weights of the proximal over the behaviour policy (``actor.off_policy``,
  :func:`rlcore.algos.off_policy.importance_weights`), which multiply each token's policy loss;
* the training-inference mismatch (``rollout/logprob_*``): how far the rollout's log-probs of the sampled tokens
  are from the trainer's own before the update (:func:`mismatch_sums`);
* the KL of the proximal policy to the reference (``actor/kl_ref``, :func:`kl_ref_sums`).

A :class:`ProximalTerms` holds one update call's sums (a local of the call, never state of the worker); its
:meth:`~ProximalTerms.metrics` reduces them over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlcore.algos.kl import kl_penalty
from rlcore.algos.off_policy import MAX_KEYS, SUM_KEYS, importance_weights, merge_stats, off_policy_metrics
from rlcore.engine import distributed
from rlcore.protocol import Batch, Metrics

SOURCES = ("rollout", "given", "update")
"""Where an update's old log-probs come from: the batch's ``rollout_log_probs``; its ``old_log_probs`` (a trainer
forward before the update); the update's own first forward."""


@dataclass(frozen=True)
class OffPolicySpec:
    """``actor.off_policy``: the correction between the behaviour (rollout) and the proximal policy."""

    correction: str
    """``rlcore.algos.off_policy.CORRECTIONS`` name."""
    cap: float = 2.0
    low: float = 0.5
    high: float = 2.0


def mismatch_sums(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Sums over the valid tokens of ``|trainer - rollout|``, its max and the k3 estimate of KL(trainer ||
    rollout), and the token count (``[batch, response_len]`` log-probs of the same weights: their difference is
    the engines' and kernels' alone)."""
    valid = mask.bool()
    diff = (trainer - rollout).abs()[valid]
    return {"abs_sum": float(diff.sum()), "abs_max": float(diff.max()) if diff.numel() else 0.0,
            "k3_sum": float(kl_penalty(trainer, rollout, "k3")[valid].sum()), "tokens": float(valid.sum())}


def kl_ref_sums(proximal: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Summed ``proximal - ref`` over the response tokens (``[batch, response_len]``) and their count: summed
    over ranks and divided afterwards, the global token mean of the proximal policy's KL to the reference."""
    kl = kl_penalty(proximal, ref, "kl") * mask
    return {"kl_ref_sum": float(kl.sum()), "kl_ref_tokens": float(mask.sum())}


@dataclass
class ProximalTerms:
    """One update call's proximal policy and its measurements (see the module docstring)."""

    source: str
    """One of :data:`SOURCES`."""
    correction: OffPolicySpec | None
    first_minibatch: bool = True
    """Until the first optimizer step: the forwards run the weights the rollout sampled with."""
    weight_stats: dict[str, float] | None = None
    mismatch: dict[str, float] | None = None
    kl_ref: dict[str, float] = field(default_factory=lambda: {"kl_ref_sum": 0.0, "kl_ref_tokens": 0.0})

    @classmethod
    def started(cls, source: str, correction: OffPolicySpec | None, batch: Batch) -> "ProximalTerms":
        """The terms of an update of ``batch``, :meth:`start` already called on it."""
        terms = cls(source, correction)
        terms.start(batch)
        return terms

    def start(self, batch: Batch) -> None:
        """What the whole shard tells before the first mini-batch: with ``given`` old log-probs, the mismatch of
        every row and the KL to the reference (the ``update`` source measures both on its first forward)."""
        mask = batch["response_mask"]
        if self.source == "given" and "rollout_log_probs" in batch:
            self.mismatch = mismatch_sums(batch["old_log_probs"], batch["rollout_log_probs"], mask)
        if self.source != "update" and "ref_log_probs" in batch:
            old = batch["old_log_probs"] if self.source == "given" else batch["rollout_log_probs"]
            self.kl_ref = kl_ref_sums(old, batch["ref_log_probs"], mask)

    def old(self, part: Batch, log_prob: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The micro-batch's old log-probs (``[rows, response_len]``) given its forward's ``log_prob``; on the
        update's first mini-batch, the mismatch of that forward (the weights the rollout sampled with) and, for the
        ``update`` source, the KL to the reference are added up."""
        mask = part["response_mask"].to(device)
        forward = log_prob.detach()
        if self.first_minibatch and self.source != "given" and "rollout_log_probs" in part:
            sums = mismatch_sums(forward, part["rollout_log_probs"].to(device), mask)
            self.mismatch = sums if self.mismatch is None else _added(self.mismatch, sums)
        if self.source == "given":
            return part["old_log_probs"].to(device)
        if self.source == "rollout":
            return part["rollout_log_probs"].to(device)
        if "ref_log_probs" in part:
            self.kl_ref = _added(self.kl_ref, kl_ref_sums(forward, part["ref_log_probs"].to(device), mask))
        return forward

    def weights(self, old: torch.Tensor, part: Batch, device: torch.device) -> torch.Tensor | None:
        """The importance weights ``[rows, response_len]`` of ``old`` (the proximal policy) over the rollout's,
        counted into the update's statistics; None without a correction."""
        o = self.correction
        if o is None:
            return None
        weights, stats = importance_weights(old, part["rollout_log_probs"].to(device), part["response_mask"].to(device),
                                            o.correction, cap=o.cap, low=o.low, high=o.high)
        self.weight_stats = stats if self.weight_stats is None else merge_stats(self.weight_stats, stats)
        return weights

    def metrics(self, device: torch.device) -> Metrics:
        """``rollout/logprob_*``, ``off_policy/*`` and the sums behind ``actor/kl_ref``, over every rank (collectives:
        every rank calls this)."""
        out: Metrics = {}
        if self.mismatch is not None:
            tokens = distributed.all_reduce_sum(self.mismatch["tokens"], device)
            out["rollout/logprob_abs_diff_max"] = distributed.all_reduce_max(self.mismatch["abs_max"], device)
            abs_sum = distributed.all_reduce_sum(self.mismatch["abs_sum"], device)
            k3_sum = distributed.all_reduce_sum(self.mismatch["k3_sum"], device)
            if tokens:
                out["rollout/logprob_abs_diff_mean"] = abs_sum / tokens
                out["rollout/logprob_k3_kl"] = k3_sum / tokens
        if self.correction is not None:
            stats: dict[str, float] = self.weight_stats or {}
            merged = {k: distributed.all_reduce_sum(stats.get(k, 0.0), device) for k in SUM_KEYS}
            merged.update({k: distributed.all_reduce_max(stats.get(k, 0.0), device) for k in MAX_KEYS})
            out.update(off_policy_metrics(merged))
        return out


def _added(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Two sets of token sums together (``*_max`` keys take the larger)."""
    return {k: max(a[k], b[k]) if k.endswith("_max") else a[k] + b[k] for k in a}
