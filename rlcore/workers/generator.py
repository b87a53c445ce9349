"""A generator of an asynchronous PPO round: a rollout engine over its own copy of the policy.

It is not a rank of a process group: generators share nothing but the rollout queue they fill and the
weight versions they read (``rlcore.controller.generator_pool``). Before each step batch it loads the newest
published policy if it holds an older one (or exactly the version the batch names, ``ppo.async.schedule fixed``),
generates the batch as the trainer's ranks would have
(:func:`~rlcore.workers.rollout.generate_sharded`), tags it with the version it used and puts it into the
queue, waiting there while the queue is full.

With ``ppo.async.partial_rollout`` it also takes a newer version in the middle of a batch: a thread keeps one
``wait_newer`` call pending on the version actor (:class:`InFlightWeights`), and the engine looks at what it heard
between decode steps; when a version comes, its weights are loaded and checked as before a batch, the running rows' KV
cache is computed again with them, and each token is tagged with the version that sampled it (``token_versions``).
"""

from __future__ import annotations

import os
import threading
import time

import ray
import torch

from rlcore.controller.generator_pool import BatchQueue, GeneratedBatch, WorkItem
from rlcore.controller.decorator import RankPlacement
from rlcore.engine.model import ModelSpec
from rlcore.engine import sync_check
from rlcore.engine.weights import WeightsPayload, unpack_state
from rlcore.rollout import EngineSpec
from rlcore.workers.rank import RankWorker
from rlcore.workers.rollout import AgentRunners, GenerateSpec, generate_sharded, make_engine


class InFlightWeights:
    """A generator's :class:`~rlcore.rollout.base.WeightRefresh`. A watcher thread keeps one ``wait_newer`` call
    pending on the version actor (blocked in ``ray.get``, which lets go of the GIL) and notes each version it
    returns; :meth:`poll`, between decode steps, only reads that note (no Ray call: a ``ray.wait`` at every look cost
    a tiny model's batch a fifth of its generation time), and loads the version it names when it is newer than the
    one the engine holds. The thread ends when the version actor goes (the round's end), or with the process."""

    def __init__(self, generator: GeneratorWorker):
        self.generator = generator
        self.arrived: tuple[int, ray.ObjectRef] | None = None  # the newest version the watcher saw, and its weights
        self._thread = threading.Thread(target=self._watch, name=f"weights-watcher-{generator.index}", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        seen = self.generator.version
        while True:
            try:
                version, (ref,) = ray.get(self.generator.weights.wait_newer.remote(seen))
            except ray.exceptions.RayError:
                return  # the version actor is gone: the round ended
            seen = version
            self.arrived = (version, ref)  # one assignment: poll reads a whole pair or the previous one

    @property
    def version(self) -> int:
        return self.generator.version

    def poll(self) -> bool:
        arrived = self.arrived
        if arrived is None or arrived[0] <= self.generator.version:  # (the batch may have started on it already)
            return False
        version, ref = arrived
        self.generator.load(ray.get(ref), version)
        return True


class GeneratorWorker(RankWorker):
    def __init__(self, placement: RankPlacement, *, index: int, queue, weights, model: ModelSpec, engine: EngineSpec,
                 shards: int, use_gpu: bool = False, seed: int = 0, partial_rollout: bool = False):
        super().__init__(placement, seed)
        self.index, self.queue, self.weights = index, queue, weights
        self.model_spec, self.engine_spec, self.shards = model, engine, shards
        self.device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
        self.version = -1  # no published policy loaded yet
        self.partial_rollout = partial_rollout
        self.inflight: InFlightWeights | None = None  # made on the first batch, once a version is loaded

    def init_model(self) -> None:
        self.engine = make_engine(self.engine_spec, self.model_spec, self.device)
        self.agents = AgentRunners(self.model_spec.path)
        if self.partial_rollout and not getattr(self.engine, "takes_weights_mid_generation", False):
            raise ValueError(f"ppo.async.partial_rollout: rollout.engine {self.engine_spec.name} generates "
                             f"{self.model_spec.path} with {type(self.engine).__name__}, which cannot take new weights "
                             "mid-generation (the static engine falls back to hf for models it does not run)")

    def pid(self) -> int:
        return os.getpid()

    def _pull_weights(self, version: int | None = None) -> None:
        """Load the newest published policy if it is newer than the one held, or with ``version`` exactly that one
        (one whole object: never torn), and check that the engine now computes the trainer's log-probs of the
        probe."""
        found = None
        if version is None:
            found = ray.get(self.weights.newer_than.remote(self.version))
        elif version != self.version:
            found = ray.get(self.weights.at.remote(version))
            if found is None:
                raise RuntimeError(f"generator {self.index}: policy version {version} was asked for and is not "
                                   "published (or no longer kept)")
        if found is not None:
            loaded, (ref,) = found
            self.load(ray.get(ref), loaded)
        if self.version < 0:
            raise sync_check.RolloutOutOfSync(f"generator {self.index}: asked to generate before any policy version "
                                              "was published (it would sample from the round's initial weights)")

    def load(self, payload: WeightsPayload, version: int) -> None:
        """Take a published version's weights and check them with its probe."""
        state = unpack_state(payload.state)
        self.engine.load_weights(state)
        sync_check.check_loaded(self.engine.model, state, payload.fingerprint,
                                what=f"generator {self.index}, policy version {version}")
        sync_check.check(sync_check.engine_log_probs(self.engine, payload.probe, self.device), payload.probe_log_probs,
                         dtype=payload.dtype, what=f"generator {self.index}, policy version {version}")
        self.version = version

    def generate_item(self, item: WorkItem, spec: GenerateSpec) -> float:
        """Generate ``item`` with the newest policy (or the one it names) and put it into the queue (blocking while it
        is full); returns the seconds spent loading weights and generating (not waiting)."""
        start = time.perf_counter()
        self._pull_weights(item.version)
        started_on = self.version  # the batch's version: its oldest tokens' (newer ones may follow, partial rollouts)
        if self.partial_rollout and self.inflight is None:
            self.inflight = InFlightWeights(self)
        out = generate_sharded(self.engine, item.prompts, spec, shards=self.shards, device=self.device,
                               agents=self.agents, refresh=self.inflight)
        busy = time.perf_counter() - start
        BatchQueue.put(self.queue, GeneratedBatch(item.id, started_on, out, self.index, busy))
        return busy
