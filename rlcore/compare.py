"""Compare recipes over seeds: a grid of params values, each cell one DVC experiment, one report.

``rlcore compare --grid algorithm.adv_estimator=grpo,rloo --grid seed=1,2,3`` (``rlcore.commands.compare``)
runs every combination of the grid's values (with ``--set`` overrides fixed for all) as ``dvc exp run -n <cell>
-S key=value ...`` in the repository, one after the other. The stages a cell does not change (data, SFT and
scoring, for a grid over RL keys) are not run again: DVC finds them up to date, or restores them from its run
cache when an earlier cell ran them with the same params (another seed's). Each cell starts from the committed
baseline (tracked files restored), so a failed cell leaves nothing behind; it is reported (which cell, the last
lines of its output, the log file) and the next one runs. A cell already run as an experiment of the same
baseline is read back, not run again (a comparison stopped half way goes on where it stopped; ``rerun`` runs it
again). ``dvc exp show`` lists the cells' experiments under their names.

Each cell's results come from its experiment commit (``git show <rev>:<path>``, the paths from ``dvc.yaml``):
the evaluate stage's metrics (held-out greedy pass@1 gain, sampled pass@k), the final round's metrics (the mean
reward of its last 10 steps) and every round's plot CSV (seconds per step, the held-out greedy pass@1 curve).
The report groups the cells by the values of the grid's other keys and gives, per group, the mean and sample
standard deviation over its seeds, a PNG of the held-out accuracy over RL steps (the mean over seeds with a
band of one standard deviation), a markdown page, and the raw numbers as JSON; it is logged to MLflow as a run
of its own (tag ``rlcore.stage`` = ``compare``) and the page and PNG are copied to ``docs/results/``.
"""

from __future__ import annotations

import csv
import difflib
import hashlib
import io
import itertools
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlcore.config import Config, ConfigError, apply_overrides, flatten, parse_config
from rlcore.errors import UserError

TAIL_LINES = 12  # output lines of a failed cell shown in the report


# ------------------------------------------------------------------------------------------------- the grid


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
    overrides = {k: yaml.safe_load(v) for k, v in (*fixed.items(), *cell.values)}
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
    base = yaml.safe_load(params_file.read_text()) or {}
    check_keys(base, [*spec.grid, *spec.fixed])
    problems = {}
    for cell in grid_cells(spec.grid, spec.seed_key):
        try:
            cell_config(base, spec.fixed, cell)
        except ConfigError as err:
            problems[cell] = str(err)
    return problems


# ------------------------------------------------------------------------------------------ pipeline paths


@dataclass(frozen=True)
class PipelinePaths:
    """Where a cell's results are, as ``dvc.yaml`` declares them (``{round}`` for the round's name)."""

    eval_metrics: str
    round_metrics: str
    round_plots: str

    @classmethod
    def from_dvc_yaml(cls, path: Path) -> PipelinePaths:
        """The evaluate stage's metrics file and the ppo stage's (``foreach`` over the rounds) metrics and plots."""
        try:
            stages = yaml.safe_load(path.read_text())["stages"]
            ppo = stages["ppo"]["do"]
            return cls(eval_metrics=_first(stages["evaluate"]["metrics"]),
                       round_metrics=_first(ppo["metrics"]).replace("${key}", "{round}"),
                       round_plots=_first(ppo["plots"]).replace("${key}", "{round}"))
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


# --------------------------------------------------------------------------------------------- aggregation


@dataclass
class Stat:
    mean: float
    std: float | None
    """Sample standard deviation over the seeds (ddof 1); None with one seed."""
    n: int


def mean_std(values: list[float]) -> Stat | None:
    """Mean and sample standard deviation (n - 1 in the denominator); None for no values."""
    if not values:
        return None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return Stat(mean, None, 1)
    return Stat(mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)), len(values))


@dataclass
class Group:
    """The cells that share the values of the grid's non-seed keys."""

    label: str
    cells: list[CellResult]
    stats: dict[str, Stat | None]
    curve: list[tuple[int, float, float | None, int]]
    """``(step, mean, std, seeds)`` at the steps every successful seed has."""

    @property
    def ok(self) -> int:
        return sum(c.ok for c in self.cells)


