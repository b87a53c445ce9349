"""What an asynchronous round's generators and trainer share on Ray: the bounded queue of generated batches, the
versioned policy weights, and the generator actors themselves (started, watched, restarted).

* :class:`BatchQueue` is ``ray.util.queue.Queue`` (an actor) with ``ppo.async.queue_size`` slots: a
  generator's ``put`` of a finished step batch blocks while it is full (back-pressure); the controller takes
  batches in arrival order. A batch travels through it pickled (:func:`BatchQueue.put`), so the queue actor
  holds bytes and never imports torch to read what it only passes on.
* :class:`WeightVersions` (``rlcore.controller.weight_versions``, a module without torch) is a small actor
  holding the published policies as ``(version, [ref])``: the trainer's rank 0 puts its unsharded weights
  into the object store once per update and the controller publishes the reference with the version. A
  generator asks for anything newer than what it holds before each batch (or, for a batch that names its version,
  for exactly that one: ``ppo.async.schedule fixed``) and loads the whole object: an object in the store is
  immutable and complete once put, so a generator never sees a half-updated copy, and an old version stays
  readable while the actor keeps it.
* :class:`GeneratorPool` starts ``rollout.n_workers`` generator actors on their own placement group (one
  bundle each), hands them work, notices a dead one as soon as Ray reports it, and restarts it in its bundle
  up to a limit; :meth:`GeneratorPool.shutdown` kills the actors, the queue and the version actor and removes
  the placement group.

Work goes to a generator as a worker group's calls go to its ranks: ``pool.submit(GeneratorWorker.generate_item,
item, spec)`` names the method on the worker class and is typed from it (``ParamSpec``), so a type checker
follows the call to the method and refuses the wrong settings object.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Concatenate, Generic, ParamSpec, Protocol, TypeVar

import ray
from ray import cloudpickle
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.queue import Queue
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlcore.controller.decorator import RankPlacement
from rlcore.controller.resource_pool import PLACEMENT_STRATEGIES, rank_env
from rlcore.controller.weight_versions import WeightVersions
from rlcore.controller.worker_group import is_lost
from rlcore.errors import WorkerDied
from rlcore.protocol import Batch

P = ParamSpec("P")


@dataclass(frozen=True)
class WorkItem:
    """One step batch to generate: the prompts (repeated for groups), the seed of the sampling call and an id
    (the order the controller started items in)."""

    id: int
    prompts: Batch
    seed: int
    version: int | None = None
    """The policy version to generate it with, exactly (``ppo.async.schedule fixed``); None: the newest published."""


@dataclass
class GeneratedBatch:
    """A generated step batch as it comes out of the queue."""

    item_id: int
    version: int
    """The policy version that generated it (with partial rollouts, its first tokens: ``batch["token_versions"]``
    holds each token's)."""
    batch: Batch
    generator: int
    gen_s: float
    """Seconds the generator spent loading weights and generating it."""


class BatchQueue:
    """The bounded queue of generated step batches (``ray.util.queue.Queue``, an actor of its own). The controller
    keeps one ``get`` outstanding on it, so it can wait for the next batch and for other calls at once
    (``ray.wait``) without polling the queue actor.

    Batches go in as pickled bytes (:meth:`put`): Ray hands a queued value to the queue actor's method
    deserialized, and a batch of tensors would make that actor import torch (seconds of CPU per round) only to
    pass the tensors on. The bytes are Ray's own cloudpickle, as Ray would have made them: a batch may hold what
    plain pickle refuses (objects of a class that no module can import, as from a reward file loaded by path)."""

    def __init__(self, size: int):
        self.queue = Queue(maxsize=size, actor_options={"num_cpus": 0})
        self._taking = None  # the outstanding get: resolves to the next batch out of the queue

    @staticmethod
    def put(queue: Queue, generated: GeneratedBatch) -> None:
        """Put ``generated`` into ``queue`` (the ``ray.util.queue.Queue`` a generator is given), blocking while it is
        full."""
        queue.put(cloudpickle.dumps(generated, protocol=pickle.HIGHEST_PROTOCOL), block=True)

    def get(self, timeout_s: float, also: list | tuple = ()) -> GeneratedBatch | None:
        """The next batch; None after ``timeout_s``, or as soon as one of the object refs ``also`` is ready."""
        if self._taking is None:
            self._taking = self.queue.actor.get.remote(None)
        ready, _ = ray.wait([self._taking, *also], num_returns=1, timeout=timeout_s)
        if not ready or ready[0] != self._taking:
            return None
        ref, self._taking = self._taking, None
        return pickle.loads(ray.get(ref))

    def depth(self) -> int:
        """Batches generated and not yet taken by the controller: those in the queue, and the one its outstanding
        ``get`` already took out of it, if that get has finished."""
        taken = self._taking is not None and bool(ray.wait([self._taking], timeout=0)[0])
        return self.queue.qsize() + taken

    def shutdown(self) -> None:
        self.queue.shutdown(force=True)


class Generator(Protocol):
    """What the pool itself calls on a generator actor."""

    def init_model(self) -> None: ...

    def pid(self) -> int: ...


G = TypeVar("G", bound=Generator)


@dataclass(frozen=True)
class _Call:
    """A call handed to a generator: the method's name and its arguments, kept to send it again."""

    method: str
    args: tuple
    kwargs: dict[str, Any]


@dataclass
class _Slot:
    """One generator bundle: its actor, the calls it is working on (in order) and their result refs."""

    actor: Any = None
    calls: list[_Call] = field(default_factory=list)
    refs: list = field(default_factory=list)
    alive: bool = True


class GeneratorPool(Generic[G]):
    """``n`` generator actors of ``worker_cls`` (``worker_cls(RankPlacement, index=..., queue=..., weights=...,
    **kwargs)``) on a placement group of ``n`` bundles of ``{CPU: cpus_per_worker (, GPU: 1)}``.

    :meth:`submit` gives a call to the least busy live generator; :meth:`poll` collects finished calls,
    detects dead generators and restarts them (their unfinished calls go to the restarted actor, so none is
    lost), or retires them once ``max_restarts`` restarts were spent."""

    def __init__(self, worker_cls: type[G], n: int, cpus_per_worker: float, use_gpu: bool, *, queue_size: int,
                 max_restarts: int, timeout_s: float, placement: str = "pack", **kwargs: Any):
        self.worker_cls, self.remote_cls, self.kwargs = worker_cls, ray.remote(worker_cls), kwargs
        self.cpus, self.use_gpu, self.timeout_s = cpus_per_worker, use_gpu, timeout_s
        self.max_restarts, self.restarts, self.deaths = max_restarts, 0, 0
        self.busy_s = 0.0  # generation seconds reported by finished items
        self.queue = BatchQueue(queue_size)
        self.weights = ray.remote(num_cpus=0)(WeightVersions).remote()
        bundle = {"CPU": cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
        self.pg = placement_group([dict(bundle) for _ in range(n)], strategy=PLACEMENT_STRATEGIES[placement])
        self.slots = [_Slot() for _ in range(n)]
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
            for i in range(n):
                self._start(i)
            ray.get([s.actor.init_model.remote() for s in self.slots], timeout=timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, index: int) -> None:
        threads = max(1, int(self.cpus))
        self.slots[index].actor = self.remote_cls.options(
            num_cpus=self.cpus, num_gpus=1 if self.use_gpu else 0, max_concurrency=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                 placement_group_bundle_index=index),
            runtime_env={"env_vars": rank_env(threads)},
        ).remote(RankPlacement(0, 1, threads, workdir=os.getcwd()), index=index, queue=self.queue.queue,
                 weights=self.weights, use_gpu=self.use_gpu, **self.kwargs)

    # ------------------------------------------------------------------ work
    @property
    def alive(self) -> int:
        return sum(s.alive for s in self.slots)

    def submit(self, method: Callable[Concatenate[G, P], float], *args: P.args, **kwargs: P.kwargs) -> None:
        """Run ``method`` (a method of the generator class that returns its busy seconds) on the live generator
        with the fewest unfinished calls."""
        name = getattr(method, "__name__", repr(method))
        if getattr(self.worker_cls, name, None) is not method:
            raise TypeError(f"{name} is not a method of {self.worker_cls.__name__}")
        self._assign(_Call(name, args, kwargs))

    def _assign(self, call: _Call) -> None:
        live = [i for i, s in enumerate(self.slots) if s.alive]
        if not live:
            raise RuntimeError("no generator left")
        self._send(min(live, key=lambda i: (len(self.slots[i].calls), i)), call)

    def _send(self, index: int, call: _Call) -> None:
        slot = self.slots[index]
        slot.calls.append(call)
        slot.refs.append(getattr(slot.actor, call.method).remote(*call.args, **call.kwargs))

    def publish(self, version: int, ref: list, keep_from: int | None = None) -> None:
        """Make ``ref`` (``[object ref]`` of a policy's packed weights, as the trainer's rank 0 returns it) the
        newest policy, as ``version``; the versions from ``keep_from`` on stay readable (default: this one only)."""
        ray.get(self.weights.publish.remote(version, ref, keep_from))

    def poll(self) -> list[str]:
        """Collect the calls that finished; a generator whose call failed because it is gone is restarted (and
        given back its unfinished items) or retired. Returns one line per death. A generator's own exception
        (a bug) is raised with its traceback."""
        events = []
        for index, slot in enumerate(self.slots):
            while slot.alive and slot.refs:
                ready, _ = ray.wait(slot.refs[:1], timeout=0)
                if not ready:
                    break
                try:
                    self.busy_s += ray.get(ready[0])
                except Exception as err:
                    if not is_lost(err):
                        raise
                    events.append(self._died(index))
                    break
                slot.refs.pop(0)
                slot.calls.pop(0)
        return events

    def _died(self, index: int) -> str:
        slot = self.slots[index]
        self.deaths += 1
        lost = list(slot.calls)
        slot.calls, slot.refs = [], []
        ray.kill(slot.actor)
        if self.restarts < self.max_restarts:
            self.restarts += 1
            self._start(index)
            ray.get(slot.actor.init_model.remote(), timeout=self.timeout_s)
            for call in lost:
                self._send(index, call)
            return (f"generator {index} died; restarted it ({self.restarts} of ppo.async.max_generator_restarts "
                    f"{self.max_restarts}), {len(lost)} batch(es) generated again")
        slot.alive = False
        others = [i for i, s in enumerate(self.slots) if s.alive]
        if not others:
            raise WorkerDied("generators", index, "generate_item",
                             f"no generator left: ppo.async.max_generator_restarts {self.max_restarts} spent")
        for call in lost:
            self._assign(call)
        return f"generator {index} died; going on with {len(others)} generator(s) (no restarts left)"

    def pids(self) -> list[int]:
        """The process id of each live generator (tests kill one)."""
        return ray.get([s.actor.pid.remote() for s in self.slots if s.alive], timeout=self.timeout_s)

    def shutdown(self) -> None:
        """Kill the generators, the queue and the version actor; remove the placement group."""
        for s in self.slots:
            if s.actor is not None:
                ray.kill(s.actor)
        self.queue.shutdown()
        ray.kill(self.weights)
        remove_placement_group(self.pg)
