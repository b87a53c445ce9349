"""What every worker rank does first: pin threads, seed, join the process group."""

from __future__ import annotations

import torch

from rlcore.engine import distributed


class RankWorker:
    """One rank of a worker group; subclasses add roles (actor, critic)."""

    def __init__(self, rank: int, world_size: int, num_threads: int, seed: int = 0):
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        torch.set_num_threads(num_threads)
        torch.manual_seed(seed + rank)
        self.device = torch.device("cpu")

    def master_address(self) -> tuple[str, int]:
        """Called on rank 0: where the other ranks rendezvous."""
        return distributed.node_address(), distributed.free_port()

    def init_distributed(self, master_addr: str, master_port: int, use_gpu: bool, timeout_s: float) -> None:
        self.device = distributed.init_process_group(self.rank, self.world_size, master_addr, master_port,
                                                     use_gpu, timeout_s)