def summarize(results: list[CellResult], group_keys: tuple[str, ...]) -> list[Group]:
    """Groups in order of first appearance, with each metric's mean and std over the successful cells and the
    curve's mean and std at the steps they all have."""
    groups: dict[str, list[CellResult]] = {}
    for r in results:
        label = " ".join(f"{k}={r.values[k]}" for k in group_keys) or "all cells"
        groups.setdefault(label, []).append(r)
    out = []
    for label, cells in groups.items():
        ok = [c for c in cells if c.ok]
        stats = {key: mean_std([c.metrics[key] for c in ok if key in c.metrics]) for key, _ in METRICS}
        out.append(Group(label, cells, stats, _mean_curve([dict(c.curve) for c in ok])))
    return out


def _mean_curve(curves: list[dict[int, float]]) -> list[tuple[int, float, float | None, int]]:
    if not curves:
        return []
    common = sorted(set.intersection(*(set(c) for c in curves)))
    points = []
    for step in common:
        s = mean_std([c[step] for c in curves])
        assert s is not None
        points.append((step, s.mean, s.std, s.n))
    return points


# ------------------------------------------------------------------------------------------------- report


def format_stat(s: Stat | None, digits: int = 3, signed: bool = False) -> str:
    if s is None:
        return "n/a"
    mean = f"{s.mean:+.{digits}f}" if signed else f"{s.mean:.{digits}f}"
    return mean if s.std is None else f"{mean} ± {s.std:.{digits}f}"


def render_markdown(name: str, groups: list[Group], *, header: dict[str, str], png: str, k: int) -> str:
    """The report page: what ran, the table per group, the curves, failures and every cell's numbers."""
    lines = [f"# Comparison `{name}`", ""]
    lines += [f"- **{key}**: {value}" for key, value in header.items()]
    lines += ["", "Mean ± sample standard deviation over the seeds that finished (n - 1 in the denominator; one seed: "
              "no ±). Gain: held-out greedy pass@1 of the final model minus the SFT model's "
              "(`gain/greedy_pass@1`); pass@k: sampled, final model; final reward: mean reward of the final "
              "round's last 10 steps; seconds per step: mean wall time of an RL step (`timing_s/step`).", ""]
    headings = [h.replace("pass@k", f"pass@{k}") for _, h in METRICS]
    lines += ["| group | seeds ok | " + " | ".join(headings) + " |", "|---" * (2 + len(METRICS)) + "|"]
    for g in groups:
        cols = [format_stat(g.stats["gain"], signed=True), format_stat(g.stats["pass_at_k"]),
                format_stat(g.stats["reward"]), format_stat(g.stats["s_per_step"])]
        lines.append(f"| {g.label} | {g.ok}/{len(g.cells)} | " + " | ".join(cols) + " |")
    lines += ["", f"![held-out greedy pass@1 over RL steps]({png})", "",
              "Held-out greedy pass@1 over RL steps (`val/greedy_pass@1` of each round's plot CSV, steps counted "
              "across rounds): the mean over seeds, with a band of one standard deviation.", ""]
    failed = [c for g in groups for c in g.cells if not c.ok]
    if failed:
        lines += ["## Failed cells", ""]
        for c in failed:
            lines += [f"- `{c.label}` (log: `{c.log}`):", "", "  ```", *[f"  {x}" for x in (c.error or "").splitlines()],
                      "  ```", ""]
    lines += ["## Every cell", "", "| cell | experiment | " + " | ".join(headings) + " | dvc exp run s |",
              "|---" * (3 + len(METRICS)) + "|"]
    for g in groups:
        for c in g.cells:
            nums = [f"{c.metrics[key]:.4f}" if key in c.metrics else "-" for key, _ in METRICS]
            wall = "failed" if not c.ok else ("earlier run" if c.wall_s is None else f"{c.wall_s:.0f}")
            lines.append(f"| {c.label} | {c.experiment} | " + " | ".join(nums) + f" | {wall} |")
    return "\n".join(lines) + "\n"


