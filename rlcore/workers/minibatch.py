"""The mini-/micro-batch loop of a PPO actor or critic update, with exact global normalisation.

Each optimizer step covers one mini-batch: this rank's share of a global mini-batch spread over the
data-parallel ranks, run in micro-batches (gradient accumulation). Every loss term is aggregated
with the global mini-batch's token and row counts (``rlcore.algos.aggregation.AggScale``), so summed over
micro-batches and averaged over ranks the gradient is that of the loss over the whole global
mini-batch, whatever each term's aggregation mode and however the batch was split.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch

from rlcore.algos.aggregation import AggScale
from rlcore.engine import distributed
from rlcore.protocol import Batch, Metrics
from rlcore.workers.optim import mean_metrics


@dataclass
class MicroResult:
    """One micro-batch's loss and metrics."""

    loss: torch.Tensor
    """0-dim loss to backpropagate (already this micro-batch's share of the global mini-batch loss)."""
    sums: Metrics = field(default_factory=dict)
    """Summed over a mini-batch's micro-batches (shares of a global loss: the sum, averaged over the
    ranks, is the global value)."""
    means: Metrics = field(default_factory=dict)
    """Averaged over micro-batches (fractions, log-ratios)."""


def minibatch_updates(batch: Batch, *, epochs: int, mini_batch_size: int, micro_batch_size: int,
                      generator: torch.Generator, device: torch.device,
                      micro_loss: Callable[[Batch, AggScale, bool], MicroResult],
                      optimizer_step: Callable[[float], Metrics]) -> list[Metrics]:
    """``epochs`` shuffled passes over this rank's rows, one optimizer step per mini-batch of
    ``mini_batch_size`` rows, gradient accumulation over micro-batches of ``micro_batch_size`` rows.
    Every rank holds as many rows as the others (``Batch.chunk``). ``micro_loss(part, scale, first_minibatch)``:
    ``first_minibatch`` while no optimizer step of this update has run (its forward runs the weights the batch was
    generated with). ``optimizer_step`` gets the global
    mini-batch's loss (the same on every rank: a non-finite loss on any rank makes it non-finite, and
    :func:`~rlcore.workers.optim.clipped_step` skips the step on every rank). Returns one metrics row per
    optimizer step."""
    world = distributed.world_size()
    rows: list[Metrics] = []
    for _ in range(epochs):
        shuffled = batch.select(torch.randperm(len(batch), generator=generator))
        for mini in shuffled.split(mini_batch_size):
            scale = AggScale(tokens=distributed.all_reduce_sum(float(mini["response_mask"].sum()), device),
                             rows=float(len(mini) * world), dp_size=world)
            sums: dict[str, float] = defaultdict(float)
            means: list[Metrics] = []
            loss = 0.0
            for part in mini.split(micro_batch_size):
                result = micro_loss(part, scale, not rows)
                result.loss.backward()
                loss += float(result.loss.detach())
                for k, v in result.sums.items():
                    sums[k] += v
                means.append(result.means)
            global_loss = distributed.all_reduce_sum(loss, device) / world
            rows.append({**sums, **mean_metrics(means), **optimizer_step(global_loss)})
    return rows
