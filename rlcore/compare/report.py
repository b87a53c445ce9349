"""The report of a comparison: each group's mean over seeds with its confidence interval, every group's paired
difference against a baseline group (t tests over seeds, Holm's correction, the seeds 80% power needs;
:mod:`rlcore.compare.stats`), the markdown page and the plot of held-out accuracy over RL steps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlcore.compare.results import METRICS, CellResult
from rlcore.compare.stats import (MOST_SEEDS, Difference, Interval, holm, paired_difference, seeds_needed,
                                  split_variance, t_interval)


@dataclass
class Group:
    """The cells that share the values of the grid's non-seed keys."""

    label: str
    cells: list[CellResult]
    stats: dict[str, Interval | None]
    """Each metric's mean and confidence interval over the successful seeds."""
    curve: list[tuple[int, float, float | None, int]]
    """``(step, mean, std, seeds)`` at the steps every successful seed has."""

    @property
    def ok(self) -> int:
        return sum(c.ok for c in self.cells)

    def by_seed(self, key: str, seed_key: str) -> dict[str, CellResult]:
        """The successful cells that have metric ``key``, by their seed (``""`` in a grid without seeds)."""
        return {c.values.get(seed_key, ""): c for c in self.cells if c.ok and key in c.metrics}


def summarize(results: list[CellResult], group_keys: tuple[str, ...], level: float = 0.95) -> list[Group]:
    """Groups in order of first appearance, with each metric's mean and ``level`` confidence interval over the
    successful cells and the curve's mean and std at the steps they all have."""
    groups: dict[str, list[CellResult]] = {}
    for r in results:
        label = " ".join(f"{k}={r.values[k]}" for k in group_keys) or "all cells"
        groups.setdefault(label, []).append(r)
    out = []
    for label, cells in groups.items():
        ok = [c for c in cells if c.ok]
        stats = {key: t_interval([c.metrics[key] for c in ok if key in c.metrics], level) for key, _ in METRICS}
        out.append(Group(label, cells, stats, _mean_curve([dict(c.curve) for c in ok])))
    return out


def _mean_curve(curves: list[dict[int, float]]) -> list[tuple[int, float, float | None, int]]:
    if not curves:
        return []
    common = sorted(set.intersection(*(set(c) for c in curves)))
    points = []
    for step in common:
        s = t_interval([c[step] for c in curves])
        assert s is not None
        points.append((step, s.mean, s.sd, s.n))
    return points


# ----------------------------------------------------------------------------------------- against a baseline


@dataclass
class Versus:
    """One group's gain against the baseline group's, paired by seed."""

    label: str
    difference: Difference | None
    """None: no seed finished in both."""
    p_holm: float | None = None
    seeds_needed: int | None = None
    """Seeds a paired t test needs for the chosen power at the observed difference and spread."""
    test_share: float | None = None
    """Where every paired cell stored per-problem results: the share of the difference's variance between seeds
    that the test split's sampling explains (at most 1)."""


@dataclass
class Baseline:
    """Every other group against the baseline group, with the level and power the tests use."""

    label: str
    rows: list[Versus]
    alpha: float
    power: float
    chosen: str
    """How the baseline was chosen, for the page."""

    def significant(self) -> list[Versus]:
        return [v for v in self.rows if v.p_holm is not None and v.p_holm < self.alpha]


def against_baseline(groups: list[Group], label: str, seed_key: str, *, alpha: float = 0.05, power: float = 0.8,
                     chosen: str = "") -> Baseline:
    """Each group's gain minus the baseline group's on the seeds both finished: mean, confidence interval at
    1 - ``alpha``, paired t test, Holm's adjustment over the groups tested, and the seeds that ``power`` needs at
    the level Holm's method asks of the smallest of those p-values (``alpha`` / tests), which is enough for any
    of them."""
    base = next(g for g in groups if g.label == label).by_seed("gain", seed_key)
    rows = []
    for g in groups:
        if g.label == label:
            continue
        mine = g.by_seed("gain", seed_key)
        diff = paired_difference({s: c.metrics["gain"] for s, c in mine.items()},
                                 {s: c.metrics["gain"] for s, c in base.items()}, 1 - alpha)
        v = Versus(g.label, diff)
        if diff is not None:
            v.test_share = _test_share(diff, [mine[s] for s in diff.seeds], [base[s] for s in diff.seeds])
        rows.append(v)
    tested = [(v, d, d.p) for v in rows if (d := v.difference) is not None and d.p is not None]
    for (v, diff, _), adjusted in zip(tested, holm([p for _, _, p in tested])):
        v.p_holm = adjusted
        v.seeds_needed = seeds_needed(diff.interval.mean, diff.interval.sd, alpha / len(tested), power)
    return Baseline(label, rows, alpha, power, chosen)


def _test_share(diff: Difference, mine: list[CellResult], theirs: list[CellResult]) -> float | None:
    """The test split's share of the variance of the per-seed differences, from the cells' per-problem gains
    (final model right minus SFT model right); None without per-problem results or spread."""
    if diff.interval.sd is None or diff.interval.sd == 0 or not all(c.problems for c in (*mine, *theirs)):
        return None

    def gains(c: CellResult) -> list[int]:
        assert c.problems is not None
        return [f - s for f, s in zip(c.problems["final"], c.problems["sft"])]

    within = split_variance([gains(c) for c in mine], [gains(c) for c in theirs])
    return min(1.0, within / diff.interval.sd ** 2)


# ------------------------------------------------------------------------------------------------- report


