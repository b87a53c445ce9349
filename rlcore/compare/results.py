"""One cell's results, read from its experiment commit: where the pipeline writes them (:class:`PipelinePaths`, from
``dvc.yaml``) and the metrics, curves and per-problem results a report compares."""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlcore.config import Config
from rlcore.errors import UserError


@dataclass(frozen=True)
class PipelinePaths:
    """Where a cell's results are, as ``dvc.yaml`` declares them (``{round}`` for the round's name)."""

    eval_metrics: str
    round_metrics: str
    round_plots: str
    eval_problems: str | None = None
    """The evaluate stage's per-problem results (its ``--problems`` file); None in a pipeline without them."""

    @classmethod
    def from_dvc_yaml(cls, path: Path) -> PipelinePaths:
        """The evaluate stage's metrics file and the ppo stage's (``foreach`` over the rounds) metrics and plots."""
        try:
            stages = yaml.safe_load(path.read_text())["stages"]
            ppo = stages["ppo"]["do"]
            problems = re.search(r"--problems\s+(\S+)", stages["evaluate"]["cmd"])
            return cls(eval_metrics=_first(stages["evaluate"]["metrics"]),
                       round_metrics=_first(ppo["metrics"]).replace("${key}", "{round}"),
                       round_plots=_first(ppo["plots"]).replace("${key}", "{round}"),
                       eval_problems=problems.group(1) if problems else None)
        except (OSError, KeyError, TypeError, IndexError, yaml.YAMLError) as err:
            raise UserError(f"{path}: expected an evaluate stage with metrics and a ppo stage (foreach over the "
                            f"rounds) with metrics and plots ({type(err).__name__}: {err})") from None


def _first(entries: list) -> str:
    entry = entries[0]
    return entry if isinstance(entry, str) else next(iter(entry))


# ---------------------------------------------------------------------------------------- one cell's results


@dataclass
class CellResult:
    """What one cell gave: its metrics and held-out curve, or why it failed."""

    label: str
    values: dict[str, str]
    experiment: str
    rev: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    curve: list[tuple[int, float]] = field(default_factory=list)
    """``(RL steps done, held-out greedy pass@1)``; steps count on across rounds."""
    wall_s: float | None = None
    """Seconds ``dvc exp run`` took (None: read back from an earlier run)."""
    error: str | None = None
    """The failure: exit code and the last lines of the cell's output."""
    log: str | None = None
    problems: dict[str, list[int]] | None = None
    """Greedy correctness (1/0) per test problem of the ``sft`` and ``final`` models, where the run stored it."""

    @property
    def ok(self) -> bool:
        return self.error is None


# the report's columns: key in CellResult.metrics, heading
METRICS = (("gain", "held-out greedy pass@1 gain"), ("pass_at_k", "sampled pass@k"),
           ("reward", "final reward (last 10 steps)"), ("s_per_step", "seconds per step"))


def cell_metrics(read: Any, paths: PipelinePaths, cfg: Config) -> tuple[dict[str, float], list[tuple[int, float]]]:
    """A finished cell's metrics and curve from ``read(path) -> text`` (the files of its experiment commit):
    ``gain`` = ``gain/greedy_pass@1`` and ``pass_at_k`` = ``final/pass@<evaluate.k>`` of the evaluate stage,
    ``reward`` = the final round's ``ppo/reward_last10``, ``s_per_step`` = the mean ``timing_s/step`` over every
    round's steps; the curve is the rounds' ``val/greedy_pass@1`` rows, after the first round's initial value."""
    ev = json.loads(read(paths.eval_metrics))
    rounds = list(cfg.ppo.rounds)
    final = json.loads(read(paths.round_metrics.format(round=cfg.evaluate.final_round)))
    first = json.loads(read(paths.round_metrics.format(round=rounds[0])))
    steps: list[float] = []
    curve: list[tuple[int, float]] = []
    if "ppo/val_greedy_pass@1_first" in first:
        curve.append((0, float(first["ppo/val_greedy_pass@1_first"])))
    done = 0
    for name in rounds:
        rows = list(csv.DictReader(io.StringIO(read(paths.round_plots.format(round=name)))))
        steps += [float(r["timing_s/step"]) for r in rows if r.get("timing_s/step")]
        curve += [(done + int(r["step"]) + 1, float(r["val/greedy_pass@1"])) for r in rows
                  if r.get("val/greedy_pass@1")]
        done += cfg.ppo.rounds[name].steps
        if name == cfg.evaluate.final_round:
            break
    metrics = {"gain": float(ev["gain/greedy_pass@1"]), "pass_at_k": float(ev[f"final/pass@{cfg.evaluate.k}"]),
               "reward": float(final["ppo/reward_last10"])}
    if steps:
        metrics["s_per_step"] = sum(steps) / len(steps)
    return metrics, curve


def cell_problems(read: Any, paths: PipelinePaths) -> dict[str, list[int]] | None:
    """The evaluate stage's per-problem results, ``{"sft": [1, 0, ...], "final": [...]}`` in the test split's order,
    from ``read(path) -> text``; None where the pipeline or the run (one from before they were written) has none."""
    if paths.eval_problems is None:
        return None
    try:
        rows = list(csv.DictReader(io.StringIO(read(paths.eval_problems))))
    except FileNotFoundError:
        return None
    return {name: [int(r[name]) for r in rows] for name in ("sft", "final")}