def plot_curves(groups: list[Group], path: Path, title: str) -> Path:
    """One line per group (mean over seeds) with a band of one standard deviation, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for g in groups:
        if not g.curve:
            continue
        steps = [p[0] for p in g.curve]
        mean = [p[1] for p in g.curve]
        (line,) = ax.plot(steps, mean, marker="o", markersize=3, label=f"{g.label} (n={g.curve[-1][3]})")
        if any(p[2] is not None for p in g.curve):
            std = [p[2] or 0.0 for p in g.curve]
            ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                            color=line.get_color(), alpha=0.18, linewidth=0)
    ax.set_xlabel("RL steps")
    ax.set_ylabel("held-out greedy pass@1")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------------ DVC


class Repository:
    """The DVC repository the cells run in (commands with the current Python's environment first on PATH, so
    the stages run the interpreter that has rlcore)."""

    def __init__(self, root: Path):
        self.root = root
        bin_dir = str(Path(sys.executable).parent)
        self.env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
        local = Path(bin_dir) / "dvc"
        self.dvc = str(local) if local.exists() else (shutil.which("dvc") or "dvc")

    def _run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, cwd=self.root, env=self.env, capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise UserError(f"`{' '.join(cmd)}` failed in {self.root}: {(proc.stderr or proc.stdout).strip()[-500:]}")
        return proc

    def check(self) -> str:
        """The baseline commit; a UserError unless this is a DVC repository with a commit and no uncommitted
        change to a tracked file (each cell starts from the commit, so such a change would be lost)."""
        if not (self.root / "dvc.yaml").is_file() or not (self.root / ".dvc").is_dir():
            raise UserError(f"{self.root}: not a DVC repository (no dvc.yaml or .dvc/); run rlcore compare in one")
        head = self._run("git", "rev-parse", "--verify", "HEAD", check=False)
        if head.returncode != 0:
            raise UserError(f"{self.root}: no git commit yet; dvc exp run needs one (git add -A && git commit)")
        changed = [line[3:] for line in self._run("git", "status", "--porcelain", "--untracked-files=no").stdout.splitlines()
                   if line.strip()]
        if changed:
            files = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            raise UserError(f"uncommitted changes to tracked files ({files}): commit or stash them; every cell starts "
                            "from the last commit, the baseline of its experiment")
        return head.stdout.strip()

    def restore(self) -> None:
        """Tracked files back to the baseline commit (params.yaml, dvc.lock, metrics, plots)."""
        self._run("git", "checkout", "HEAD", "--", ".")

    @contextmanager
    def baseline_kept(self) -> Iterator[None]:
        """Leave the workspace as it was, whatever runs inside: tracked files come back from the commit, DVC's
        cached outputs from its cache (``dvc checkout``), and its uncached outputs that git does not track (a
        round's rollouts, the evaluation samples) from a copy taken on the way in."""
        from dvc.repo import Repo

        with Repo(str(self.root)) as dvc_repo:
            uncached = [Path(out.fs_path) for out in dvc_repo.index.outs if not out.use_cache]
        with tempfile.TemporaryDirectory() as tmp:
            saved = []
            for path in uncached:
                if path.is_file():
                    rel = path.relative_to(self.root)
                    (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, Path(tmp) / rel)
                    saved.append(rel)
            try:
                yield
            finally:
                self.restore()
                if self._run(self.dvc, "checkout", "--force", "-q", check=False).returncode != 0:
                    print("rlcore compare: warning: some of the baseline's DVC outputs are not in the cache (it never "
                          "ran here?), so the workspace holds the last cell's; `dvc status` lists them, `dvc repro` "
                          "or `dvc pull` brings them back", file=sys.stderr)
                for rel in saved:
                    (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(Path(tmp) / rel, self.root / rel)

    def experiments(self) -> dict[str, str]:
        """``{name: rev}`` of the baseline's experiments (``dvc exp show --json``)."""
        proc = self._run(self.dvc, "exp", "show", "--json", "--no-fetch", check=False)
        if proc.returncode != 0:
            proc = self._run(self.dvc, "exp", "show", "--json")
        found: dict[str, str] = {}
        for baseline in json.loads(proc.stdout or "[]"):
            for exp in baseline.get("experiments") or []:
                for rev in exp.get("revs") or []:
                    if rev.get("name") and rev.get("rev"):
                        found[rev["name"]] = rev["rev"]
        return found

    def remove(self, names: list[str]) -> None:
        if names:
            self._run(self.dvc, "exp", "remove", *names)

    def run_experiment(self, name: str, sets: list[str], log: Path) -> tuple[int, float]:
        """``dvc exp run -n name -S ...``, its output (stdout and stderr) to ``log`` and echoed; exit code, seconds."""
        cmd = [self.dvc, "exp", "run", "-n", name, *itertools.chain.from_iterable(("-S", s) for s in sets)]
        start = time.monotonic()
        with log.open("w") as out:
            out.write(f"$ {shlex.join(cmd)}\n")
            out.flush()
            proc = subprocess.Popen(cmd, cwd=self.root, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
            code = proc.wait()
        return code, time.monotonic() - start

    def read(self, rev: str, path: str) -> str:
        proc = self._run("git", "show", f"{rev}:{path}", check=False)
        if proc.returncode != 0:
            raise FileNotFoundError(f"{path} is not in experiment commit {rev[:10]}")
        return proc.stdout


def tail(path: Path, n: int = TAIL_LINES) -> str:
    """The last ``n`` non-blank lines of a log as a terminal shows them (a progress bar's line is its last
    redraw, after its last carriage return)."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", path.read_text(errors="replace"))  # colours, cursor moves
    shown = (line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n"))
    lines = [line for line in shown if line.strip()]
    return "\n".join(lines[-n:])


# ------------------------------------------------------------------------------------------------ the loop


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
    except (FileNotFoundError, KeyError, ValueError) as err:
        result.error = f"its results are incomplete: {err}"
    return result


def run_compare(spec: CompareSpec, *, root: Path, params_file: Path, out_dir: Path, docs_dir: Path | None,
                command: str) -> dict[str, Any]:
    """Run the grid (:func:`run_cells`), then write the report into ``out_dir`` (``report.md``, ``<name>.png``,
    ``results.json``, ``logs/``), log it to MLflow and copy the page and the PNG into ``docs_dir``. Returns the
    report's data (``results.json``)."""
    base = yaml.safe_load(params_file.read_text()) or {}
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
    group_keys = tuple(k for k in spec.grid if k != spec.seed_key)
    groups = summarize(results, group_keys)
    ran = [r.wall_s for r in results if r.wall_s is not None and r.ok]
    header = {"command": f"`{command}`", "baseline": f"git commit {commit[:10]} (params.yaml, with --set: "
              f"{', '.join(f'{k}={v}' for k, v in spec.fixed.items()) or 'none'})",
              "grid": ", ".join(f"`{k}` = {', '.join(v)}" for k, v in spec.grid.items()),
              "cells": f"{len(results)} ({sum(r.ok for r in results)} finished, {sum(not r.ok for r in results)} failed)",
              "time": f"{wall:.0f} s for this run" + (_cell_times(ran) if ran else ""),
              "experiments": f"`dvc exp show` lists them as {spec.name}-<hash>"}
    png = plot_curves(groups, out_dir / f"{spec.name}.png", f"rlcore compare {spec.name}")
    k = baseline_cfg.evaluate.k
    page = render_markdown(spec.name, groups, header=header, png=png.name, k=k)
    (out_dir / "report.md").write_text(page)
    data = {"name": spec.name, "command": command, "baseline": commit, "grid": spec.grid, "fixed": spec.fixed,
            "seed_key": spec.seed_key, "wall_s": wall, "cells": [asdict(r) for r in results],
            "groups": [{"label": g.label, "ok": g.ok, "n": len(g.cells),
                        "stats": {key: None if s is None else asdict(s) for key, s in g.stats.items()},
                        "curve": g.curve} for g in groups]}
    (out_dir / "results.json").write_text(json.dumps(data, indent=1))
    if docs_dir is not None:
        docs_dir.mkdir(parents=True, exist_ok=True)
        docs_png = docs_dir / f"compare-{spec.name}.png"
        shutil.copyfile(png, docs_png)
        (docs_dir / f"compare-{spec.name}.md").write_text(page.replace(f"]({png.name})", f"]({docs_png.name})"))
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
    from rlcore.tracking import open_run

    params = {"compare": {"name": spec.name, "grid": {k: ",".join(v) for k, v in spec.grid.items()},
                          "set": spec.fixed, "seed_key": spec.seed_key, "baseline": commit}}
    with open_run(cfg.tracking, stage="compare", params=params, root=root, run_name=f"compare-{spec.name}",
                  extra_tags={"rlcore.compare": spec.name}) as tracker:
        for g in groups:
            label = "".join(ch if ch.isalnum() or ch in "._-/ " else "_" for ch in g.label)
            tracker.log_metrics({f"{key}_mean/{label}": s.mean for key, s in g.stats.items() if s is not None})
        for name in ("report.md", f"{spec.name}.png", "results.json"):
            tracker.log_artifact(out_dir / name)
