"""The loop of ``rlcore compare``: each cell run (or read back), the report written and logged to MLflow."""

from __future__ import annotations

import datetime
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlcore.compare.grid import Cell, CompareSpec, cell_config, check_keys, grid_cells
from rlcore.compare.publish import write_report
from rlcore.compare.report import Group
from rlcore.compare.repository import Repository, tail
from rlcore.compare.results import CellResult, PipelinePaths, cell_metrics, cell_problems
from rlcore.config import Config, ConfigError, parse_config, read_yaml
from rlcore.tracking import open_run


def run_cells(repo: Repository, spec: CompareSpec, cells: list[Cell], base: dict[str, Any], paths: PipelinePaths,
              log_dir: Path) -> list[CellResult]:
    """Each cell as an experiment (or read back from an earlier one), failures caught; the workspace is back at
    the baseline afterwards, whatever happened."""
    existing = repo.experiments()
    if spec.rerun:
        repo.remove([c.name(spec.name) for c in cells if c.name(spec.name) in existing])
        existing = repo.experiments()
    results = []
    with repo.baseline_kept():
        for i, cell in enumerate(cells, 1):
            result = _one_cell(repo, spec, cell, base, paths, log_dir, existing)
            status = "ok" if result.ok else "FAILED"
            took = "" if result.wall_s is None else f" in {result.wall_s:.0f} s"
            print(f"compare {spec.name}: cell {i}/{len(cells)} {cell.label()}: {status}{took} ({result.experiment})",
                  file=sys.stderr, flush=True)
            if not result.ok:
                print("  " + (result.error or "").replace("\n", "\n  "), file=sys.stderr, flush=True)
            results.append(result)
    return results


def _one_cell(repo: Repository, spec: CompareSpec, cell: Cell, base: dict[str, Any], paths: PipelinePaths,
              log_dir: Path, existing: dict[str, str]) -> CellResult:
    name = cell.name(spec.name)
    result = CellResult(cell.label(), dict(cell.values), name, log=str(log_dir / f"{name}.log"))
    try:
        cfg = cell_config(base, spec.fixed, cell)
    except ConfigError as err:  # this cell's values cannot work: reported, never run
        result.error = f"invalid params: {err}"
        return result
    if name not in existing:
        repo.restore()
        sets = [f"{k}={v}" for k, v in (*spec.fixed.items(), *cell.values)]
        code, result.wall_s = repo.run_experiment(name, sets, log_dir / f"{name}.log")
        if code != 0:
            result.error = f"dvc exp run exited with {code}; the last lines:\n{tail(log_dir / f'{name}.log')}"
            return result
        existing.update(repo.experiments())
        if name not in existing:
            result.error = f"dvc exp run succeeded but dvc exp show lists no experiment {name}"
            return result
    result.rev = existing[name]
    try:
        result.metrics, result.curve = cell_metrics(lambda p: repo.read(existing[name], p), paths, cfg)
        result.problems = cell_problems(lambda p: repo.read(existing[name], p), paths)
    except (FileNotFoundError, KeyError, ValueError) as err:
        result.error = f"its results are incomplete: {err}"
    return result


def run_compare(spec: CompareSpec, *, root: Path, params_file: Path, out_dir: Path, docs_dir: Path | None,
                command: str, baseline: str | None = None, alpha: float = 0.05) -> dict[str, Any]:
    """Run the grid (:func:`run_cells`), then write the report into ``out_dir`` (``report.md``, ``<name>.png``,
    ``results.json``, ``logs/``; :func:`rlcore.compare.publish.write_report`, against the ``baseline`` group at
    level ``alpha``), log it to MLflow and copy the page, the PNG and the data into ``docs_dir``. Returns the
    comparison's data."""
    base = read_yaml(params_file.read_text()) or {}
    check_keys(base, [*spec.grid, *spec.fixed])
    baseline_cfg = parse_config(base, str(params_file))
    repo = Repository(root)
    commit = repo.check()
    paths = PipelinePaths.from_dvc_yaml(root / "dvc.yaml")
    cells = grid_cells(spec.grid, spec.seed_key)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    results = run_cells(repo, spec, cells, base, paths, out_dir / "logs")
    wall = time.monotonic() - start
    ran = [r.wall_s for r in results if r.wall_s is not None and r.ok]
    header = {"command": f"`{command}`", "params": f"params.yaml of git commit {commit[:10]}, with --set: "
              f"{', '.join(f'{k}={v}' for k, v in spec.fixed.items()) or 'none'}",
              "grid": ", ".join(f"`{k}` = {', '.join(v)}" for k, v in spec.grid.items()),
              "cells": f"{len(results)} ({sum(r.ok for r in results)} finished, {sum(not r.ok for r in results)} failed)",
              "time": f"{wall:.0f} s for this run" + (_cell_times(ran) if ran else ""),
              "experiments": f"`dvc exp show` lists them as {spec.name}-<hash>",
              "measured": f"{datetime.date.today().isoformat()}, on a machine of {os.cpu_count()} CPUs"}
    data = {"name": spec.name, "command": command, "baseline": commit, "grid": spec.grid, "fixed": spec.fixed,
            "seed_key": spec.seed_key, "wall_s": wall, "k": baseline_cfg.evaluate.k, "header": header,
            "cells": [asdict(r) for r in results]}
    groups, _ = write_report(data, out_dir=out_dir, docs_dir=docs_dir, params=base, baseline=baseline, alpha=alpha)
    _log_to_mlflow(baseline_cfg, spec, root, out_dir, groups, commit)
    return data


def _cell_times(seconds: list[float]) -> str:
    if len(seconds) == 1:
        return f"; the cell that ran took {seconds[0]:.0f} s"
    return (f"; the {len(seconds)} cells that ran took {min(seconds):.0f}-{max(seconds):.0f} s each (mean "
            f"{sum(seconds) / len(seconds):.0f} s)")


def _log_to_mlflow(cfg: Config, spec: CompareSpec, root: Path, out_dir: Path, groups: list[Group], commit: str) -> None:
    """A run of its own, named ``compare-<name>``, tagged ``rlcore.stage`` = ``compare`` and ``rlcore.compare`` =
    the name: the grid as params, each group's means as metrics, the report as artifacts."""
    params = {"compare": {"name": spec.name, "grid": {k: ",".join(v) for k, v in spec.grid.items()},
                          "set": spec.fixed, "seed_key": spec.seed_key, "baseline": commit}}
    with open_run(cfg.tracking, stage="compare", params=params, root=root, run_name=f"compare-{spec.name}",
                  extra_tags={"rlcore.compare": spec.name}) as tracker:
        for g in groups:
            label = "".join(ch if ch.isalnum() or ch in "._-/ " else "_" for ch in g.label)
            tracker.log_metrics({f"{key}_mean/{label}": s.mean for key, s in g.stats.items() if s is not None})
        for name in ("report.md", f"{spec.name}.png", "results.json"):
            if (out_dir / name).is_file():  # (no PNG when no cell finished)
                tracker.log_artifact(out_dir / name)
