"""Ray start-up and resource pools (one placement group bundle per rank)."""

from __future__ import annotations

import logging
import os

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

log = logging.getLogger(__name__)


def start_ray(address: str, num_cpus: int) -> str:
    """Start a private local Ray instance or join ``address``; return a line saying which."""
    if ray.is_initialized():
        return "ray: already initialised in this process"
    if address == "local":
        # Ray starts its worker processes 15 nice levels below the driver; the ranks do the compute, so on
        # a shared machine they would lose the CPU to everything else. A user's own setting wins.
        os.environ.setdefault("RAY_worker_niceness", "0")
        # address=None with RAY_ADDRESS unset would still attach to a running `ray start`; "local" never does.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
                 configure_logging=False)
    else:
        ray.init(address=address, log_to_driver=True, configure_logging=False)
    res = ray.cluster_resources()
    return f"ray: joined {address} with {res.get('CPU', 0):g} CPUs, {res.get('GPU', 0):g} GPUs"


class ResourcePool:
    """``n_workers`` bundles of {CPU: cpus_per_worker (, GPU: 1)}; worker groups may share it.
    As a context manager it releases its placement group on the way out, whatever happened."""

    def __init__(self, n_workers: int, cpus_per_worker: float, use_gpu: bool, timeout_s: float):
        self.n_workers = n_workers
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        bundle = {"CPU": cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
        self.pg: PlacementGroup = placement_group([dict(bundle) for _ in range(n_workers)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise RuntimeError(
                f"resources: {n_workers} bundles of {bundle} did not fit in {timeout_s:g}s; "
                f"cluster has {ray.cluster_resources()} (lower resources.n_workers or cpus_per_worker)"
            ) from None

    def release(self) -> None:
        remove_placement_group(self.pg)

    def __enter__(self) -> "ResourcePool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
