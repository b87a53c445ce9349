"""``ppo.mode: async``'s batch source: generators fill a bounded queue while the trainer trains.

The round has two kinds of workers on separate resource bundles: the trainer's worker group (actor, reference,
critic: the synchronous round's groups) and ``rollout.n_workers`` generators
(:class:`~rlcore.workers.generator.GeneratorWorker`), each with a rollout engine over its own copy of the
policy. This controller hands the generators step batches to generate (:class:`WorkItem`: the prompts and the
sampling seed the synchronous round would use for that step) and runs the trainer on batches as they come
out of the queue; after each update the trainer's rank 0 puts the new weights into the object store and the
controller publishes them as the next policy version, which generators load before their next batch.

Staleness (``ppo.async.max_staleness`` = s, in policy versions): a batch is handed out only while fewer than
s + 1 are outstanding (handed out, not yet trained on), so a batch in a first-in-first-out queue is trained
on at most s versions after the one it was generated with, and generators wait (they have no work) instead of
producing batches that would be too old; AReaL's ``max_head_offpolicyness`` gate. Which version generates a batch
and which batch a step takes is the schedule's (``ppo.async.schedule``, :mod:`rlcore.trainer.round.async_schedule`):
``free`` takes the newest version and the first batch out (several generators can finish out of order: a batch
that still arrives more than s versions old is dropped, counted in ``async/dropped_samples`` and generated again);
``fixed`` gives batch k version max(0, k - s) and step k batch k, the same bits on every run. s = 0 alternates
generation and training exactly as the synchronous round does, with the same prompts, seeds and weights: the same
batches and metrics.

With s > 0 the trainer recomputes the old log-probs (the proximal policy, the weights before this update:
:func:`rlcore.config.needs_recompute`) and ``actor.off_policy`` corrects for the behaviour policy that sampled (the
rollout's log-probs). The round is the synchronous one's (:class:`~rlcore.trainer.round.runner.RoundRunner`, the same
:class:`~rlcore.trainer.round.ppo_step.PPOStep`) with :class:`AsyncSource` as its source
(:mod:`rlcore.trainer.round.modes`).

A generator that dies (process killed, node lost) is restarted in its bundle and its unfinished batches are
generated again (``ppo.async.max_generator_restarts``; after that the round goes on with fewer), counted in
``async/generator_deaths``; a trainer rank that dies ends the stage as in the synchronous round
(:class:`~rlcore.errors.WorkerDied`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from rlcore.config import Config
from rlcore.controller.generator_pool import GeneratedBatch, GeneratorPool, WorkItem
from rlcore.controller.worker_group import Pending, WorkerGroup
from rlcore.protocol import Batch, Metrics
from rlcore.rollout import engine_spec
from rlcore.trainer.loop.model_specs import model_spec
from rlcore.trainer.loop.step_log import timer
from rlcore.trainer.round.async_schedule import ASYNC_SCHEDULES
from rlcore.trainer.round.prompt_sampler import PromptSampler
from rlcore.trainer.round.scoring import RoundScoring
from rlcore.trainer.round.seeds import step_seed
from rlcore.trainer.round.source import ScoredBatch
from rlcore.trainer.samples.generation import generate_spec, generation_input, with_generated
from rlcore.workers.actor import ActorRolloutRefWorker
from rlcore.workers.generator import GeneratorWorker
from rlcore.workers.rollout import GenerateSpec

# how often the controller looks at the generators while it waits for a batch
POLL_S = 0.02


def start_generators(cfg: Config, init_dir: str) -> GeneratorPool[GeneratorWorker]:
    """The round's generators (params.yaml ``rollout.n_workers``/``cpus_per_worker``, ``ppo.async``)."""
    r, a = cfg.rollout, cfg.ppo.async_
    return GeneratorPool(GeneratorWorker, r.n_workers, r.cpus_per_worker, cfg.resources.use_gpu,
                         queue_size=a.queue_size, max_restarts=a.max_generator_restarts, timeout_s=cfg.ray.timeout_s,
                         placement=cfg.resources.placement, model=model_spec(cfg, init_dir, "actor"),
                         engine=engine_spec(cfg.rollout), shards=cfg.resources.n_workers, seed=cfg.seed,
                         partial_rollout=a.partial_rollout)


