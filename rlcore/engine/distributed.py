"""torch.distributed set-up for one rank of a worker group, and the two data-parallel strategies
a trained model is wrapped with (``resources.strategy``):

* ``fsdp``: FSDP2 (``shard``). Parameters, gradients and optimizer state are sharded over the
  ranks; every forward all-gathers each block, backward reduce-scatters its gradients. The model
  need not fit on one rank.
* ``ddp``: plain replication (``replicate``). Every rank holds the whole model and its optimizer
  state; the gradients are averaged over the ranks in one all-reduce of one flat buffer per
  optimizer step (``reduce_gradients``), and the rollout copy is refreshed without any collective.
  No per-module hooks and no DTensor dispatch: for a model that fits on a rank this is the
  faster of the two (``make bench`` measures both).
"""

from __future__ import annotations

import functools
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def free_port() -> int:
    """A TCP port that is free on this node right now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_address() -> str:
    return socket.gethostbyname(socket.gethostname()) if os.environ.get("RLCORE_MULTI_NODE") else "127.0.0.1"


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, use_gpu: bool,
                       timeout_s: float = 600.0) -> torch.device:
    """Join the group (gloo on CPU, nccl on GPU) and return this rank's device."""
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                      RANK=str(rank), WORLD_SIZE=str(world_size))
    if use_gpu:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_gpu else "gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    return device


def shard(model: torch.nn.Module, device: torch.device, param_dtype: torch.dtype | None = None, *,
          reshard_after_forward: bool = True) -> torch.nn.Module:
    """FSDP2: shard each transformer block, then the root, over all ranks.

    ``reshard_after_forward=False`` keeps each block's gathered weights from its forward until its
    backward (see ``resources.reshard_after_forward``); the root keeps FSDP2's own default, which
    never reshards it after forward.
    """
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else MixedPrecisionPolicy()
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in block_names:
            fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def replicate(model: torch.nn.Module, device: torch.device, param_dtype: torch.dtype | None = None
              ) -> torch.nn.Module:
    """DDP: every rank keeps the whole model, starting from rank 0's weights (one broadcast of one flat
    buffer, so a freshly initialised head is the same everywhere). With ``param_dtype`` the forward
    runs under autocast to that dtype; the weights, gradients and optimizer state stay float32."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        tensors = [t.data for t in model.state_dict().values()]
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            _coalesced([t for t in tensors if t.dtype == dtype], lambda flat: dist.broadcast(flat, src=0))
    if param_dtype is not None:
        forward = model.forward

        @functools.wraps(forward)
        def autocast_forward(*args, **kwargs):
            with torch.autocast(device.type, dtype=param_dtype):
                return forward(*args, **kwargs)

        model.forward = autocast_forward
    model._rlcore_compute_dtype = param_dtype
    return model


def wrap(strategy: str, model: torch.nn.Module, device: torch.device, param_dtype: torch.dtype | None = None, *,
         reshard_after_forward: bool = False) -> torch.nn.Module:
    """The model wrapped for ``resources.strategy`` (``fsdp`` or ``ddp``; see the module docstring)."""
    if strategy == "ddp":
        return replicate(model, device, param_dtype)
    return shard(model, device, param_dtype, reshard_after_forward=reshard_after_forward)


def reduce_gradients(model: torch.nn.Module) -> None:
    """Average a replicated model's gradients over the ranks: one all-reduce of one flat buffer. A
    no-op for FSDP2 modules (backward has reduce-scattered them) and for a single rank. Collective."""
    if isinstance(model, FSDPModule) or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # a parameter this rank's loss did not reach still takes part in the sum
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    world = dist.get_world_size()
    _coalesced([p.grad for p in params], lambda flat: (dist.all_reduce(flat), flat.div_(world)))


def _coalesced(tensors: list[torch.Tensor], collective) -> None:
    """Run ``collective`` in place on one flat copy of ``tensors`` (all of one dtype) and copy the
    result back: one collective instead of one per tensor."""
    flat = torch._utils._flatten_dense_tensors(tensors)
    collective(flat)
    for t, synced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
        t.copy_(synced)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer unsharded on every rank, in the dtype the forward computes in
    (the mixed-precision ``param_dtype``, if any): what the rollout engine loads. A collective.

    One all-gather per FSDP group (``unshard``) rather than one per parameter; the model is
    resharded afterwards. A replicated model (``replicate``) already holds them: no collective.
    """
    if not isinstance(model, FSDPModule):
        dtype = getattr(model, "_rlcore_compute_dtype", None)
        return {k: v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach()
                for k, v in model.state_dict().items()}
    state = model.state_dict()  # FSDP reshards first: parameters are DTensor shards here, buffers plain
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in groups:
        m.unshard()
    try:
        gathered = dict(model.named_parameters(remove_duplicate=False))  # tied weights under each name
        # clone: reshard() frees the gathered storage
        return {k: (gathered[k] if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}
    finally:
        for m in groups:
            m.reshard()


def checkpoint_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer unsharded on every rank in its stored dtype (the float32 master
    weights, also under mixed precision): what a checkpoint saves. A collective, one per parameter."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.state_dict().items()}


def all_reduce_mean(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Average scalar metrics over ranks, so rank 0 reports the group's numbers."""
    if not values or not dist.is_initialized():
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return dict(zip(keys, t.tolist()))


def all_reduce_sum(x: float, device: torch.device) -> float:
    if not dist.is_initialized():
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())
