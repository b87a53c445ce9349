"""Optimizer, schedule and one clipped optimizer step for FSDP2 or replicated (DDP) modules."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from rlcore.engine.distributed import reduce_gradients


def make_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, warmup_steps: int,
                   total_steps: int | None = None, min_lr_ratio: float = 0.1):
    """AdamW with linear warm-up, then constant (total_steps None) or cosine decay to min_lr_ratio.

    foreach: the multi-tensor update, which torch leaves off on CPU (one tensor at a time there).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999), foreach=True)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if total_steps is None:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def clipped_step(model: torch.nn.Module, opt, sched, grad_clip: float) -> float:
    """Average gradients over ranks (replicated models; FSDP has done it in backward), clip the global
    grad norm, step (skipped when the norm is not finite); return the norm. A collective."""
    reduce_gradients(model)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    norm = float(norm)
    if math.isfinite(norm):
        opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return norm


def micro_weight(part_tokens: float, part_rows: int, mini_rows: int, global_tokens: float, agg_mode: str,
                 world_size: int) -> float:
    """Scale of a micro-batch loss so that the summed, rank-averaged (FSDP or DDP) gradient equals
    the gradient of the loss aggregated over the whole global mini-batch.

    token-mean weighs a micro-batch by its share of the mini-batch's tokens on all ranks;
    the sequence-mean modes by its share of rows (ranks hold equal row counts).
    """
    if agg_mode == "token-mean":
        return part_tokens / max(global_tokens, 1.0) * world_size
    return part_rows / mini_rows


def minibatch_updates(batch, *, epochs: int, mini_batch_size: int, micro_batch_size: int, agg_mode: str,
                      generator: torch.Generator, world_size: int, global_sum: Callable[[float], float],
                      micro_loss: Callable, optimizer_step: Callable[[], dict]) -> list[dict]:
    """PPO-style updates: ``epochs`` shuffled passes, one optimizer step per mini-batch,
    gradient accumulation over micro-batches. Returns the per-micro/per-step metric rows."""
    rows = []
    for _ in range(epochs):
        shuffled = batch.select(torch.randperm(len(batch), generator=generator))
        for mini in shuffled.split(mini_batch_size):
            global_tokens = global_sum(float(mini["response_mask"].sum()))
            for part in mini.split(micro_batch_size):
                loss, metrics = micro_loss(part)
                weight = micro_weight(float(part["response_mask"].sum()), len(part), len(mini), global_tokens,
                                      agg_mode, world_size)
                (loss * weight).backward()
                rows.append(metrics)
            rows.append(optimizer_step())
    return rows
