"""``rlcore compare``: a grid of params values over seeds, each cell a DVC experiment, one report
(:mod:`rlcore.compare`)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from rlcore.errors import ConfigError

HELP = ("run a grid of params values (x seeds) as DVC experiments and write a report: means with confidence intervals, "
        "paired differences against a baseline with Holm's correction, the seeds a difference needs, curves")
EXAMPLE = ("rlcore compare --name estimators --grid algorithm.adv_estimator=grpo,rloo,opo --grid seed=1,2,3 "
           "--set ppo.rounds.r1.steps=200")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="a params key and its values (comma separated, each read as YAML); repeatable: every "
                        "combination is one cell")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a params override every cell runs with; repeatable")
    p.add_argument("--name", default=None,
                   help="the comparison's name: experiments <name>-<hash>, the report compare/<name>/, "
                        "docs/results/compare-<name>.md (default: the grid's non-seed keys)")
    p.add_argument("--seed-key", default="seed", help="the grid key whose values are seeds (default: seed)")
    p.add_argument("--out", default=None, metavar="DIR", help="report folder (default: compare/<name>)")
    p.add_argument("--docs-dir", default="docs/results", metavar="DIR",
                   help="where the page and the PNG are copied (default: docs/results; '' = nowhere)")
    p.add_argument("--rerun", action="store_true",
                   help="run cells again whose experiment exists already (default: read them back)")
    p.add_argument("--dry-run", action="store_true", help="list the cells and their experiment names, run nothing")
    p.add_argument("--baseline", default=None, metavar="GROUP",
                   help="the group every other is compared with, by its label (algorithm.adv_estimator=grpo) or its "
                        "values (grpo) (default: the group that runs params.yaml's own values, with --set)")
    p.add_argument("--alpha", type=float, default=0.05,
                   help="significance level of the tests, after Holm's correction; the intervals are 1 - alpha "
                        "(default: 0.05)")
    p.add_argument("--from-results", default=None, metavar="FILE.json",
                   help="run nothing: write the report again from a comparison's stored results (its results.json, "
                        "or the copy under docs/results/data/), e.g. with another --baseline or --alpha")


def default_name(grid: dict[str, list[str]], seed_key: str) -> str:
    keys = [k.rsplit(".", 1)[-1] for k in grid if k != seed_key] or ["seeds"]
    return "-".join(keys)


def run(args: argparse.Namespace) -> int:
    from rlcore.commands.common import parse_overrides
    from rlcore.compare.grid import CompareSpec, check_cells, grid_cells, parse_grid
    from rlcore.compare.publish import choose_baseline, grid_labels, report_from_results
    from rlcore.compare.run import run_compare

    if not 0 < args.alpha < 1:
        raise ConfigError(f"--alpha {args.alpha}: expected a level between 0 and 1, e.g. 0.05")
    root = Path.cwd()
    if args.from_results:
        if args.grid or args.overrides:
            raise ConfigError("--from-results writes a stored comparison's report; it takes no --grid or --set")
        data = report_from_results(Path(args.from_results), out_dir=Path(args.out) if args.out else None,
                                   docs_dir=Path(args.docs_dir) if args.docs_dir else None,
                                   params_file=root / "params.yaml", baseline=args.baseline, alpha=args.alpha)
        print(f"{data['name']}: report written from {args.from_results}")
        return 0
    grid = parse_grid(args.grid)
    parse_overrides(args.overrides)  # the same KEY=VALUE checks as every command's --set
    fixed = {k.strip(): v.strip() for k, v in (item.split("=", 1) for item in args.overrides)}
    overlap = sorted(set(fixed) & set(grid))
    if overlap:
        raise ConfigError(f"--set {overlap[0]} is also a --grid key; give it in one of them")
    name = args.name or default_name(grid, args.seed_key)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ConfigError(f"--name {name!r}: letters, digits, '.', '_' and '-' only (it names experiments and files)")
    spec = CompareSpec(name=name, grid=grid, fixed=fixed, seed_key=args.seed_key, rerun=args.rerun)
    if args.baseline is not None:  # a typo stops the comparison now, not after hours of cells
        choose_baseline(grid_labels(grid, args.seed_key), args.baseline)
    params = root / "params.yaml"
    if not params.is_file():
        raise ConfigError(f"{params}: params file not found (run rlcore compare at the repository's root)")
    if args.dry_run:
        problems = check_cells(spec, params)
        for cell in grid_cells(grid, args.seed_key):
            problem = problems.get(cell)
            print(f"{cell.name(name)}  {cell.label()}" + (f"  (invalid: {problem})" if problem else ""))
        return 0
    words = [*(f"--grid={g}" for g in args.grid), *(f"--set={o}" for o in args.overrides), f"--name={name}"]
    if args.seed_key != "seed":
        words.append(f"--seed-key={args.seed_key}")
    out = Path(args.out) if args.out else root / "compare" / name
    data = run_compare(spec, root=root, params_file=params, out_dir=out,
                       docs_dir=Path(args.docs_dir) if args.docs_dir else None,
                       command="rlcore compare " + shlex.join(words), baseline=args.baseline, alpha=args.alpha)
    failed = sum(1 for c in data["cells"] if c["error"])
    print(f"{out / 'report.md'}: {len(data['cells']) - failed} cell(s) finished, {failed} failed")
    return 0
