"""Optimizer, learning-rate schedule and one clipped optimizer step, for every worker that trains."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from rlcore.engine.sequence import SequenceModel
from rlcore.protocol import Metrics


@dataclass(frozen=True)
class OptimSpec:
    """AdamW and its learning-rate schedule (params.yaml ``sft``/``actor``/``critic``)."""

    lr: float
    weight_decay: float = 0.0
    warmup_steps: int = 0
    """Linear warm-up steps."""
    total_steps: int | None = None
    """None: constant after warm-up; else cosine decay to ``min_lr_ratio * lr`` at ``total_steps``."""
    min_lr_ratio: float = 0.1


def make_optimizer(model: torch.nn.Module, spec: OptimSpec):
    """AdamW with linear warm-up, then constant (total_steps None) or cosine decay to min_lr_ratio.

    foreach: the multi-tensor update, which torch leaves off on CPU (one tensor at a time there).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay, betas=(0.9, 0.999),
                            foreach=True)

    def factor(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        if spec.total_steps is None:
            return 1.0
        progress = min(1.0, (step - spec.warmup_steps) / max(1, spec.total_steps - spec.warmup_steps))
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def clipped_step(model: SequenceModel, opt, sched, grad_clip: float, loss: float) -> tuple[float, bool]:
    """Average gradients over ranks (as the model's strategy does it), clip the global grad norm and step;
    return ``(grad norm, skipped)``. A collective.

    The step is skipped when ``loss`` (the step's global loss, the same on every rank: callers reduce it)
    or the grad norm is NaN or infinite: the gradients are dropped and neither the optimizer nor the
    learning-rate schedule moves, so the weights, the AdamW moments and step count, and the schedule are
    exactly as before (a skipped step leaves no trace; the schedule counts applied steps, as Megatron's
    does). The gradients were averaged over the ranks before the norm (ddp: one all-reduce; fsdp: the
    reduce-scatter of backward, and the norm is a reduction over every shard), so a NaN on any rank reaches
    every rank's norm: every rank takes the same decision."""
    model.strategy.reduce_gradients(model.module)
    norm = torch.nn.utils.clip_grad_norm_(model.module.parameters(), grad_clip)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    norm = float(norm)
    skipped = not (math.isfinite(norm) and math.isfinite(loss))
    if not skipped:
        opt.step()
        sched.step()
    opt.zero_grad(set_to_none=True)
    return norm, skipped


def update_metrics(rows: list[Metrics], prefix: str) -> Metrics:
    """One update's metrics from its optimizer steps' rows: each key's mean, but ``{prefix}/nonfinite_steps``
    (1 on a skipped step) summed: the optimizer steps the update skipped."""
    key = f"{prefix}/nonfinite_steps"
    return {**mean_metrics(rows), key: float(sum(r.get(key, 0.0) for r in rows))}


def mean_metrics(rows: list[Metrics]) -> Metrics:
    """Each key's mean over the rows that have it."""
    keys = {k for r in rows for k in r}
    return {k: sum(float(r[k]) for r in rows if k in r) / sum(1 for r in rows if k in r) for k in keys}
