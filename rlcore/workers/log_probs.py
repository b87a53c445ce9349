"""The no-grad log-prob forward every frozen or trained policy of a round runs on a rank: the actor's old log-probs,
the reference's and the distillation teacher's (:mod:`rlcore.workers.teacher`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.engine.sequence import SequenceModel, eval_mode, sequences
from rlcore.protocol import Batch


@dataclass(frozen=True)
class LogProbSpec:
    """A no-grad log-prob forward."""

    micro_batch_size: int
    """Rows per forward on a rank."""
    temperature: float = 1.0
    """Logits are divided by it (the rollout's sampling temperature, as in verl)."""
    sum_pi_squared: bool = False
    """Also return ``sum_pi_squared``, each position's ``sum_v pi(v)^2`` (the optimal token baselines read it)."""


def response_log_probs(model: SequenceModel, batch: Batch, spec: LogProbSpec, device: torch.device,
                       with_entropy: bool = False) -> Batch:
    """``log_probs`` ``[rows, response_len]`` of each row's response tokens under ``model`` (and ``entropy``, or with
    ``spec.sum_pi_squared`` ``sum_pi_squared``, of the same shape), in micro-batches, without dropout."""
    logps, extra = [], []
    with torch.no_grad(), eval_mode(model.module):  # no dropout (LoRA's) outside the update
        for part in batch.split(spec.micro_batch_size):
            ids, mask = sequences(part)
            args = (ids.to(device), mask.to(device), part["responses"].to(device))
            if spec.sum_pi_squared:
                lp, more = model.response_log_probs_and_sum_pi_squared(*args, temperature=spec.temperature)
            else:
                lp, more = model.response_log_probs(*args, temperature=spec.temperature, with_entropy=with_entropy)
            logps.append(lp.cpu())
            if more is not None:
                extra.append(more.cpu())
    out = {"log_probs": torch.cat(logps)}
    if extra:
        out["sum_pi_squared" if spec.sum_pi_squared else "entropy"] = torch.cat(extra)
    return Batch(out)
