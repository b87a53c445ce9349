"""The recipes' results tables for docs/results/recipes.md, from what ``bench.recipe_seeds --out FILE.json`` wrote.

    .venv/bin/python -m bench.recipe_table --results docs/results/data/recipes.json > tables.md

The first table has one row per recipe in examples/ (alphabetical): the held-out greedy pass@1 of the SFT model and
after RL as the mean and range over the seeds, each seed's gain, the mean gain with its 95% confidence interval
(Student's t over the seeds: a seed's gain holds both the training's randomness and the test split's sampling), the
median minutes per seed (where the rows kept them), and when and where it was measured (a row's ``measured`` field;
``--measured`` for rows without one); a recipe not in the file says so. The second compares each recipe's gain with
``grpo``'s (the default recipe), seed by seed, as ``rlcore compare`` compares its groups (a paired t test over the
seeds, Holm's correction over the recipes, the seeds 80% power needs; rlcore.compare.report): only the recipes on
``grpo``'s task (the same test problems for a seed) measured on the same machine with the same kernels as a set of
``grpo``'s rows. Those are ``grpo``'s own and any kept under ``grpo_<why>`` (``grpo``'s rows from before a change of
the kernels' arithmetic), so each recipe is paired with the default recipe as it ran beside it. A recipe with a control
of its own, kept as ``<recipe>_grpo`` (the same recipe with ``algorithm.adv_estimator=grpo``: ``distill``'s student
trained by GRPO from the same SFT models), is compared with that instead (bench.figures renders the pair).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rlcore.compare.report import Group, against_baseline, baseline_section, format_stat, summarize
from rlcore.compare.results import CellResult
from rlcore.compare.stats import t_interval
from rlcore.recipes import compose

REPO = Path(__file__).resolve().parents[1]
BASELINE = "grpo"


def spread(values: list[float]) -> str:
    """``mean (min-max)`` to three decimals."""
    return f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def recipe_rows(results: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Each recipe of examples/ (alphabetical, ``quick`` left out) and its rows in ``results`` (a run may carry
    ``--set`` values of its machine's own, the two-node cluster's address: ``two-node --set ...``)."""
    out = {}
    for path in sorted((REPO / "examples").glob("*.yaml")):
        if path.stem != "quick":
            out[path.stem] = next((v for k, v in results.items()
                                   if k == path.stem or k.startswith(path.stem + " --set")), [])
    return out


def table(results: dict[str, list[dict]], measured: str = "") -> str:
    lines = ["| recipe | SFT greedy pass@1 | after RL | gain, each seed | mean gain [95% CI] | minutes per seed | "
             "measured |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, rows in recipe_rows(results).items():
        if not rows:
            lines.append(f"| `{name}` | not measured | | | | | |")
            continue
        gains = [r["gain"] for r in rows]
        seeds = " / ".join(f"{g:+.3f}" for g in gains)
        timed = [r["minutes"] for r in rows if "minutes" in r]  # (rows measured before the field was kept have none)
        minutes = f"{statistics.median(timed):.0f}" if timed else "not kept"
        lines.append(f"| `{name}` (seeds {', '.join(str(r['seed']) for r in rows)}) | "
                     f"{spread([r['sft'] for r in rows])} | {spread([r['final'] for r in rows])} | {seeds} | "
                     f"**{format_stat(t_interval(gains), signed=True)}** | {minutes} | "
                     f"{rows[0].get('measured', measured)} |")
    return "\n".join(lines)


def machine(measured: str) -> tuple[str, str]:
    """Where a row ran: the CPU and the kernels its ``measured`` field names (its second and third parts:
    ``2026-11-28, 2-core Intel Xeon (AVX-512), portable kernels (rlcore's own products)``). Rows differing in either
    ran other arithmetic, so their seeds' SFT models and rounds are other floats and do not pair."""
    parts = [p.strip() for p in measured.split(",")]
    return (parts[1] if len(parts) > 1 else measured), (parts[2] if len(parts) > 2 else "")


def against_grpo(results: dict[str, list[dict]], alpha: float = 0.05) -> list[str]:
    """The sections comparing each recipe's gain with ``grpo``'s, paired by seed (one section for each set of
    ``grpo``'s rows some recipe ran beside), and the recipes left out."""
    rows = recipe_rows(results)
    # the task's settings but its preference pairs (a reward model's data), which leave the test problems alone
    task = compose([REPO / "examples" / f"{BASELINE}.yaml"])[0].task.model_dump(exclude={"pairs"})
    baselines = {machine(runs[0].get("measured", "")): name for name, runs in results.items()
                 if runs and (name == BASELINE or name.startswith(BASELINE + "_"))}
    paired: dict[str, list[str]] = {}
    left_out: list[str] = []
    for name, runs in rows.items():
        if name == BASELINE:
            continue
        if not runs:
            left_out.append(f"`{name}` (not measured)")
        elif compose([REPO / "examples" / f"{name}.yaml"])[0].task.model_dump(exclude={"pairs"}) != task:
            left_out.append(f"`{name}` (another task)")
        elif f"{name}_grpo" in results:  # its own control: the recipe with GRPO, from the same SFT models
            left_out.append(f"`{name}` (compared with its own GRPO control `{name}_grpo`)")
        elif (where := machine(runs[0].get("measured", ""))) not in baselines:
            left_out.append(f"`{name}` (no `grpo` rows on {' with '.join(p for p in where if p)})")
        else:
            paired.setdefault(baselines[where], []).append(name)
    lines: list[str] = []
    for base in sorted(paired, key=lambda b: (b != BASELINE, b)):
        lines += [*_paired_section(results[base], base, paired[base], rows, alpha), ""]
    return [*lines, "Not compared with `grpo`: " + ", ".join(left_out) + "."]


def _paired_section(base_rows: list[dict], base: str, names: list[str], rows: dict[str, list[dict]],
                    alpha: float) -> list[str]:
    """One baseline's section: ``names``' gains against the ``grpo`` rows ``base`` holds, seed by seed."""
    cells = [CellResult(name, {"seed": str(r["seed"]), "recipe": name}, "", metrics={"gain": r["gain"]})
             for name, runs in ((base, base_rows), *((n, rows[n]) for n in names)) for r in runs]
    groups: list[Group] = summarize(cells, ("recipe",))
    for g in groups:
        g.label = g.label.removeprefix("recipe=")
    where = ", ".join(p for p in machine(base_rows[0].get("measured", "")) if p)
    chosen = "the default recipe" + ("" if base == BASELINE else f": `grpo`'s rows measured on {where}")
    return baseline_section(against_baseline(groups, base, "seed", alpha=alpha, chosen=chosen), "recipe")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", required=True)
    ap.add_argument("--measured", default="", help="the measured column of rows without their own")
    args = ap.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    print(table(results, args.measured) + "\n\n" + "\n".join(against_grpo(results)))


if __name__ == "__main__":
    main()
