"""What every worker rank does first: pin threads, seed, join the process group."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from rlcore import heap, kernels
from rlcore.controller.decorator import RankPlacement
from rlcore.engine import distributed

if TYPE_CHECKING:
    from rlcore.engine.model import ModelSpec
    from rlcore.workers.optim import OptimSpec


class RankWorker:
    """One rank of a worker group; the worker classes add their models and methods."""

    def __init__(self, placement: RankPlacement, seed: int = 0):
        heap.rank_ready()
        if placement.workdir is not None:
            enter_workdir(placement.workdir, type(self).__name__, placement.rank)
        self.rank = placement.rank
        self.world_size = placement.world_size
        self.seed = seed
        kernels.activate(placement.num_threads)
        torch.manual_seed(seed + self.rank)
        self.device = torch.device("cpu")

    def master_address(self) -> tuple[str, int]:
        """Called on rank 0: where the other ranks rendezvous. The address is this node's as Ray
        knows it (the one other nodes of the cluster reach it at), so a group spread over several
        nodes needs no setting; the port is one that is free on this node now."""
        import ray  # a worker only ever runs this inside Ray

        return ray.util.get_node_ip_address(), distributed.free_port()

    def init_distributed(self, master_addr: str, master_port: int, use_gpu: bool, timeout_s: float) -> None:
        # a worker whose trained model is offloaded to the CPU (resources.offload.params) gathers CPU tensors too
        offload = bool(getattr(getattr(self, "model_spec", None), "offload_params", False))
        self.device = distributed.init_process_group(self.rank, self.world_size, master_addr, master_port,
                                                     use_gpu, timeout_s, cpu_collectives=offload)


class TrainingRank(RankWorker):
    """A rank that trains one model with one optimizer (SFT, the critic, a reward model): the model and optimizer
    specs it is built from, for its ``init_model``."""

    def __init__(self, placement: RankPlacement, *, model: ModelSpec, optim: OptimSpec, seed: int = 0):
        super().__init__(placement, seed)
        self.model_spec, self.optim_spec = model, optim


def enter_workdir(workdir: str, worker: str, rank: int) -> None:
    """Work in the driver's folder ``workdir``; where this node has no such folder (a cluster whose nodes do not
    share the project's file system at the same path), say so instead of reading and writing elsewhere."""
    try:
        os.chdir(workdir)
    except OSError as err:
        import ray  # a worker only ever runs this inside Ray

        raise RuntimeError(
            f"{worker} rank {rank} on node {ray.util.get_node_ip_address()}: cannot work in the stage's folder "
            f"{workdir} ({err.strerror}); every node of the cluster needs the project at the same path (a shared "
            "file system), as the stage reads and writes it by relative paths") from None
