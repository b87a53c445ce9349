"""The report's files from a comparison's data (its ``results.json``): after a run, and again from stored results
(``rlcore compare --from-results FILE``) with another baseline or level, running nothing."""

from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlcore.compare.report import Baseline, Group, against_baseline, plot_curves, render_markdown, summarize
from rlcore.compare.results import CellResult
from rlcore.config import (MOVED_FROM_BYPASS, MOVED_TO_LOSS, ConfigError, apply_overrides, flatten, parse_config,
                           read_yaml)


def cell_from_dict(d: dict[str, Any]) -> CellResult:
    """A cell as ``results.json`` stores it (``dataclasses.asdict``), back as a :class:`CellResult`."""
    known = set(CellResult.__dataclass_fields__)
    cell = CellResult(**{k: v for k, v in d.items() if k in known})
    cell.curve = [(int(step), float(acc)) for step, acc in cell.curve]
    return cell


def current_key(key: str) -> str:
    """A params key as this rlcore names it: stored results of a comparison run before the actor's loss keys moved
    into ``actor.loss`` name them the old way (``actor.policy_loss`` is ``actor.loss.name`` now)."""
    section, _, rest = key.partition(".")
    first, _, inner = rest.partition(".")
    if section != "actor" or first not in MOVED_TO_LOSS:
        return key
    if first == "bypass":
        return f"actor.loss.{MOVED_FROM_BYPASS.get(inner, inner)}"
    return f"actor.loss.{MOVED_TO_LOSS[first]}"


def default_baseline(groups: list[Group], group_keys: tuple[str, ...], params: dict[str, Any],
                     fixed: dict[str, str]) -> tuple[str, str]:
    """The group that runs the params' own values (params.yaml with the ``--set`` overrides), and how it was
    chosen; the first group when none does. Keys a stored comparison names the old way are read as today's."""
    overrides = {current_key(k): read_yaml(v) for k, v in fixed.items()}
    values = flatten(parse_config(apply_overrides(json.loads(json.dumps(params)), overrides)).model_dump(mode="json"))
    for g in groups:
        cell = g.cells[0].values
        if group_keys and all(current_key(k) in values and read_yaml(cell[k]) == values[current_key(k)]
                              for k in group_keys):
            return g.label, "the params' own values, the default; another with --baseline"
    return groups[0].label, "the first group: none runs the params' own values; another with --baseline"


def choose_baseline(labels: list[str], requested: str) -> str:
    """The group label ``requested`` names: the label itself (``algorithm.adv_estimator=grpo``) or its values
    (``grpo``; with several keys, space or comma separated); a ConfigError listing the labels otherwise."""
    for label in labels:
        values = [part.split("=", 1)[-1] for part in label.split(" ")]
        if requested in (label, " ".join(values), ",".join(values)):
            return label
    raise ConfigError(f"--baseline {requested!r}: no such group; expected one of " + ", ".join(map(repr, labels)))


def grid_labels(grid: dict[str, list[str]], seed_key: str) -> list[str]:
    """The labels of the groups a grid makes (every combination of its non-seed keys' values), so that a
    ``--baseline`` is checked before the grid runs."""
    keys = [k for k in grid if k != seed_key]
    return [" ".join(f"{k}={v}" for k, v in zip(keys, combo)) or "all cells"
            for combo in itertools.product(*(grid[k] for k in keys))]


def write_report(data: dict[str, Any], *, out_dir: Path, docs_dir: Path | None, params: dict[str, Any],
                 baseline: str | None = None, alpha: float = 0.05, power: float = 0.8) -> tuple[list[Group], Baseline]:
    """From a comparison's data: ``out_dir``'s ``report.md``, ``results.json`` (the data with each group's
    statistics and the differences against the baseline) and, where the cells have curves, ``<name>.png``; the
    page, the PNG and the data copied to ``docs_dir`` (``compare-<name>.md``, ``compare-<name>.png``,
    ``data/compare-<name>.json``). Without curves (stored results that kept none) the page shows the PNG already
    in ``docs_dir``, if there is one."""
    name, seed_key = data["name"], data["seed_key"]
    results = [cell_from_dict(c) for c in data["cells"]]
    group_keys = tuple(k for k in data["grid"] if k != seed_key)
    groups = summarize(results, group_keys, 1 - alpha)
    label, chosen = default_baseline(groups, group_keys, params, data["fixed"])
    if baseline is not None:
        label, chosen = choose_baseline([g.label for g in groups], baseline), "chosen with --baseline"
    versus = against_baseline(groups, label, seed_key, alpha=alpha, power=power, chosen=chosen)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = None
    if any(c.curve for c in results):
        png = plot_curves(groups, out_dir / f"{name}.png", f"rlcore compare {name}").name
    (out_dir / "report.md").write_text(render_markdown(name, groups, header=data["header"], png=png, k=data["k"],
                                                       baseline=versus))
    data = {**data, "cells": [asdict(r) for r in results], "alpha": alpha, "baseline_group": label,
            "groups": [{"label": g.label, "ok": g.ok, "n": len(g.cells),
                        "stats": {key: None if s is None else asdict(s) for key, s in g.stats.items()},
                        "curve": g.curve} for g in groups],
            "against_baseline": [asdict(v) for v in versus.rows]}
    (out_dir / "results.json").write_text(json.dumps(data, indent=1))
    if docs_dir is not None:
        (docs_dir / "data").mkdir(parents=True, exist_ok=True)
        docs_png = docs_dir / f"compare-{name}.png"
        if png is not None:
            shutil.copyfile(out_dir / png, docs_png)
        shown = docs_png.name if docs_png.is_file() else None
        (docs_dir / f"compare-{name}.md").write_text(render_markdown(name, groups, header=data["header"], png=shown,
                                                                     k=data["k"], baseline=versus))
        (docs_dir / "data" / f"compare-{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    return groups, versus


def report_from_results(path: Path, *, out_dir: Path | None, docs_dir: Path | None, params_file: Path,
                        baseline: str | None, alpha: float) -> dict[str, Any]:
    """The report written again from a stored ``results.json`` (or its copy under docs/results/data/) into
    ``out_dir`` (default: compare/<name> beside ``params_file``) and ``docs_dir``."""
    try:
        data = json.loads(path.read_text())
        missing = [k for k in ("name", "grid", "fixed", "seed_key", "header", "k", "cells") if k not in data]
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"--from-results {path}: cannot read it ({err})") from None
    if missing:
        raise ConfigError(f"--from-results {path}: not a comparison's results.json (no {', '.join(missing)})")
    params = read_yaml(params_file.read_text()) or {}
    options = (f" --baseline {baseline}" if baseline else "") + (f" --alpha {alpha:g}" if alpha != 0.05 else "")
    data["header"] = {**data["header"], "report": f"written from these results, running nothing: `rlcore compare "
                      f"--from-results {path}{options}`"}
    write_report(data, out_dir=out_dir or params_file.parent / "compare" / data["name"], docs_dir=docs_dir,
                 params=params, baseline=baseline, alpha=alpha)
    return data
