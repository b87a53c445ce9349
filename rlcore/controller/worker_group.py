"""A group of Ray actors, one per rank, driven as if it were one object.

Every method a worker class marks with ``@register(...)`` becomes a method of the
group that dispatches to all ranks, waits with a timeout and collects as declared.
"""

from __future__ import annotations

import functools
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlcore.controller.decorator import DISPATCH_ATTR, Dispatch
from rlcore.controller.resource_pool import ResourcePool
from rlcore.protocol import Batch


class WorkerGroup:
    def __init__(self, worker_cls: type, pool: ResourcePool, *, name: str, share: int = 1,
                 timeout_s: float = 600.0, env: dict[str, str] | None = None, **init_kwargs: Any):
        """Start one actor per bundle of ``pool``; ``share`` groups colocated on it split its CPUs."""
        self.name = name
        self.world_size = pool.n_workers
        self.timeout_s = timeout_s
        threads = max(1, int(pool.cpus_per_worker))
        remote_cls = ray.remote(worker_cls)
        self.workers = [
            remote_cls.options(
                name=None,
                num_cpus=pool.cpus_per_worker / share,
                num_gpus=(1.0 / share) if pool.use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pool.pg, placement_group_bundle_index=rank),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads), **(env or {})}},
            ).remote(rank=rank, world_size=self.world_size, num_threads=threads, **init_kwargs)
            for rank in range(self.world_size)
        ]
        master_addr, master_port = self._get(self.workers[0].master_address.remote())
        self._get([w.init_distributed.remote(master_addr, master_port, pool.use_gpu, timeout_s) for w in self.workers])
        self._bind_registered_methods(worker_cls)

    def _get(self, refs):
        return ray.get(refs, timeout=self.timeout_s)

    def _bind_registered_methods(self, worker_cls: type) -> None:
        for attr in dir(worker_cls):
            mode = getattr(getattr(worker_cls, attr, None), DISPATCH_ATTR, None)
            if mode is not None:
                setattr(self, attr, functools.partial(self._call, attr, mode))

    def _call(self, method: str, mode: Dispatch, *args: Any, **kwargs: Any) -> Any:
        if mode is Dispatch.DP_COMPUTE:
            (batch,) = args
            refs = [getattr(w, method).remote(chunk, **kwargs)
                    for w, chunk in zip(self.workers, batch.chunk(self.world_size))]
            return Batch.concat(self._get(refs))
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        return self._get(refs)[0]

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