class AsyncSource:
    """The batches of an asynchronous round, out of the generators' queue (see the module docstring); ``steps`` is
    the round's length (no batch is handed out for a step past it)."""

    def __init__(self, cfg: Config, *, generators: GeneratorPool[GeneratorWorker],
                 actor: WorkerGroup[ActorRolloutRefWorker], scoring: RoundScoring, prompts: Batch, seed: int,
                 steps: int):
        self.cfg, self.gens, self.actor, self.scoring = cfg, generators, actor, scoring
        self.prompts, self.seed, self.steps = prompts, seed, steps
        self.sampler = PromptSampler(len(prompts), seed)
        self.max_staleness = cfg.ppo.async_.max_staleness
        self.schedule = ASYNC_SCHEDULES.get(cfg.ppo.async_.schedule)(self.max_staleness)
        self.spec = generate_spec(cfg, temperature=cfg.rollout.temperature, seed=0)
        self.next_item = 0  # id of the next batch handed out (ids count up; a batch generated again keeps its id)
        self.outstanding: dict[int, tuple[np.ndarray, WorkItem]] = {}  # handed out, not trained on: prompt rows
        self.arrived: dict[int, GeneratedBatch] = {}  # out of the queue, not yet taken by a step (schedule fixed)
        self.version = 0  # the trainer's policy version, as the round last said
        self.trained_at = 0  # the policy version the step's batch is trained on (the version before its update)
        self.published = -1
        # the next step's batch, scored while the ranks trained
        self.ready: tuple[GeneratedBatch, Batch, Metrics] | None = None
        self.carried: Metrics = {"async/dropped_samples": 0, "async/generator_deaths": 0}
        self.busy_before = 0.0
        # Scoring the next batch while the update runs hides the controller's work behind the ranks' when they
        # compute on GPUs; on CPUs it takes cores from the update instead (measured on 2 cores: the update 0.099 s
        # -> 0.112-0.142 s, async/sync 0.99 -> 0.84-0.95), so it is off there.
        self.prefetch = cfg.resources.use_gpu

    # ---------------------------------------------------------------- weights
    def publish(self) -> None:
        """Put the trainer's current weights into the object store as version :attr:`version`; the older versions
        that outstanding batches are to be generated with stay readable."""
        ref = self.actor.call(ActorRolloutRefWorker.rollout_weights)
        assert ref is not None, "rank 0 returns the weights' reference"
        needed = [item.version for _, item in self.outstanding.values() if item.version is not None]
        self.gens.publish(self.version, ref, keep_from=min(needed, default=self.version))
        self.published = self.version

    # ------------------------------------------------------------------ work
    def _hand_out(self, step: int) -> None:
        """Start batches while fewer than max_staleness + 1 are outstanding and the round still needs them."""
        want, n = self.cfg.ppo.train_batch_size, self.cfg.rollout.n
        while len(self.outstanding) < min(self.max_staleness + 1, self.steps - step):
            rows = self.sampler.take(want)
            item = WorkItem(self.next_item, generation_input(self.prompts.select(rows).repeat(n), self.spec),
                            step_seed(self.seed, self.next_item),  # the synchronous round's seed of that step
                            version=self.schedule.version_for(self.next_item))
            self.outstanding[item.id] = (rows, item)
            self.next_item += 1
            self.gens.submit(GeneratorWorker.generate_item, item, self._spec(item))

    def _spec(self, item: WorkItem) -> GenerateSpec:
        return dataclasses.replace(self.spec, seed=item.seed)

    def _next_generated(self, m: Metrics, version: int, until: Pending | None = None) -> GeneratedBatch | None:
        """The batch the schedule gives a trainer at policy ``version`` next (the first fresh enough one, or a given
        one), out of the queue. With ``until``, None as soon as that call is done and the batch is not there."""
        wanted = self.schedule.wanted(self.outstanding)
        while (wanted not in self.arrived) if wanted is not None else not self.arrived:
            if not self._receive(m, version, until):
                return None
        return self.arrived.pop(wanted if wanted is not None else next(iter(self.arrived)))

    def _receive(self, m: Metrics, version: int, until: Pending | None = None) -> bool:
        """Wait for the next usable batch out of the queue and keep it in :attr:`arrived`; one too stale for a
        trainer at ``version`` is dropped and handed out again. With ``until``, False as soon as that call is done
        and no batch is there."""
        deadline = time.monotonic() + self.cfg.ray.timeout_s
        while True:
            for line in self.gens.poll():
                print(f"ppo async: {line}", file=sys.stderr, flush=True)
                m["async/generator_deaths"] += 1
            got = self.gens.queue.get(POLL_S, also=until.refs if until is not None else ())
            if got is None:
                if until is not None and until.done():
                    return False
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ppo async: no batch from {self.gens.alive} generator(s) in "
                                       f"ray.timeout_s {self.cfg.ray.timeout_s:g}s")
                continue
            if got.item_id not in self.outstanding or got.item_id in self.arrived:
                continue  # a generator that died after its put: generated twice
            if not self.schedule.usable(got, version):
                m["async/dropped_samples"] += len(got.batch)
                _, item = self.outstanding[got.item_id]
                self.gens.submit(GeneratorWorker.generate_item, item, self._spec(item))
                continue
            self.arrived[got.item_id] = got
            return True

    def _scored(self, got: GeneratedBatch, step: int) -> tuple[Batch, Metrics]:
        """The generated batch with its prompts' fields and rewards, and the reward metrics (``reward/*``)."""
        rows, _ = self.outstanding[got.item_id]
        start = time.perf_counter()
        prompts = self.prompts.select(rows).repeat(self.cfg.rollout.n)
        batch, rewards = self.scoring.score(with_generated(prompts, got.batch), f"ppo step {step}")
        return batch, {**rewards.metrics(), "timing_s/reward": time.perf_counter() - start}

    def next(self, step: int, version: int, t: Metrics) -> ScoredBatch:
        """The oldest batch fresh enough for a trainer at ``version`` (scored while the last update ran, when
        prefetching): what the step paid for it is waiting for it (``timing_s/wait``) and scoring it."""
        m: Metrics = self.carried  # what the last step's prefetch saw belongs to this step
        self.carried = {"async/dropped_samples": 0, "async/generator_deaths": 0}
        self.version = self.trained_at = version
        if self.published != version:  # the first step (load_state publishes what it restores)
            self.publish()
        self.busy_before = self.gens.busy_s
        self._hand_out(step)
        m["async/queue_depth"] = self.gens.queue.depth() + (self.ready is not None) + len(self.arrived)
        with timer(t, "wait"):
            if self.ready is None:
                got = self._next_generated(m, version)
                assert got is not None
                self.ready = (got, *self._scored(got, step))
        got, batch, reward_m = self.ready
        self.ready = None
        self.outstanding.pop(got.item_id)
        # (no rollout/sample_tries: DAPO's dynamic sampling is refused in async mode, so it would always be 1)
        m.update({**reward_m, "rollout/groups_kept": len(batch) // self.cfg.rollout.n})
        return ScoredBatch(batch, m, got.version, gen_s=got.gen_s)

    def during_update(self, step: int, pending: Pending) -> None:
        """While the update of ``step`` runs on the ranks: take the next step's batch out of the queue as soon as
        it is there and score it, so the trainer finds it ready (the controller is idle otherwise)."""
        if not self.prefetch or step + 1 >= self.steps:
            return
        got = self._next_generated(self.carried, self.version + 1, until=pending)
        if got is not None:
            self.ready = (got, *self._scored(got, step + 1))

    def updated(self, step: int, version: int, t: Metrics) -> None:
        """The new weights published as ``version``, and the batches of the next step handed out."""
        self.version = version
        with timer(t, "publish"):
            self.publish()
        self._hand_out(step + 1)

    def step_metrics(self, scored: ScoredBatch, batch: Batch, t: Metrics) -> Metrics:
        """``async/*`` of a step: its staleness (the versions between the trained one and the one the batch was
        generated with; with partial rollouts, its first tokens', and each token's apart: :func:`token_staleness`),
        how idle the trainer and the generators were, and the generators' own tokens per second (weights and
        generation)."""
        gen_busy = self.gens.busy_s - self.busy_before
        gen_s = scored.gen_s or 0.0
        return {**token_staleness(batch, self.trained_at),
                "async/staleness": float(self.trained_at - scored.version),
                "async/trainer_idle_frac": t["timing_s/wait"] / max(t["timing_s/step"], 1e-9),
                "async/generator_idle_frac": 1.0 - min(1.0, gen_busy / max(self.gens.alive * t["timing_s/step"],
                                                                           1e-9)),
                "async/generators": float(self.gens.alive), "async/generation_s": gen_s,
                "perf/gen_tokens_per_s": float(batch["response_mask"].sum()) / max(gen_s, 1e-9)}

    # ------------------------------------------------------------ checkpoints
    def save_state(self, folder: Path) -> dict[str, Any]:
        """The prompt sampler, the policy version, and the batches handed out and not trained on (their prompt rows
        and seeds): a resumed round hands them out again first, so it trains on the same prompts. A schedule that
        keeps generated batches (``fixed``) also gets those of them meant for versions older than the trainer's
        (waiting for the ones still being generated): a resumed round has only the trainer's weights to make
        them."""
        kept = self._generated_for_older_versions() if self.schedule.keeps_generated else {}
        return {"sampler": self.sampler.state_dict(), "version": self.version, "next_item": self.next_item,
                "outstanding": [(item.id, rows, item.seed) for rows, item in self.outstanding.values()],
                "generated": kept}

    def _generated_for_older_versions(self) -> dict[int, GeneratedBatch]:
        """Every outstanding batch whose version is older than the trainer's, generated (taken out of the queue as
        they come), and any other already out of it."""
        if self.ready is not None:  # taken and scored during the last update: kept as it came out of the queue
            self.arrived[self.ready[0].item_id] = self.ready[0]
            self.ready = None
        older = [i for i, (_, item) in self.outstanding.items() if (item.version or 0) < self.version]
        m: Metrics = {"async/dropped_samples": 0, "async/generator_deaths": 0}
        while any(i not in self.arrived for i in older):
            self._receive(m, self.version)
        self.carried = {k: self.carried[k] + v for k, v in m.items()}
        return dict(self.arrived)

    def load_state(self, folder: Path, state: dict[str, Any]) -> None:
        """Continue from :meth:`save_state` (the trainer's workers restored first): the restored weights are published
        first, then the outstanding batches that were not kept handed out again, so they are generated with the
        weights they were meant for (handed out before the publish, a generator would take the round's starting
        weights and the batch would be dropped as stale)."""
        self.sampler.load_state_dict(state["sampler"])
        self.version = state["version"]
        self.publish()
        self.next_item = state["next_item"]
        self.arrived = dict(state.get("generated", {}))
        n = self.cfg.rollout.n
        for item_id, rows, seed in state["outstanding"]:
            item = WorkItem(item_id, generation_input(self.prompts.select(rows).repeat(n), self.spec), seed,
                            version=self.schedule.version_for(item_id))
            self.outstanding[item_id] = (rows, item)
            if item_id in self.arrived:
                continue
            if item.version is not None and item.version != self.version:
                raise RuntimeError(f"batch {item_id} is to be generated by policy version {item.version}, which a "
                                   f"round resumed at version {self.version} cannot make, and the checkpoint lacks it")
            self.gens.submit(GeneratorWorker.generate_item, item, self._spec(item))


def token_staleness(batch: Batch, trained_at: int) -> Metrics:
    """With partial rollouts (``token_versions``: the version that sampled each token): how many versions behind the
    trained one the batch's tokens are, on average and at most, and the share of them sampled by a newer version than
    the batch's first (taken mid-batch)."""
    if "token_versions" not in batch:
        return {}
    mask = batch["response_mask"].bool()
    versions = batch["token_versions"][mask]
    if not len(versions):
        return {}
    return {"async/token_staleness_mean": float((trained_at - versions).float().mean()),
            "async/token_staleness_max": float(trained_at - versions.min()),
            "async/tokens_after_switch_frac": float((versions > versions.min()).float().mean())}
