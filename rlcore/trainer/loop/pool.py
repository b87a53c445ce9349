"""Ray started (or joined) and the resource pool of a stage's ranks placed: what every stage on Ray starts with (the
ones that train run in the job frame of :mod:`rlcore.trainer.loop.job` around it)."""

from __future__ import annotations

from rlcore.config import Config
from rlcore.controller.resource_pool import ResourcePool, start_ray
from rlcore.kernels import activate


def start_pool(cfg: Config) -> ResourcePool:
    """Start (or join) Ray and place the worker ranks' bundles (``resources.placement``); use it as a
    context manager, so the placement group is released whatever happens. Prints which Ray it joined and
    the node of each rank.

    The controller's own tensor work (rewards, advantages, Batch ops) is tiny, so it runs on one
    torch thread: a multi-threaded OpenMP pool here would spin between those small ops on the very
    cores the ranks compute on (measured: 0.2 of a core during every step on 2 cores). It computes with the kernels
    ``resources.cpu_kernels`` chose (rlcore.kernels), as its ranks do."""
    print(f"cpu kernels: {activate(1)}", flush=True)
    print(start_ray(cfg.ray.address, cfg.ray.num_cpus), flush=True)
    r = cfg.resources
    pool = ResourcePool(r.n_workers, r.cpus_per_worker, r.use_gpu, cfg.ray.timeout_s, r.placement)
    print(pool.describe(), flush=True)
    return pool
