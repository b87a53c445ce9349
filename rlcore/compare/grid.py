"""The grid of ``rlcore compare``: what it was asked (:class:`CompareSpec`), its cells, and each cell's params checked
before anything runs."""

from __future__ import annotations

import difflib
import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from rlcore.config import Config, ConfigError, apply_overrides, flatten, parse_config, read_yaml


@dataclass(frozen=True)
class Cell:
    """One combination of the grid's values (raw strings, as given on the command line)."""

    values: tuple[tuple[str, str], ...]
    """``(key, value)`` in the grid's key order."""

    def label(self, keys: tuple[str, ...] | None = None) -> str:
        return " ".join(f"{k}={v}" for k, v in self.values if keys is None or k in keys)

    def name(self, prefix: str) -> str:
        """The experiment's name: the comparison's, and a hash of this cell's values (stable however the grid is
        reordered, so a cell run before is found again)."""
        digest = hashlib.sha1(json.dumps(sorted(self.values)).encode()).hexdigest()[:8]
        return f"{prefix}-{digest}"

    def get(self, key: str) -> str | None:
        return dict(self.values).get(key)


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """``["a.b=1,2", "seed=1,2,3"]`` -> ``{"a.b": ["1", "2"], "seed": ["1", "2", "3"]}``; a key given twice, an
    empty value or a repeated value is a ConfigError naming it."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--grid {item!r}: expected KEY=V1,V2,... with a dotted params key")
        if key in grid:
            raise ConfigError(f"--grid {key}: given twice; list all its values in one --grid")
        parts = [v.strip() for v in values.split(",")]
        if any(not v for v in parts):
            raise ConfigError(f"--grid {item!r}: an empty value (values are separated by commas)")
        if len(set(parts)) != len(parts):
            raise ConfigError(f"--grid {item!r}: a value is repeated")
        grid[key] = parts
    if not grid:
        raise ConfigError("rlcore compare needs at least one --grid KEY=V1,V2,...")
    return grid


def grid_cells(grid: dict[str, list[str]], seed_key: str) -> list[Cell]:
    """Every combination, the seed key's values outermost (a run stopped early has whole seeds compared)."""
    keys = sorted(grid, key=lambda k: k != seed_key)  # stable: the seed key first, the others as given
    return [Cell(tuple(zip(keys, combo))) for combo in itertools.product(*(grid[k] for k in keys))]


def cell_config(base: dict[str, Any], fixed: dict[str, str], cell: Cell) -> Config:
    """The config a cell runs with: the baseline params, the fixed overrides, then the cell's values (each
    value read as YAML, as ``dvc exp run -S`` reads it)."""
    overrides = {k: read_yaml(v) for k, v in (*fixed.items(), *cell.values)}
    return parse_config(apply_overrides(json.loads(json.dumps(base)), overrides), f"cell {cell.label()}")


def check_keys(base: dict[str, Any], keys: list[str]) -> None:
    """Every grid and ``--set`` key must name a value or section of the params: a typo stops the whole
    comparison before anything runs (each cell would fail the same way)."""
    leaves = flatten(parse_config(base).model_dump(mode="json"))
    known = set(leaves) | {k.rsplit(".", i)[0] for k in leaves for i in range(1, k.count(".") + 1)}
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"--grid/--set {key}: not a params key{hint}")


def check_cells(spec: CompareSpec, params_file: Path) -> dict[Cell, str]:
    """The keys checked (a ConfigError for a typo), then each cell's params: ``{cell: error}`` for those that
    cannot load."""
    base = read_yaml(params_file.read_text()) or {}
    check_keys(base, [*spec.grid, *spec.fixed])
    problems = {}
    for cell in grid_cells(spec.grid, spec.seed_key):
        try:
            cell_config(base, spec.fixed, cell)
        except ConfigError as err:
            problems[cell] = str(err)
    return problems


@dataclass(frozen=True)
class CompareSpec:
    """What ``rlcore compare`` was asked."""

    name: str
    grid: dict[str, list[str]]
    fixed: dict[str, str]
    """``--set`` overrides, raw ``KEY=VALUE`` strings split at the first ``=``."""
    seed_key: str = "seed"
    rerun: bool = False
    """Run cells again whose experiment exists already."""
