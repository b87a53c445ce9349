"""The report of a comparison: mean and sample standard deviation over seeds per group of cells, the markdown page
and the plot of held-out accuracy over RL steps."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from rlcore.compare.results import METRICS, CellResult


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
