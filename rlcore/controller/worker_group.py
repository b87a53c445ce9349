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

A rank lost during a call (its process killed or crashed, its node gone) ends the call with
:class:`~rlcore.errors.WorkerDied`, naming the group, the rank and the method, as soon as Ray
reports it; the group's other actors are killed first, so a rank blocked in a collective with the
dead one never keeps the controller waiting.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Concatenate, Generic, ParamSpec, TypeVar, cast

import ray
from ray.exceptions import (
    ActorUnavailableError,
    GetTimeoutError,
    NodeDiedError,
    ObjectLostError,
    RayActorError,
    RayError,
    WorkerCrashedError,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlcore.controller.decorator import Dispatch, RankPlacement, dispatch_of
from rlcore.controller.resource_pool import ResourcePool, rank_env
from rlcore.errors import WorkerDied
from rlcore.protocol import Batch

W = TypeVar("W")
P = ParamSpec("P")
R = TypeVar("R")

# A rank that died takes its collective peers down with it, and a peer's error (gloo: connection closed)
# can reach the controller before Ray's word of the death does: that long is given to the other ranks'
# results to show a death (measured: 0.02-2 s after a SIGKILL, on one node and across two).
DEATH_GRACE_S = 5.0
LOST = (RayActorError, WorkerCrashedError, NodeDiedError, ObjectLostError)


def is_lost(err: BaseException) -> bool:
    """Whether ``err`` (what ``ray.get`` raised for one rank) says the rank itself is gone, as opposed to
    an exception its code raised (a bug, which keeps its traceback), or to its ``__init__`` failing."""
    return isinstance(err, LOST) and not getattr(err, "actor_init_failed", False)


@dataclass
class Pending(Generic[R]):
    """A call started on every rank; ``result`` waits for it and collects as the method declares."""

    group: "WorkerGroup"
    mode: Dispatch
    refs: list
    method: str

    def done(self) -> bool:
        """Whether every rank has finished (or failed): ``result`` then returns (or raises) at once."""
        return len(ray.wait(self.refs, num_returns=len(self.refs), timeout=0)[0]) == len(self.refs)

    def result(self) -> R:
        outs = self.group._get(self.refs, self.method)
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
        self.pool = pool
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
                runtime_env={"env_vars": {**rank_env(threads), **(env or {})}},
            ).remote(RankPlacement(rank, self.world_size, threads, workdir=os.getcwd()), *args, **kwargs)
            for rank in range(self.world_size)
        ]
        master_addr, master_port = self._get([self.workers[0].master_address.remote()], "master_address")[0]
        self._get([w.init_distributed.remote(master_addr, master_port, pool.use_gpu, timeout_s) for w in self.workers],
                  "init_distributed")

    def _get(self, refs: list, method: str) -> list:
        """The results of ``refs`` (``refs[i]`` is rank i's call of ``method``); a lost rank raises
        :class:`WorkerDied` after the group's actors are killed."""
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except GetTimeoutError:
            raise
        except RayError as err:
            lost = _lost_rank(refs, first=err)
            if lost is None and is_lost(err):  # Ray said a rank is gone but not yet whose result: by actor id
                ids = [w._actor_id.hex() for w in self.workers]
                lost = (ids.index(err.actor_id), err) if getattr(err, "actor_id", None) in ids else None
            if lost is None:
                raise
            rank, death = lost
            cause = self._cause(rank, death)
            self.shutdown()
            raise WorkerDied(self.name, rank, method, cause) from death

    def _cause(self, rank: int, death: BaseException) -> str:
        """What happened to ``rank``, in a few words, with its node (from the placement group table)."""
        try:
            node_id, ip = self.pool.rank_nodes()[rank]
            alive = {n["NodeID"]: n.get("Alive") for n in ray.nodes()}.get(node_id, False)
        except Exception:  # the description must never hide the death itself
            node_id, ip, alive = "?", "?", True
        text, node = str(death), f"node {ip} [{node_id[:8]}]"
        if isinstance(death, NodeDiedError) or not alive or "node has died" in text:
            return f"{node} lost"
        if isinstance(death, ActorUnavailableError):
            return f"unreachable: its process or its {node} is gone"
        if isinstance(death, ObjectLostError):
            return f"its result was lost with {node}"
        pid = re.search(r"\bpid: (\d+)", text)
        return f"process {pid.group(1) if pid else '?'} on {node} ended: killed, crashed or out of memory"

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
            return Pending(self, mode, [m.remote(*args, **kwargs) for m in remote], name)
        batch, *rest = args
        if not isinstance(batch, Batch):
            raise TypeError(f"{name} is {mode.name}: its first argument must be a Batch, got {type(batch).__name__}")
        return Pending(self, mode, [m.remote(chunk, *rest, **kwargs)
                                    for m, chunk in zip(remote, batch.chunk(self.world_size))], name)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)


def _lost_rank(refs: list, first: BaseException) -> tuple[int, BaseException] | None:
    """The lowest rank whose result says it is gone, and Ray's error for it; None when no rank is
    gone. ``first`` is the error ``ray.get`` raised: when it is not a death itself, the other ranks get
    :data:`DEATH_GRACE_S` to show one (their errors may follow from it)."""
    deadline = time.monotonic() + (1.0 if is_lost(first) else DEATH_GRACE_S)
    checked: set[int] = set()
    while True:
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        for rank, ref in enumerate(refs):
            if rank in checked or ref not in ready:
                continue
            checked.add(rank)
            try:
                ray.get(ref)
            except Exception as err:
                if is_lost(err):
                    return rank, err
        if len(checked) == len(refs) or time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
