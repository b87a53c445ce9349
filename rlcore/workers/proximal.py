"""The proximal (old) policy of an actor update: where its log-probs come from, and what is measured against it.

Where the old log-probs come from is a type, one of three small classes here; the round chooses one from
``actor.recompute_log_prob``, ``ppo.mode`` and the update's shape (``rlcore.trainer.round.ppo_step.proximal_source``)
and sends it in the update's spec. Each says what the controller sends the update and how the update measures:

* :class:`RolloutLogProbs`: the rollout's own (the policy that sampled is the one being trained);
* :class:`RecomputedLogProbs`: a trainer forward run before the update, sent as ``old_log_probs``;
* :class:`FirstForwardLogProbs`: the update's own first forward (one epoch of one mini-batch: no optimizer step
  comes before any row's forward), so nothing more is sent and no forward of their own is run.

Whichever it is, the update computes from it, each quantity by one function here:

* the importance weights of the proximal over the behaviour policy (``actor.off_policy``,
  :func:`rlcore.algos.off_policy.importance_weights`), which multiply each token's policy loss;
* the training-inference mismatch (``rollout/logprob_*``): how far the rollout's log-probs of the sampled tokens
  are from the trainer's own before the update (:func:`mismatch_sums`);
* the KL of the proximal policy to the reference (``actor/kl_ref``, :func:`kl_ref_sums`).

A :class:`ProximalMeasures` holds one update call's sums (a local of the call, never state of the worker); its
:meth:`~ProximalMeasures.metrics` reduces them over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from rlcore.algos.kl import kl_penalty
from rlcore.algos.off_policy import MAX_KEYS, SUM_KEYS, importance_weights, merge_stats, off_policy_metrics
from rlcore.config import OffPolicyConfig
from rlcore.engine import distributed
from rlcore.protocol import Batch, Metrics


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
class ProximalMeasures:
    """One update call's measurements against its proximal policy (see the module docstring): sums added up as
    the sources measure them, reduced over the ranks by :meth:`metrics`."""

    correction: OffPolicyConfig | None
    """``actor.off_policy``: the importance weights of the proximal over the behaviour policy (None: none)."""
    weight_stats: dict[str, float] | None = None
    mismatch: dict[str, float] | None = None
    kl_ref: dict[str, float] | None = None

    def add_mismatch(self, trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> None:
        """Count in the mismatch of ``trainer``'s log-probs (the weights the rollout sampled with) to the rollout's."""
        self.mismatch = _added(self.mismatch, mismatch_sums(trainer, rollout, mask))

    def add_kl_ref(self, proximal: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> None:
        self.kl_ref = _added(self.kl_ref, kl_ref_sums(proximal, ref, mask))

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
        """``rollout/logprob_*``, ``off_policy/*`` and ``actor/kl_ref`` over every rank (collectives: every rank calls
        this)."""
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
        if self.kl_ref is not None:
            kl = distributed.all_reduce_mean(self.kl_ref, device)
            out["actor/kl_ref"] = kl["kl_ref_sum"] / max(kl["kl_ref_tokens"], 1.0)
        return out


class ProximalSource(Protocol):
    """Where an update's old log-probs come from: what the controller computes and sends for it, and how the update
    takes them and measures against them."""

    forward_before_update: ClassVar[bool]
    """The controller runs a trainer forward for them before the update."""
    sent: ClassVar[tuple[str, ...]]
    """What the update reads of the batch for them besides the rollout's log-probs."""

    def on_controller(self, batch: Batch) -> Batch:
        """``batch`` (holding what :attr:`sent` names, when the controller computed it) with ``old_log_probs`` where
        the controller has them before the update (an estimator or a KL penalty in the reward may read them)."""

    def measures(self, batch: Batch, correction: OffPolicyConfig | None, *, epochs: int,
                 mini_batch_size: int) -> ProximalMeasures:
        """An update's measurements of this rank's ``batch``, with what the whole shard tells before the first
        mini-batch; an update whose shape the source cannot serve is refused (ValueError)."""

    def old(self, part: Batch, forward: torch.Tensor, first_minibatch: bool, measures: ProximalMeasures,
            device: torch.device) -> torch.Tensor:
        """A micro-batch's old log-probs ``[rows, response_len]`` given its forward's log-probs (``forward``), on the
        update's first mini-batch (``first_minibatch``: no optimizer step before it) measuring what that forward
        (the weights the rollout sampled with) tells."""


@dataclass(frozen=True)
class RolloutLogProbs:
    """The rollout's own log-probs are the old policy: the weights that sampled are the ones being trained (a
    synchronous round without recompute, or a loss whose old policy is the behaviour one). Nothing more is sent; the
    update measures the rollout mismatch on its first mini-batch's forward and the KL to the reference on the
    rollout's log-probs, over the whole shard."""

    forward_before_update: ClassVar[bool] = False
    sent: ClassVar[tuple[str, ...]] = ()

    def on_controller(self, batch: Batch) -> Batch:
        return batch.union(Batch({"old_log_probs": batch["rollout_log_probs"]}))

    def measures(self, batch: Batch, correction: OffPolicyConfig | None, *, epochs: int,
                 mini_batch_size: int) -> ProximalMeasures:
        measures = ProximalMeasures(correction)
        if "ref_log_probs" in batch:
            measures.add_kl_ref(batch["rollout_log_probs"], batch["ref_log_probs"], batch["response_mask"])
        return measures

    def old(self, part: Batch, forward: torch.Tensor, first_minibatch: bool, measures: ProximalMeasures,
            device: torch.device) -> torch.Tensor:
        rollout = part["rollout_log_probs"].to(device)
        if first_minibatch:
            measures.add_mismatch(forward.detach(), rollout, part["response_mask"].to(device))
        return rollout


@dataclass(frozen=True)
class RecomputedLogProbs:
    """A trainer forward before the update computes the old log-probs (the controller sends them as
    ``old_log_probs``); the mismatch to the rollout's and the KL to the reference are measured on them, over the
    whole shard, before the first mini-batch."""

    forward_before_update: ClassVar[bool] = True
    sent: ClassVar[tuple[str, ...]] = ("old_log_probs",)

    def on_controller(self, batch: Batch) -> Batch:
        return batch

    def measures(self, batch: Batch, correction: OffPolicyConfig | None, *, epochs: int,
                 mini_batch_size: int) -> ProximalMeasures:
        measures, mask = ProximalMeasures(correction), batch["response_mask"]
        if "rollout_log_probs" in batch:
            measures.add_mismatch(batch["old_log_probs"], batch["rollout_log_probs"], mask)
        if "ref_log_probs" in batch:
            measures.add_kl_ref(batch["old_log_probs"], batch["ref_log_probs"], mask)
        return measures

    def old(self, part: Batch, forward: torch.Tensor, first_minibatch: bool, measures: ProximalMeasures,
            device: torch.device) -> torch.Tensor:
        return part["old_log_probs"].to(device)


@dataclass(frozen=True)
class FirstForwardLogProbs:
    """The update's own first forward is the old policy: one epoch of one mini-batch, so no optimizer step comes
    before any row's forward and no forward of their own is needed. Nothing more is sent; that forward gives the
    mismatch to the rollout's log-probs and the KL to the reference."""

    forward_before_update: ClassVar[bool] = False
    sent: ClassVar[tuple[str, ...]] = ()

    def on_controller(self, batch: Batch) -> Batch:
        return batch

    def measures(self, batch: Batch, correction: OffPolicyConfig | None, *, epochs: int,
                 mini_batch_size: int) -> ProximalMeasures:
        if epochs != 1 or mini_batch_size < len(batch):
            raise ValueError("update_actor: old log-probs from the update's own forward need one epoch of one "
                             f"mini-batch (got {epochs} epoch(s), mini-batches of {mini_batch_size} of {len(batch)} "
                             "rows)")
        return ProximalMeasures(correction)

    def old(self, part: Batch, forward: torch.Tensor, first_minibatch: bool, measures: ProximalMeasures,
            device: torch.device) -> torch.Tensor:
        proximal, mask = forward.detach(), part["response_mask"].to(device)
        if "rollout_log_probs" in part:
            measures.add_mismatch(proximal, part["rollout_log_probs"].to(device), mask)
        if "ref_log_probs" in part:
            measures.add_kl_ref(proximal, part["ref_log_probs"].to(device), mask)
        return proximal


def _added(a: dict[str, float] | None, b: dict[str, float]) -> dict[str, float]:
    """Two sets of token sums together (``*_max`` keys take the larger); ``b`` alone when there is no ``a``."""
    if a is None:
        return b
    return {k: max(a[k], b[k]) if k.endswith("_max") else a[k] + b[k] for k in a}
