"""What the garbage collector costs rlcore's own processes, with and without ``rlcore.heap``.

    .venv/bin/python -m bench.heap                  # 5 pairs of each kind: the "heap" section of bench/RESULTS.md
    .venv/bin/python -m bench.heap --pairs 3 --out /tmp/heap.md

Two kinds of child process, on the tiny built-in model, each run ``heap`` and ``plain`` alternately (so drift in the
machine's speed falls on both):

* driver: what a ppo stage's driver does before and after its round, without Ray: the stage's heavy imports and its
  tokenizer, the MLflow run's sqlite store (``rlcore.tracking``), the memory estimate's meta model
  (``rlcore.engine.footprint``), then the exit. ``heap`` runs it as a stage script does (``rlcore.heap.script``, the
  imports in a ``long_lived`` block as in ``stages/ppo.py``), ``plain`` as a library caller would, where
  ``rlcore.heap`` changes nothing. CPU seconds are user + system from the parent's view of its finished child, so
  the interpreter's shutdown is counted.
* rank: what the process Ray starts for an actor rank does before its first call (the worker module's imports, the
  worker, its process group of one, ``init_model``), started with ``RLCORE_RANK_PROCESS`` (``heap``) or without it
  (``plain``); CPU seconds are the child's own at the end of ``init_model``, as Ray ends a rank without the
  interpreter's shutdown.

Per child also the wall seconds and the full (generation-2) collections that ran, with the time they took.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.sections import write_section
from bench.settings import BENCH_DIR

SECTION = "heap"

# The start of both child scripts: counts the full (generation-2) collections and the seconds they take.
FULL_COLLECTIONS = r"""
import gc, json, os, sys, time
full = [0, 0.0]
start = [0.0]
def on_gc(phase, info):
    if info["generation"] != 2:
        return
    if phase == "start":
        start[0] = time.perf_counter()
    else:
        full[0] += 1
        full[1] += time.perf_counter() - start[0]
gc.callbacks.append(on_gc)
"""

CHILD = FULL_COLLECTIONS + r"""
model_dir, db, mode = sys.argv[1], sys.argv[2], sys.argv[3]
from rlcore import heap

def main():
    with heap.long_lived():
        from rlcore.engine.model import load_tokenizer
        from rlcore.pipeline_run import pipeline_params
        from rlcore.tracking import MlflowTracker
        from rlcore.trainer.loop.checkpoint import stage_checkpoints
        from rlcore.trainer.ppo import run_ppo_round
        load_tokenizer(model_dir)
    tracker = MlflowTracker(f"sqlite:///{db}", "bench-heap", "child", {})
    tracker.close()
    from rlcore.engine.footprint import model_shape
    model_shape(model_dir)
    print(json.dumps({"full_collections": full[0], "full_collection_s": full[1]}), flush=True)

heap.script(main) if mode == "heap" else main()
"""


# What a rank's process does before its first call, without Ray (``rlcore.controller.worker_group`` starts it with
# ``rlcore.heap.RANK_PROCESS_ENV`` set or, for ``plain``, not): the worker module's imports, the worker, its
# process group of one, init_model. Ray ends a rank's process without the interpreter's shutdown (os._exit here).
RANK_CHILD = FULL_COLLECTIONS + r"""
model_dir = sys.argv[1]
from rlcore.heap import rank_loading
rank_loading()  # what Ray runs first in a worker of a session rlcore starts (its setup hook; no-op for `plain`)
from rlcore.workers.actor import ActorRolloutRefWorker
from rlcore.config import Config
from rlcore.controller.decorator import RankPlacement
from rlcore.engine import distributed
from rlcore.rollout import engine_spec
from rlcore.trainer.loop.model_specs import model_spec
from rlcore.workers.optim import OptimSpec
cfg = Config()
worker = ActorRolloutRefWorker(RankPlacement(0, 1, 1, None), model=model_spec(cfg, model_dir, "actor"),
                               engine=engine_spec(cfg.rollout), optim=OptimSpec(lr=1e-5), with_ref=True, seed=1)
worker.init_distributed("127.0.0.1", distributed.free_port(), False, 60.0)
worker.init_model()
t = os.times()
print(json.dumps({"cpu_s": t.user + t.system, "full_collections": full[0], "full_collection_s": full[1]}), flush=True)
os._exit(0)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--pairs", type=int, default=5, help="children of each kind, alternating (default 5)")
    p.add_argument("--out", default=str(BENCH_DIR / "RESULTS.md"), help="markdown file whose section to write")
    return p.parse_args(argv)


