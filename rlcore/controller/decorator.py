"""Worker methods declare how a call is split over ranks and how results come back.

    class ActorWorker:
        @register(Dispatch.DP_COMPUTE)
        def compute_log_prob(self, batch: Batch) -> Batch: ...

A :class:`~rlcore.controller.worker_group.WorkerGroup` reads the declaration and, for
``DP_COMPUTE``, splits the Batch into one equal chunk per rank and concatenates the
returned Batches; for ``ONE_TO_ALL`` it sends the same arguments to every rank and
returns rank 0's result (ranks agree, having all-reduced what they report).
"""

from __future__ import annotations

from enum import Enum
from typing import Callable

DISPATCH_ATTR = "_rlcore_dispatch"


class Dispatch(Enum):
    ONE_TO_ALL = "one_to_all"
    DP_COMPUTE = "dp_compute"


def register(mode: Dispatch) -> Callable:
    def decorator(fn: Callable) -> Callable:
        setattr(fn, DISPATCH_ATTR, mode)
        return fn

    return decorator
