"""Optimizer, schedule and one clipped optimizer step for FSDP2 modules."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor


def make_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, warmup_steps: int,
                   total_steps: int | None = None, min_lr_ratio: float = 0.1):
    """AdamW with linear warm-up, then constant (total_steps None) or cosine decay to min_lr_ratio."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if total_steps is None:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def clipped_step(model: torch.nn.Module, opt, sched, grad_clip: float) -> float:
    """Clip the global grad norm, step (skipped when the norm is not finite); return the norm."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    norm = float(norm)
    if math.isfinite(norm):
        opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return norm
