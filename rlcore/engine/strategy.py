"""Training strategies: how a worker group's ranks hold a model they train (``resources.strategy``).

* ``ddp`` (:class:`Replicated`): every rank keeps the whole model and its optimizer state; the
  gradients are averaged over the ranks in one all-reduce of one flat buffer per optimizer step,
  and the rollout copy is refreshed without any collective. No per-module hooks and no DTensor
  dispatch: for a model that fits on a rank this is the faster of the two (``make bench``).
* ``fsdp`` (:class:`Sharded`): FSDP2. Parameters, gradients and optimizer state are sharded over
  the ranks; every forward all-gathers each block, backward reduce-scatters its gradients. The
  model need not fit on one rank.

``fsdp`` can keep parameters, gradients and optimizer state in CPU memory between uses (``resources.offload.params``:
FSDP2's ``CPUOffloadPolicy``; GPU runs only).

Both take an optional compute dtype (``model.dtype`` bfloat16/float16): the weights, gradients,
optimizer state and checkpoints stay float32 and the forward computes in the lower precision
(``Replicated`` through ``torch.autocast`` around each forward, ``Sharded`` through FSDP2's
``MixedPrecisionPolicy``). Every strategy is one class in ``STRATEGIES`` with the same methods;
callers never ask which one they hold.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar, ContextManager, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from rlcore.engine.distributed import coalesced, world_size
from rlcore.registry import Registry


class Strategy(Protocol):
    """How a trained model is spread over a worker group's ranks."""

    shards: ClassVar[bool]
    """Whether parameters are sharded (the ``resources.*reshard_after_forward`` switches apply)."""

    def wrap(self, model: torch.nn.Module, *, reshard_after_forward: bool = False) -> torch.nn.Module:
        """The model ready for data-parallel training on this rank (same weights on every rank)."""

    def autocast(self) -> ContextManager[object]:
        """The context every forward of the wrapped model runs in."""

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Average the gradients over the ranks before the optimizer step. A collective."""

    def rollout_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter and buffer unsharded, in the compute dtype: what a rollout engine loads."""

    def checkpoint_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter and buffer unsharded, in its stored (float32) dtype: what a checkpoint saves."""

    def trainable_state_dict(self, model: torch.nn.Module, *, compute_dtype: bool) -> dict[str, torch.Tensor]:
        """The parameters that train (LoRA: the adapters), unsharded, in the compute dtype (``compute_dtype``: what a
        rollout engine loads) or their stored one. A collective under sharding strategies."""


STRATEGIES: Registry[type[Strategy]] = Registry("training strategy")


def make_strategy(name: str, device: torch.device, compute_dtype: torch.dtype | None = None, *,
                  offload: bool = False) -> Strategy:
    """The strategy registered as ``name`` for models on ``device`` computing in ``compute_dtype``
    (None = the parameters' own dtype); ``offload``: parameters in CPU memory between uses (sharding strategies)."""
    cls = STRATEGIES.get(name)
    if offload:
        if not cls.shards:
            raise ValueError(f"parameter offload needs a sharding strategy, not {name!r}")
        return cls(device=device, compute_dtype=compute_dtype, offload=True)
    return cls(device=device, compute_dtype=compute_dtype)


def _trainable(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


@STRATEGIES.register("ddp")
@dataclass(frozen=True)
class Replicated:
    """DDP: a full replica per rank, one flat gradient all-reduce per optimizer step."""

    device: torch.device
    compute_dtype: torch.dtype | None = None
    shards: ClassVar[bool] = False

    def wrap(self, model: torch.nn.Module, *, reshard_after_forward: bool = False) -> torch.nn.Module:
        """Start every rank from rank 0's weights (one broadcast of one flat buffer per dtype), so a freshly
        initialised head is the same everywhere."""
        if reshard_after_forward:
            raise ValueError("reshard_after_forward applies to a sharding strategy, not ddp")
        if world_size() > 1:
            tensors = [t.data for t in model.state_dict().values()]
            for dtype in sorted({t.dtype for t in tensors}, key=str):
                coalesced([t for t in tensors if t.dtype == dtype], lambda flat: dist.broadcast(flat, src=0))
        return model

    def autocast(self) -> ContextManager[object]:
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """One all-reduce of one flat gradient buffer; a no-op on a single rank."""
        n = world_size()
        if n == 1:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:  # a parameter this rank's loss did not reach still takes part in the sum
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        coalesced([p.grad for p in params], lambda flat: (dist.all_reduce(flat), flat.div_(n)))

    def rollout_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The replica's own tensors (no collective), cast to the compute dtype."""
        dtype = self.compute_dtype
        return {k: v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach()
                for k, v in model.state_dict().items()}

    def checkpoint_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in model.state_dict().items()}

    def trainable_state_dict(self, model: torch.nn.Module, *, compute_dtype: bool) -> dict[str, torch.Tensor]:
        dtype = self.compute_dtype if compute_dtype else None
        return {name: _cast(p.detach(), dtype) for name, p in _trainable(model)}


@STRATEGIES.register("fsdp")
@dataclass(frozen=True)
class Sharded:
    """FSDP2: each transformer block, then the root, sharded over all ranks.

    torch.distributed.fsdp and torch.distributed.tensor are imported in the methods: importing them (sympy, through
    torch.fx's symbolic shapes) takes seconds that a process which never shards a model (a stage's controller, a
    ddp worker) would pay at start-up."""

    device: torch.device
    compute_dtype: torch.dtype | None = None
    offload: bool = False
    """Shards of parameters and gradients (and so the optimizer state) live in CPU memory (``CPUOffloadPolicy``)."""
    shards: ClassVar[bool] = True

    def wrap(self, model: torch.nn.Module, *, reshard_after_forward: bool = False) -> torch.nn.Module:
        """``reshard_after_forward=False`` keeps each block's gathered weights from its forward until its
        backward (``resources.reshard_after_forward``); the root keeps FSDP2's own default, which never
        reshards it after forward."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (world_size(),))
        mp = (MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
              if self.compute_dtype is not None else MixedPrecisionPolicy())
        offload = CPUOffloadPolicy() if self.offload else OffloadPolicy()
        block_names = set(getattr(model, "_no_split_modules", None) or [])
        for module in model.modules():
            if type(module).__name__ in block_names:
                fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                            offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
        return model

    def autocast(self) -> ContextManager[object]:
        return contextlib.nullcontext()  # the MixedPrecisionPolicy casts

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Nothing to do: backward has reduce-scattered the gradients."""

    def rollout_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """One all-gather per FSDP group (``unshard``) rather than one per parameter; the model is resharded
        afterwards. Gathered parameters come in the mixed-precision ``param_dtype``, if any. A collective."""
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

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

    def checkpoint_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The float32 master weights gathered: a collective, one per parameter."""
        from torch.distributed.tensor import DTensor

        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.state_dict().items()}

    def trainable_state_dict(self, model: torch.nn.Module, *, compute_dtype: bool) -> dict[str, torch.Tensor]:
        """One all-gather per trainable parameter (LoRA: small), not the whole model's."""
        from torch.distributed.tensor import DTensor

        dtype = self.compute_dtype if compute_dtype else None
        return {name: _cast((p.full_tensor() if isinstance(p, DTensor) else p).detach(), dtype).to(self.device)
                for name, p in _trainable(model)}
