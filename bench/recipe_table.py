"""The recipes' results table for docs/results/recipes.md, from what ``bench.recipe_seeds --out FILE.json`` wrote.

    .venv/bin/python -m bench.recipe_table --results runs/results.json > table.md

One row per recipe in examples/ (alphabetical): the held-out greedy pass@1 of the SFT model and after RL as the mean
and range over the seeds, each seed's gain and their mean, the median minutes per seed (where the rows kept them),
and when and where it was measured (a row's ``measured`` field; ``--measured`` for rows without one); a recipe not
in the file says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def spread(values: list[float]) -> str:
    """``mean (min-max)`` to three decimals."""
    return f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def table(results: dict[str, list[dict]], measured: str = "") -> str:
    lines = ["| recipe | SFT greedy pass@1 | after RL | gain, each seed | mean gain | minutes per seed | measured |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for path in sorted((REPO / "examples").glob("*.yaml")):
        if path.stem == "quick":
            continue
        # (a run may carry --set values of its machine's own: the two-node cluster's address)
        rows = next((v for k, v in results.items() if k == path.stem or k.startswith(path.stem + " --set")), [])
        if not rows:
            lines.append(f"| `{path.stem}` | not measured | | | | | |")
            continue
        gains = [r["gain"] for r in rows]
        seeds = " / ".join(f"{g:+.3f}" for g in gains)
        timed = [r["minutes"] for r in rows if "minutes" in r]  # (rows measured before the field was kept have none)
        minutes = f"{statistics.median(timed):.0f}" if timed else "not kept"
        lines.append(f"| `{path.stem}` (seeds {', '.join(str(r['seed']) for r in rows)}) | "
                     f"{spread([r['sft'] for r in rows])} | {spread([r['final'] for r in rows])} | {seeds} | "
                     f"**{statistics.mean(gains):+.3f}** | {minutes} | {rows[0].get('measured', measured)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", required=True)
    ap.add_argument("--measured", default="", help="the measured column of rows without their own")
    args = ap.parse_args(argv)
    print(table(json.loads(Path(args.results).read_text()), args.measured))


if __name__ == "__main__":
    main()