def rank_child(model_dir: str, mode: str, extra_env: dict | None = None) -> dict:
    from rlcore.heap import rank_process_env

    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "", "OMP_NUM_THREADS": "1",
           **(rank_process_env() if mode == "heap" else {}), **(extra_env or {})}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", RANK_CHILD, model_dir], capture_output=True, text=True, env=env,
                          timeout=300)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"bench.heap: the {mode} rank child failed:\n{proc.stderr[-3000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "wall_s": wall}


def child(model_dir: str, db: str, mode: str, extra_env: dict | None = None) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, model_dir, db, mode], capture_output=True, text=True,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "", **(extra_env or {})}, timeout=300)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"bench.heap: the {mode} child failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu_s": cpu, "wall_s": wall, **out}


def timing_rows(kind: str, results: dict[str, list[dict]], before: str, after: str) -> tuple[list[str], tuple[dict, dict]]:
    """The CPU and wall rows of a ``| child | measure | before | after | after/before |`` table for one kind of child,
    and the medians of every measure of the two modes' children."""
    med = {m: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for m, rows in results.items()}
    b, a = med[before], med[after]
    return [f"| {kind} | CPU seconds | {b['cpu_s']:.2f} | {a['cpu_s']:.2f} | {a['cpu_s'] / b['cpu_s']:.2f} |",
            f"| {kind} | wall seconds | {b['wall_s']:.2f} | {a['wall_s']:.2f} | {a['wall_s'] / b['wall_s']:.2f} |"], (b, a)


def child_cpu_lines(kinds: dict[str, dict[str, list[dict]]], before: str, after: str) -> list[str]:
    """After the table: each child's CPU seconds, by kind and mode."""
    lines = [""]
    for kind, results in kinds.items():
        lines.append(f"CPU seconds of each {kind} child: " + "; ".join(
            f"{m} " + ", ".join(f"{r['cpu_s']:.2f}" for r in results[m]) for m in (before, after)) + ".")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from rlcore.config import Config
    from rlcore.engine.tiny_model import materialize_tiny

    began = time.perf_counter()
    kinds = {"driver": {"plain": [], "heap": []}, "rank": {"plain": [], "heap": []}}
    with tempfile.TemporaryDirectory(prefix="bench-heap-") as tmp:
        model_dir = str(materialize_tiny(Path(tmp) / "model", seed=0, **Config().model.tiny.model_dump()))
        child(model_dir, f"{tmp}/warm.db", "plain")  # compiles the bytecode both kinds then read
        for i in range(args.pairs):
            for mode in ("plain", "heap") if i % 2 == 0 else ("heap", "plain"):
                for kind, run in (("driver", lambda: child(model_dir, f"{tmp}/{mode}{i}.db", mode)),
                                  ("rank", lambda: rank_child(model_dir, mode))):
                    r = run()
                    kinds[kind][mode].append(r)
                    print(f"{kind:6s} {mode:5s} cpu {r['cpu_s']:.2f} s wall {r['wall_s']:.2f} s full collections "
                          f"{r['full_collections']} ({r['full_collection_s']:.2f} s)", flush=True)
    lines = [
        "# The garbage collector in rlcore's own processes",
        "",
        f"Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC by `python -m bench.heap --pairs {args.pairs}` "
        f"in {time.perf_counter() - began:.0f} s on {os.cpu_count()} CPUs, the tiny built-in model. Two kinds of "
        "child process, each with and without `rlcore.heap` (`heap`, `plain`), run alternately; medians of each.",
        "",
        "* driver: what a ppo stage's own process does around its round, without Ray (the stage's imports and "
        "tokenizer, the MLflow sqlite store, the memory estimate's meta model), then the interpreter's exit; `heap` "
        "runs it as a stage script (`rlcore.heap.script`), `plain` as a library caller;",
        "* rank: what the process Ray starts for an actor rank does before its first call (the worker module's "
        "imports, the worker, its process group, `init_model`), ended as Ray ends it (no interpreter shutdown); "
        "`heap` starts with `RLCORE_RANK_PROCESS` set, as a worker group starts it.",
        "",
        "| child | measure | plain | heap | heap/plain |",
        "|---|---|---|---|---|",
    ]
    for kind, results in kinds.items():
        rows, (p, h) = timing_rows(kind, results, "plain", "heap")
        lines += rows + [f"| {kind} | full collections (their seconds) | {p['full_collections']:.0f} "
                         f"({p['full_collection_s']:.2f}) | {h['full_collections']:.0f} ({h['full_collection_s']:.2f}) | |"]
    text = "\n".join(lines + child_cpu_lines(kinds, "plain", "heap"))
    print(text)
    write_section(args.out, SECTION, text)

if __name__ == "__main__":
    main()
