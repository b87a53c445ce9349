"""Pieces every trainer loop shares: cluster start-up, typed specs built from params.yaml, step logs."""

from __future__ import annotations

import csv
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rlcore.config import Config
from rlcore.controller.resource_pool import ResourcePool, start_ray
from rlcore.kernels import activate
from rlcore.engine import footprint, lora
from rlcore.engine.lora import LoraSpec
from rlcore.engine.model import ModelSpec
from rlcore.errors import ConfigError, TrainingDiverged


def start_pool(cfg: Config) -> ResourcePool:
    """Start (or join) Ray and place the worker ranks' bundles (``resources.placement``); use it as a
    context manager, so the placement group is released whatever happens. Prints which Ray it joined and
    the node of each rank.

    The controller's own tensor work (rewards, advantages, Batch ops) is tiny, so it runs on one
    torch thread: a multi-threaded OpenMP pool here would spin between those small ops on the very
    cores the ranks compute on (measured: 0.2 of a core during every step on 2 cores). It computes with the kernels
    ``resources.cpu_kernels`` chose (rlcore.kernels), as its ranks do."""
    print(f"cpu kernels: {activate(1)}", flush=True)
    print(start_ray(cfg.ray.address, cfg.ray.num_cpus), flush=True)
    r = cfg.resources
    pool = ResourcePool(r.n_workers, r.cpus_per_worker, r.use_gpu, cfg.ray.timeout_s, r.placement)
    print(pool.describe(), flush=True)
    return pool


def model_spec(cfg: Config, path: str | Path, role: str | None = None) -> ModelSpec:
    """How workers load and wrap the model at ``path`` (params.yaml ``model`` and ``resources``); for a model that
    trains, or a rollout copy of one, its ``role`` (``sft``, ``actor``, ``critic``) adds that section's LoRA, gradient
    checkpointing and the offload settings."""
    m, r = cfg.model, cfg.resources
    trained = {}
    if role is not None:
        section = getattr(cfg, role)
        lora = section.lora
        trained = {"lora": LoraSpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                    target_modules=lora.target_modules, seed=cfg.seed),
                   "gradient_checkpointing": section.gradient_checkpointing, "offload_params": r.offload.params}
    return ModelSpec(path=str(path), dtype=m.dtype, attn_implementation=m.attn_implementation,
                     packed_forward=m.packed_forward, strategy=r.strategy,
                     reshard_after_forward=r.reshard_after_forward, ref_reshard_after_forward=r.ref_reshard_after_forward,
                     **trained)


def check_model(cfg: Config, model_dir: str | Path, stage: str) -> None:
    """Before Ray starts: LoRA settings that cannot work are a ConfigError naming the key (target modules the model
    lacks; an adapter to train on whose rank or alpha differ), and an estimate of the stage's memory that does not fit
    is printed as a warning (``rlcore.engine.footprint``). ``stage``: ``sft`` or ``ppo``."""
    # (a critic never continues an adapter: it starts a fresh one on its merged folder)
    roles: dict[str, dict[str, Path | None]] = {"sft": {"sft": Path(model_dir)},
                                                "ppo": {"actor": Path(model_dir), "critic": None}}
    shape = footprint.model_shape(model_dir)
    for role, folder in roles[stage].items():
        settings = getattr(cfg, role).lora
        if not settings.rank:
            continue
        spec = LoraSpec(rank=settings.rank, alpha=settings.alpha, dropout=settings.dropout,
                        target_modules=settings.target_modules)
        if folder is not None and lora.is_adapter(folder):
            lora.check_continues(spec, folder, f"{role}.lora")
        elif not isinstance(settings.target_modules, str):
            unknown = sorted(set(settings.target_modules) - shape.linear_names)
            if unknown:
                raise ConfigError(f"{role}.lora.target_modules: {', '.join(unknown)}: no linear layer of that name in "
                                  f"{model_dir} (it has {', '.join(sorted(shape.linear_names))})")
    line = footprint.warning(cfg, model_dir, stage)
    if line:
        print(f"warning: {line}", file=sys.stderr, flush=True)


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
            self._rewrite()
        else:
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.columns).writerow(row)

    def flush(self) -> None:
        """Write the tracker's buffered metrics now (before a step checkpoint)."""
        flush = getattr(self.tracker, "flush", None)
        if flush is not None:
            flush()

    def restore(self, rows: list[dict[str, float]], *, to_tracker: bool) -> None:
        """Continue after the rows of a resumed checkpoint: the CSV is written with them, and they go to
        the tracker only when ``to_tracker`` (a new MLflow run; a continued run already has them)."""
        self.rows = [dict(r) for r in rows]
        self.columns = list(dict.fromkeys(k for r in self.rows for k in r))
        if to_tracker:
            for r in self.rows:
                self.tracker.log_metrics({k: v for k, v in r.items() if k != "step"}, step=int(r["step"]))
        if self.path is not None and self.rows:
            self._rewrite()

    def _rewrite(self) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns)
            w.writeheader()
            w.writerows(self.rows)


def stop_if_diverged(rows: list[dict[str, float]], section: str, limit: int, shown: tuple[str, ...],
                     hint: str) -> None:
    """Raise :class:`~rlcore.errors.TrainingDiverged` when the last rows of a step log skipped ``limit`` or more
    optimizer steps of ``section`` in a row for a non-finite loss or gradient norm (``limit`` 0: never).

    The count is ``{section}/nonfinite_steps`` summed over the trailing rows that skipped any: exactly the
    consecutive skipped optimizer steps when those steps skipped all theirs (a diverged run); a row where
    ``section`` did not train (no such key: a critic warm-up step) neither counts nor ends the run. The count
    is a function of the logged rows, so a stage resumed from a step checkpoint (which restores them) counts
    on from where it was. The message names the last row's step, the ``shown`` metrics of the last row that
    skipped nothing, and the ``hint``."""
    if not limit:
        return
    key = f"{section}/nonfinite_steps"
    skipped, finite = 0, None
    for row in reversed(rows):
        if key not in row:
            continue
        if not row[key]:
            finite = row
            break
        skipped += int(row[key])
    if skipped < limit:
        return
    if finite is None:
        last = "no step before them was finite"
    else:
        last = f"last finite at step {int(finite['step'])}: " + ", ".join(
            f"{k}={finite[k]:.4g}" for k in shown if k in finite)
    raise TrainingDiverged(f"step {int(rows[-1]['step'])}: {skipped} consecutive optimizer steps skipped for a "
                           f"non-finite loss or gradient norm ({section}.max_nonfinite_steps: {limit}; {last}); "
                           f"{hint}")


@contextmanager
def timer(store: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    store[f"timing_s/{name}"] = time.perf_counter() - start