def format_stat(s: Interval | None, digits: int = 3, signed: bool = False) -> str:
    """``mean [low, high]``; the mean alone with one seed; n/a for none."""
    if s is None:
        return "n/a"
    sign = "+" if signed else ""
    mean = f"{s.mean:{sign}.{digits}f}"
    if s.low is None or s.high is None:
        return mean
    return f"{mean} [{s.low:{sign}.{digits}f}, {s.high:{sign}.{digits}f}]"


def format_p(p: float | None) -> str:
    if p is None:
        return "n/a"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def render_markdown(name: str, groups: list[Group], *, header: dict[str, str], png: str | None, k: int,
                    baseline: Baseline | None = None) -> str:
    """The report page: what ran, the table per group, the differences against the baseline, the curves,
    failures and every cell's numbers."""
    level = 0.95 if baseline is None else 1 - baseline.alpha
    lines = [f"# Comparison `{name}`", ""]
    lines += [f"- **{key}**: {value}" for key, value in header.items()]
    lines += ["", f"Each figure is the mean over the seeds that finished, with its {level:.0%} confidence interval in "
              "brackets (Student's t over the seeds, n - 1 degrees of freedom; one seed: no interval). A seed's figure "
              "holds both the training's randomness and the test split's sampling, so the spread between seeds is the "
              "whole error. Gain: held-out greedy pass@1 of the final model minus the SFT model's "
              "(`gain/greedy_pass@1`); pass@k: sampled, final model; final reward: mean reward of the final "
              "round's last 10 steps; seconds per step: mean wall time of an RL step (`timing_s/step`).", ""]
    headings = [h.replace("pass@k", f"pass@{k}") for _, h in METRICS]
    lines += ["| group | seeds ok | " + " | ".join(headings) + " |", "|---" * (2 + len(METRICS)) + "|"]
    for g in groups:
        cols = [format_stat(g.stats["gain"], signed=True), format_stat(g.stats["pass_at_k"]),
                format_stat(g.stats["reward"]), format_stat(g.stats["s_per_step"])]
        lines.append(f"| {g.label} | {g.ok}/{len(g.cells)} | " + " | ".join(cols) + " |")
    if baseline is not None:
        lines += ["", *baseline_section(baseline)]
    if png is not None:
        lines += ["", f"![held-out greedy pass@1 over RL steps]({png})", "",
                  "Held-out greedy pass@1 over RL steps (`val/greedy_pass@1` of each round's plot CSV, steps counted "
                  "across rounds): the mean over seeds, with a band of one standard deviation."]
    lines.append("")
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


def baseline_section(b: Baseline, what: str = "group") -> list[str]:
    """The page's section on the differences against the baseline (each ``what``: a group, a recipe): what the
    numbers are, the table, and which differences are significant."""
    tested = sum(v.p_holm is not None for v in b.rows)
    share = any(v.test_share is not None for v in b.rows)
    lines = [f"## Against `{b.label}`", "",
             f"The baseline is `{b.label}` ({b.chosen}). Each other {what}'s gain minus the baseline's, seed by seed "
             "(a seed gives both the same data and test problems, and the same SFT model where they differ only in "
             f"later stages), as the mean difference with its {1 - b.alpha:.0%} confidence interval. p: the "
             "two-sided paired t test over those seeds. p (Holm): the p-values adjusted for the "
             f"{tested} test{'s' if tested != 1 else ''} by Holm's step-down method, which keeps the chance of any "
             f"false \"significant\" among them at most {b.alpha:g}; significant: p (Holm) below {b.alpha:g}. "
             f"Seeds for {b.power:.0%} power: how many seeds a paired t test needs to find a true difference of the "
             f"observed size {b.power:.0%} of the time at the level Holm's method asks of the smallest p-value "
             f"({b.alpha:g} / {tested}), if the spread between seeds is the observed one: an estimate, since a few "
             "seeds measure a spread roughly."]
    if share:
        lines[-1] += (" Test split's share: the part of the difference's variance between seeds that the test "
                      "split's sampling explains (from the cells' per-problem results): near 1, a bigger test split "
                      "narrows the interval as well as more seeds would; near 0, only more seeds do.")
    cols = [what, "seeds", "gain minus the baseline's", "p", "p (Holm)", f"significant at {b.alpha:g}",
            f"seeds for {b.power:.0%} power", *(["test split's share"] if share else [])]
    lines += ["", "| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    for v in b.rows:
        if v.difference is None:
            lines.append(f"| {v.label} | 0 | no seed finished in both |" + " |" * (len(cols) - 3))
            continue
        cells = [v.label, str(len(v.difference.seeds)), format_stat(v.difference.interval, signed=True),
                 format_p(v.difference.p), format_p(v.p_holm),
                 "n/a" if v.p_holm is None else ("yes" if v.p_holm < b.alpha else "no"), _seeds_text(v)]
        if share:
            cells.append("n/a" if v.test_share is None else f"{v.test_share:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    found = b.significant()
    listed = ", ".join(f"`{v.label}` ({v.difference.interval.mean:+.3f})" for v in found if v.difference)
    lines += ["", f"**Significant at {b.alpha:g} after Holm's correction**: "
              + (f"{listed}: {len(found)} of {tested}." if found else f"none of the {tested} differences.")]
    return lines


def _seeds_text(v: Versus) -> str:
    assert v.difference is not None
    s = v.difference.interval
    if s.sd is None:
        return "n/a (one seed)"
    if v.seeds_needed is None:
        return "the same on every seed" if s.sd <= 1e-12 else "no difference observed"
    return f"more than {MOST_SEEDS}" if v.seeds_needed > MOST_SEEDS else str(v.seeds_needed)


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
