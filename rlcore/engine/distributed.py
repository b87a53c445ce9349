"""torch.distributed set-up for one rank of a worker group, and the few collectives every worker uses.

How a trained model is spread over the ranks (replicated or sharded) is a training strategy:
``rlcore.engine.strategy``.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port that is free on this node right now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, use_gpu: bool,
                       timeout_s: float = 600.0, cpu_collectives: bool = False) -> torch.device:
    """Join the group (gloo on CPU, nccl on GPU) at ``master_addr:master_port`` (rank 0's node, as Ray
    reports it) and return this rank's device. ``cpu_collectives`` (a GPU group whose tensors may live in CPU
    memory: FSDP2's CPU offload) adds gloo for CPU tensors beside nccl for GPU ones."""
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                      RANK=str(rank), WORLD_SIZE=str(world_size))
    if use_gpu:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = ("cpu:gloo,cuda:nccl" if cpu_collectives else "nccl") if use_gpu else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return device


def world_size() -> int:
    """Ranks in the default group; 1 without one (a worker used in-process, as the tests do)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def coalesced(tensors: list[torch.Tensor], collective: Callable[[torch.Tensor], object]) -> None:
    """Run ``collective`` in place on one flat copy of ``tensors`` (all of one dtype and device) and copy
    the result back: one collective instead of one per tensor."""
    if not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    collective(flat)
    for t, synced in zip(tensors, torch.split(flat, [t.numel() for t in tensors])):
        t.copy_(synced.view_as(t))


def all_reduce_mean(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Average scalar metrics over ranks, so rank 0 reports the group's numbers."""
    if not values or not dist.is_initialized():
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return dict(zip(keys, t.tolist()))


def all_reduce_max(x: float, device: torch.device) -> float:
    if not dist.is_initialized():
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_reduce_sum(x: float, device: torch.device) -> float:
    if not dist.is_initialized():
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())
