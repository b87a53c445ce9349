"""A group of Ray actors, one per rank, driven as if it were one object.

The controller calls a worker method by naming it on the worker class::

    metrics = actor.call(ActorRolloutRefWorker.update_actor, batch, spec)

``call`` is typed from that method (``ParamSpec``): the arguments are checked against the
worker's signature and the result has the method's return type, so a reader, an IDE or a
type checker follows the call to its definition. The dispatch mode declared on the method
(``@register``) says how the call is split over ranks and how results come back.
``submit`` starts the same call without waiting (each rank runs its calls in order), so a
loop whose next call does not depend on the last result keeps the ranks busy while the
controller logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Concatenate, Generic, ParamSpec, TypeVar, cast

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlcore.controller.decorator import Dispatch, RankPlacement, dispatch_of
from rlcore.controller.resource_pool import ResourcePool
from rlcore.protocol import Batch

W = TypeVar("W")
P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class Pending(Generic[R]):
    """A call started on every rank; ``result`` waits for it and collects as the method declares."""

    group: "WorkerGroup"
    mode: Dispatch
    refs: list

    def result(self) -> R:
        outs = self.group._get(self.refs)
        if self.mode is Dispatch.DP_COMPUTE:
            return cast(R, Batch.concat(outs))
        return outs[0]  # ONE_TO_ALL, DP_UPDATE: the ranks agree (DP_UPDATE ranks all-reduced what they return)


class WorkerGroup(Generic[W]):
    def __init__(self, worker_cls: type[W], pool: ResourcePool, *args: Any, name: str, share: int = 1,
                 timeout_s: float = 600.0, env: dict[str, str] | None = None, **kwargs: Any):
        """Start one ``worker_cls(RankPlacement(...), *args, **kwargs)`` actor per bundle of ``pool`` and
        join them in one process group; ``share`` groups colocated on the pool split its CPUs."""
        self.worker_cls = worker_cls
        self.name = name
        self.world_size = pool.n_workers
        self.timeout_s = timeout_s
        threads = max(1, int(pool.cpus_per_worker))
        remote_cls = ray.remote(worker_cls)
        self.workers = [
            remote_cls.options(
                num_cpus=pool.cpus_per_worker / share,
                num_gpus=(1.0 / share) if pool.use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pool.pg, placement_group_bundle_index=rank),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads), **(env or {})}},
            ).remote(RankPlacement(rank, self.world_size, threads), *args, **kwargs)
            for rank in range(self.world_size)
        ]
        master_addr, master_port = self._get(self.workers[0].master_address.remote())
        self._get([w.init_distributed.remote(master_addr, master_port, pool.use_gpu, timeout_s) for w in self.workers])

    def _get(self, refs):
        return ray.get(refs, timeout=self.timeout_s)

    def call(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run ``method`` (a ``@register``-ed method of the worker class) on the ranks as it declares."""
        return self.submit(method, *args, **kwargs).result()

    def submit(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> Pending[R]:
        """Start ``call(method, ...)`` and return at once; ``.result()`` waits for it."""
        mode = dispatch_of(method)
        name = getattr(method, "__name__", repr(method))
        if mode is None or getattr(self.worker_cls, name, None) is not method:
            raise TypeError(f"{name} is not a @register-ed method of {self.worker_cls.__name__}")
        remote = [getattr(w, name) for w in self.workers]
        if mode is Dispatch.ONE_TO_ALL:
            return Pending(self, mode, [m.remote(*args, **kwargs) for m in remote])
        batch, *rest = args
        if not isinstance(batch, Batch):
            raise TypeError(f"{name} is {mode.name}: its first argument must be a Batch, got {type(batch).__name__}")
        return Pending(self, mode, [m.remote(chunk, *rest, **kwargs)
                                    for m, chunk in zip(remote, batch.chunk(self.world_size))])

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
