"""Optimizer, learning-rate schedule and one clipped optimizer step, for every worker that trains."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlcore.engine.sequence import SequenceModel
from rlcore.protocol import Metrics

if TYPE_CHECKING:
    from rlcore.config import OptimizerSettings


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
    offload: bool = False
    """The AdamW state lives in CPU memory between optimizer steps (``resources.offload.optimizer``; GPU runs)."""

    @classmethod
    def of(cls, section: OptimizerSettings, *, offload: bool, warmup_steps: int = 0,
           total_steps: int | None = None) -> OptimSpec:
        """The optimizer of a params section that trains a model (``sft``, ``rm``, ``actor``, ``critic``); the
        schedule is the caller's, since ``warmup_steps`` means another thing in ``critic``."""
        return cls(lr=section.lr, weight_decay=section.weight_decay, warmup_steps=warmup_steps,
                   total_steps=total_steps, offload=offload)


def make_optimizer(model: torch.nn.Module, spec: OptimSpec):
    """AdamW over the parameters that train (all of them, or a LoRA adapter's) with linear warm-up, then constant
    (total_steps None) or cosine decay to min_lr_ratio.

    foreach: the multi-tensor update, which torch leaves off on CPU (one tensor at a time there).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, betas=(0.9, 0.999), foreach=True)

    def factor(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        if spec.total_steps is None:
            return 1.0
        progress = min(1.0, (step - spec.warmup_steps) / max(1, spec.total_steps - spec.warmup_steps))
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def clipped_step(model: SequenceModel, opt, sched, grad_clip: float, loss: float, *,
                 offload: bool = False) -> tuple[float, bool]:
    """Average gradients over ranks (as the model's strategy does it), clip the global grad norm and step;
    return ``(grad norm, skipped)``. A collective.

    The step is skipped when ``loss`` (the step's global loss, the same on every rank: callers reduce it)
    or the grad norm is NaN or infinite: the gradients are dropped and neither the optimizer nor the
    learning-rate schedule moves, so the weights, the AdamW moments and step count, and the schedule are
    exactly as before (a skipped step leaves no trace; the schedule counts applied steps, as Megatron's
    does). The gradients were averaged over the ranks before the norm (ddp: one all-reduce; fsdp: the
    reduce-scatter of backward, and the norm is a reduction over every shard), so a NaN on any rank reaches
    every rank's norm: every rank takes the same decision. ``offload``: the optimizer state lives on the CPU
    outside the step (:func:`move_optimizer_state`)."""
    from torch.distributed.tensor import DTensor  # here, not at the top: seconds to import, for the fsdp case only

    model.strategy.reduce_gradients(model.module)
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.module.parameters() if p.requires_grad], grad_clip)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    norm = float(norm)
    skipped = not (math.isfinite(norm) and math.isfinite(loss))
    if not skipped:
        if offload:  # the state comes to the parameters' device for the step only
            move_optimizer_state(opt, None)
        opt.step()
        if offload:
            move_optimizer_state(opt, torch.device("cpu"))
        sched.step()
    opt.zero_grad(set_to_none=True)
    return norm, skipped


def move_optimizer_state(opt, device: torch.device | None) -> None:
    """Move every tensor of the optimizer's state to ``device`` (None: each to its parameter's device), keeping the
    step counts where AdamW keeps them: the optimizer offload's round trip."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            for key, value in (state or {}).items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(p.device if device is None else device, non_blocking=True)


def update_metrics(rows: list[Metrics], prefix: str) -> Metrics:
    """One update's metrics from its optimizer steps' rows: each key's mean, but ``{prefix}/nonfinite_steps``
    (1 on a skipped step) summed: the optimizer steps the update skipped."""
    key = f"{prefix}/nonfinite_steps"
    return {**mean_metrics(rows), key: float(sum(r.get(key, 0.0) for r in rows))}


def mean_metrics(rows: list[Metrics]) -> Metrics:
    """Each key's mean over the rows that have it."""
    keys = {k for r in rows for k in r}
    return {k: sum(float(r[k]) for r in rows if k in r) / sum(1 for r in rows if k in r) for k in keys}
