"""Pieces every trainer loop shares: cluster start-up, typed specs built from params.yaml, step logs."""

from __future__ import annotations

import csv
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from rlcore.config import Config
from rlcore.controller.resource_pool import ResourcePool, start_ray
from rlcore.engine.model import ModelSpec


def start_pool(cfg: Config) -> ResourcePool:
    """Start (or join) Ray and place the worker ranks' bundles; use it as a context manager, so the
    placement group is released whatever happens.

    The controller's own tensor work (rewards, advantages, Batch ops) is tiny, so it runs on one
    torch thread: a multi-threaded OpenMP pool here would spin between those small ops on the very
    cores the ranks compute on (measured: 0.2 of a core during every step on 2 cores)."""
    torch.set_num_threads(1)
    print(start_ray(cfg.ray.address, cfg.ray.num_cpus), flush=True)
    r = cfg.resources
    return ResourcePool(r.n_workers, r.cpus_per_worker, r.use_gpu, cfg.ray.timeout_s)


def model_spec(cfg: Config, path: str | Path) -> ModelSpec:
    """How workers load and wrap the model at ``path`` (params.yaml ``model`` and ``resources``)."""
    m, r = cfg.model, cfg.resources
    return ModelSpec(path=str(path), dtype=m.dtype, attn_implementation=m.attn_implementation,
                     packed_forward=m.packed_forward, strategy=r.strategy,
                     reshard_after_forward=r.reshard_after_forward, ref_reshard_after_forward=r.ref_reshard_after_forward)


class StepLog:
    """Per-step metrics to MLflow and to a CSV (the stage's DVC plot), written every step: a row is
    appended, and the file rewritten only when a step brings a metric the header lacks."""

    def __init__(self, tracker, csv_path: str | Path | None):
        self.tracker = tracker
        self.path = Path(csv_path) if csv_path else None
        self.rows: list[dict[str, float]] = []
        self.columns: list[str] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **metrics}
        self.rows.append(row)
        self.tracker.log_metrics(metrics, step=step)
        if self.path is None:
            return
        new = [k for k in row if k not in self.columns]
        if new:  # always on the first row ("step" is new then)
            self.columns += new
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=self.columns)
                w.writeheader()
                w.writerows(self.rows)
        else:
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.columns).writerow(row)


@contextmanager
def timer(store: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    store[f"timing_s/{name}"] = time.perf_counter() - start
