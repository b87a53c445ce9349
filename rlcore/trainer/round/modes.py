"""The round modes (``ppo.mode``): a round composed of its mode's batch source and the PPO step, over the round's
worker groups, with what the mode starts besides them (``async``: the generators) stopped on the way out.

    with running_round(cfg, init_dir="models/sft", tokenizer=tok, prompts=prompts, seed=seed, steps=400) as runner:
        metrics = runner.step(0)

``sync``'s source is the trainer's own ranks (:class:`~rlcore.trainer.round.sync_source.SyncSource`), ``async``'s the
generators' queue (:class:`~rlcore.trainer.round.async_source.AsyncSource`); either steps the same way, so a round's
loop (:mod:`rlcore.trainer.ppo`) serves both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

from rlcore.algos.advantage import ESTIMATORS
from rlcore.config import Config
from rlcore.controller.generator_pool import GeneratorPool
from rlcore.controller.resource_pool import ResourcePool
from rlcore.protocol import Batch
from rlcore.registry import Registry
from rlcore.trainer.loop.pool import start_pool
from rlcore.trainer.round.async_source import AsyncSource, start_generators
from rlcore.trainer.round.runner import RoundRunner
from rlcore.trainer.round.scoring import RoundScoring
from rlcore.trainer.round.sync_source import SyncSource
from rlcore.trainer.round.worker_groups import RoundWorkerGroups


class RoundMode(Protocol):
    """A ``ppo.mode``: the runner of a round over the trainer's ``worker_groups``, with whatever else the mode starts
    (generators), stopped on the way out."""

    def __call__(self, cfg: Config, worker_groups: RoundWorkerGroups, *, init_dir: str, tokenizer, prompts: Batch,
                 seed: int, steps: int | None = None) -> AbstractContextManager[RoundRunner]: ...


def round_scoring(cfg: Config, tokenizer, worker_groups: RoundWorkerGroups) -> RoundScoring:
    """The scoring of a round's samples: params.yaml ``reward`` with the reward model's group, ``ppo.dapo``'s overlong
    penalty."""
    return RoundScoring(cfg.reward, cfg.ppo.dapo, cfg.task.max_response_length, tokenizer, worker_groups.reward_model)


@contextmanager
def running_sync_round(cfg: Config, worker_groups: RoundWorkerGroups, *, init_dir: str, tokenizer, prompts: Batch,
                       seed: int, steps: int | None = None) -> Iterator[RoundRunner]:
    """``ppo.mode: sync``: :func:`sync_round_runner` (nothing else to start or stop)."""
    yield sync_round_runner(cfg, worker_groups, tokenizer=tokenizer, prompts=prompts, seed=seed)


def sync_round_runner(cfg: Config, worker_groups: RoundWorkerGroups, *, tokenizer, prompts: Batch,
                      seed: int) -> RoundRunner:
    """The round of ``worker_groups`` whose source is the trainer's own ranks (:class:`SyncSource`)."""
    scoring = round_scoring(cfg, tokenizer, worker_groups)
    source = SyncSource(cfg, worker_groups.actor, scoring, prompts=prompts, seed=seed,
                        greedy_baseline=ESTIMATORS.get(cfg.algorithm.adv_estimator).needs_greedy_baseline)
    return RoundRunner(cfg, worker_groups=worker_groups, source=source, scoring=scoring, tokenizer=tokenizer, seed=seed)


@contextmanager
def running_async_round(cfg: Config, worker_groups: RoundWorkerGroups, *, init_dir: str, tokenizer, prompts: Batch,
                        seed: int, steps: int | None = None) -> Iterator[RoundRunner]:
    """``ppo.mode: async``: the round whose source is :class:`AsyncSource` on freshly started generators, which are
    stopped (with the queue, the version actor and their placement group) on the way out whatever happens."""
    if steps is None:
        raise ValueError("ppo.mode async: the round runner needs the round's steps")
    generators = start_generators(cfg, init_dir)
    print(f"ppo async: {generators.alive} generator(s), queue of {cfg.ppo.async_.queue_size} batch(es), "
          f"max_staleness {cfg.ppo.async_.max_staleness}", flush=True)
    try:
        yield async_round_runner(cfg, worker_groups, generators, tokenizer=tokenizer, prompts=prompts, seed=seed,
                                 steps=steps)
    finally:
        generators.shutdown()


def async_round_runner(cfg: Config, worker_groups: RoundWorkerGroups, generators: GeneratorPool, *, tokenizer,
                       prompts: Batch, seed: int, steps: int) -> RoundRunner:
    """The round of ``worker_groups`` with :class:`AsyncSource` over ``generators`` as its source (with
    ``ppo.async.max_staleness`` > 0 a batch may come from older weights, so the old log-probs are the trainer's:
    :func:`~rlcore.config.needs_recompute`)."""
    scoring = round_scoring(cfg, tokenizer, worker_groups)
    source = AsyncSource(cfg, generators=generators, actor=worker_groups.actor, scoring=scoring, prompts=prompts,
                         seed=seed, steps=steps)
    return RoundRunner(cfg, worker_groups=worker_groups, source=source, scoring=scoring, tokenizer=tokenizer, seed=seed)


# ppo.mode -> the round's runner (rlcore.names.PPO_MODES lists the same names for light validation)
ROUND_MODES: Registry[RoundMode] = Registry("ppo mode")
ROUND_MODES.add("sync", running_sync_round)
ROUND_MODES.add("async", running_async_round)


@contextmanager
def round_on_pool(cfg: Config, pool: ResourcePool, *, init_dir: str, tokenizer, prompts: Batch, seed: int,
                  steps: int | None = None) -> Iterator[RoundRunner]:
    """The ``ppo.mode`` runner over worker groups started on ``pool`` from the model at ``init_dir``, all stopped on
    the way out whatever happens. An asynchronous round needs its ``steps`` (no batch is handed out past them)."""
    worker_groups = RoundWorkerGroups.start(cfg, pool, init_dir)
    try:
        with ROUND_MODES.get(cfg.ppo.mode)(cfg, worker_groups, init_dir=init_dir, tokenizer=tokenizer,
                                           prompts=prompts, seed=seed, steps=steps) as runner:
            yield runner
    finally:
        worker_groups.shutdown()


@contextmanager
def running_round(cfg: Config, *, init_dir: str, tokenizer, prompts: Batch, seed: int,
                  steps: int | None = None) -> Iterator[RoundRunner]:
    """:func:`round_on_pool` on a fresh resource pool, released on the way out: ``with running_round(...) as runner:
    runner.step(0)``."""
    with start_pool(cfg) as pool, round_on_pool(cfg, pool, init_dir=init_dir, tokenizer=tokenizer, prompts=prompts,
                                                seed=seed, steps=steps) as runner:
        yield runner
