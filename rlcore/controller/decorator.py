"""What a worker class shares with its worker group: where a rank sits (:class:`RankPlacement`, its
constructor's first argument) and how each method is dispatched (``@register``).

Worker methods declare how a call is split over ranks and how results come back.

    class ActorRolloutRefWorker(RankWorker):
        @register(Dispatch.DP_COMPUTE)
        def compute_log_prob(self, batch: Batch, spec: LogProbSpec) -> Batch: ...

and the controller calls it through its worker group, naming the method itself, so a reader
(and a type checker) goes from the call site straight to this definition::

    old = actor.call(ActorRolloutRefWorker.compute_log_prob, batch, spec)

:class:`~rlcore.controller.worker_group.WorkerGroup` reads the declaration:

* ``DP_COMPUTE``: the Batch (first argument) is split into one equal chunk per rank, the other
  arguments go to every rank, and the returned Batches are concatenated in rank order;
* ``DP_UPDATE``: split the same way, but the ranks all-reduce what they return (an update's
  metrics), so rank 0's result is the group's;
* ``ONE_TO_ALL``: the same arguments to every rank; rank 0's result is returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, TypeVar

DISPATCH_ATTR = "_rlcore_dispatch"

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class RankPlacement:
    """Where one actor of a worker group sits: its rank, the group size, its torch threads, and the folder it works
    in."""

    rank: int
    world_size: int
    num_threads: int = 1
    workdir: str | None = None
    """The driver's working folder, so that a relative path in the params (``models/sft``) names the same folder on
    every rank. Ray starts an actor in its node's own folder (on a joined cluster, wherever ``ray start`` ran), not
    the driver's. None: left where Ray started it."""


class Dispatch(Enum):
    ONE_TO_ALL = "one_to_all"
    DP_COMPUTE = "dp_compute"
    DP_UPDATE = "dp_update"


def register(mode: Dispatch) -> Callable[[F], F]:
    def decorator(fn: F) -> F:
        setattr(fn, DISPATCH_ATTR, mode)
        return fn

    return decorator


def dispatch_of(method: Callable) -> Dispatch | None:
    """The dispatch mode ``method`` was registered with, or None."""
    return getattr(method, DISPATCH_ATTR, None)
