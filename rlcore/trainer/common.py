"""Pieces every trainer loop shares: cluster start-up, worker groups, rewards, step logs."""

from __future__ import annotations

import csv
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from rlcore.config import Config
from rlcore.controller import ResourcePool, WorkerGroup, start_ray
from rlcore.data.collate import decode_responses
from rlcore.protocol import Batch
from rlcore.rewards.rule import compute_score
from rlcore.rollout import SamplingParams
from rlcore.workers.actor import ActorRolloutRefWorker
from rlcore.workers.critic import CriticWorker


def start_pool(cfg: Config) -> ResourcePool:
    """Start (or join) Ray and place the worker ranks' bundles.

    The controller's own tensor work (rewards, advantages, Batch ops) is tiny, so it runs on one
    torch thread: a multi-threaded OpenMP pool here would spin between those small ops on the very
    cores the ranks compute on (measured: 0.2 of a core during every step on 2 cores)."""
    torch.set_num_threads(1)
    print(start_ray(cfg.ray.address, cfg.ray.num_cpus), flush=True)
    r = cfg.resources
    return ResourcePool(r.n_workers, r.cpus_per_worker, r.use_gpu, cfg.ray.timeout_s)


def actor_group(cfg: Config, pool: ResourcePool, model_path: str | Path, roles: tuple[str, ...], *,
                optim: dict[str, Any] | None = None, share: int = 1) -> WorkerGroup:
    engine = cfg.rollout.engine if "rollout" in roles else None  # SFT neither reads nor needs it
    r = cfg.resources
    wg = WorkerGroup(ActorRolloutRefWorker, pool, name="actor", share=share, timeout_s=cfg.ray.timeout_s,
                     model_path=str(model_path), roles=roles, dtype=cfg.model.dtype,
                     attn_implementation=cfg.model.attn_implementation,
                     packed_forward=cfg.model.packed_forward, rollout_engine=engine,
                     optim=optim, seed=cfg.seed, strategy=r.strategy, reshard_after_forward=r.reshard_after_forward,
                     ref_reshard_after_forward=r.ref_reshard_after_forward)
    wg.init_model()
    return wg


def critic_group(cfg: Config, pool: ResourcePool, model_path: str | Path, *, share: int) -> WorkerGroup:
    c = cfg.critic
    wg = WorkerGroup(CriticWorker, pool, name="critic", share=share, timeout_s=cfg.ray.timeout_s,
                     model_path=str(model_path), dtype=cfg.model.dtype,
                     attn_implementation=cfg.model.attn_implementation,
                     packed_forward=cfg.model.packed_forward,
                     optim={"lr": c.lr, "weight_decay": 0.0, "warmup_steps": 0}, seed=cfg.seed,
                     strategy=cfg.resources.strategy, reshard_after_forward=cfg.resources.reshard_after_forward)
    wg.init_model()
    return wg


def generate(wg: WorkerGroup, prompts: Batch, *, max_new_tokens: int, temperature: float, top_p: float = 1.0,
             top_k: int = 0, greedy: bool = False, seed: int, micro_batch_size: int) -> Batch:
    """Prompts (already repeated for groups) -> prompts plus responses, mask and log-probs.

    A batch that does not split evenly over the ranks is padded with copies of its first
    rows for the call and trimmed after, so any number of prompts works."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            greedy=greedy)
    tensors = Batch(dict(prompts.tensors))
    pad = -len(tensors) % wg.world_size
    if pad:
        tensors = Batch.concat([tensors, tensors.select(np.arange(pad) % len(tensors))])
    req = Batch(dict(tensors.tensors), meta={"sampling": vars(params), "seed": seed,
                                             "micro_batch_size": micro_batch_size})
    return prompts.union(wg.generate(req).slice(0, len(prompts)))


def rule_rewards(tokenizer, batch: Batch) -> np.ndarray:
    """Score each response with the rule registered for its data_source; ``[batch]`` floats."""
    texts = decode_responses(tokenizer, batch["responses"], batch["response_mask"])
    return np.array([compute_score(ds, t, gt) for ds, t, gt in
                     zip(batch["data_source"], texts, batch["ground_truth"])], dtype=np.float64)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


class StepLog:
    """Per-step metrics to MLflow and to a CSV (the stage's DVC plot), flushed every step."""

    def __init__(self, tracker, csv_path: str | Path | None):
        self.tracker = tracker
        self.path = Path(csv_path) if csv_path else None
        self.rows: list[dict[str, float]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append({"step": step, **metrics})
        self.tracker.log_metrics(metrics, step=step)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            keys = list(dict.fromkeys(k for r in self.rows for k in r))
            with self.path.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=keys)
                w.writeheader()
                w.writerows(self.rows)


@contextmanager
def timer(store: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    store[f"timing_s/{name}"] = time.perf_counter() - start
