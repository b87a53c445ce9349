"""The house, measured: lines per package of rlcore/ and the longest functions, for one or more git revisions side by
side.

    .venv/bin/python -m bench.house 6602b89 HEAD [--out docs/results/house.md]

Each revision is read from git itself (``git archive`` into a scratch folder), so the working tree is not touched
and any commit can be compared with any other. Lines are physical lines of ``.py`` files; a function's length is
``end_lineno - lineno + 1`` of its ``def`` (decorators not counted), over rlcore/, stages/ and tests/ (bench/ is
left out: benchmarks are long scripts on purpose; tests/algos/anchors/ too: copies of verl's and TRL's functions,
kept as their authors wrote them).
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LONG = 80  # the house rule: no function longer than this outside bench/
SKIPPED = ("bench/", "tests/algos/anchors/")


def tree(rev: str, into: Path) -> Path:
    """The files of ``rev`` under ``into``."""
    data = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def package_lines(root: Path) -> Counter:
    """Lines of rlcore/'s .py files by package (``rlcore/<pkg>``; ``rlcore`` for the modules at its top)."""
    out: Counter = Counter()
    for path in (root / "rlcore").rglob("*.py"):
        parts = path.relative_to(root).parts
        out["rlcore/" + parts[1] if len(parts) > 2 else "rlcore"] += len(path.read_text().splitlines())
    return out


def functions(root: Path) -> list[tuple[int, str, str]]:
    """(lines, file, name) of every function of rlcore/, stages/ and tests/ outside :data:`SKIPPED`, longest first."""
    out = []
    for top in ("rlcore", "stages", "tests"):
        for path in (root / top).rglob("*.py"):
            rel = str(path.relative_to(root))
            if rel.startswith(SKIPPED):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.append((node.end_lineno - node.lineno + 1, rel, node.name))
    return sorted(out, reverse=True)


def report(revs: list[str]) -> str:
    revs = [subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.strip() for rev in revs]  # HEAD and branch names as commits
    with tempfile.TemporaryDirectory() as tmp:
        rows = {}
        for rev in revs:
            root = tree(rev, Path(tmp) / rev.replace("/", "_"))
            fns = functions(root)
            rows[rev] = (package_lines(root), fns)
    heads = " | ".join(f"`{r}`" for r in revs)
    lines = [f"| package | {heads} |", "| --- |" + " ---: |" * len(revs)]
    packages = sorted(set().union(*(r[0] for r in rows.values())))
    for pkg in packages:
        lines.append(f"| {pkg} | " + " | ".join(str(rows[r][0].get(pkg, "")) for r in revs) + " |")
    lines.append("| **all of rlcore/** | " + " | ".join(f"**{sum(rows[r][0].values())}**" for r in revs) + " |")
    lines += ["", f"| | {heads} |", "| --- |" + " ---: |" * len(revs)]
    lines.append(f"| functions over {LONG} lines (rlcore/, stages/, tests/) | "
                 + " | ".join(str(sum(n > LONG for n, _, _ in rows[r][1])) for r in revs) + " |")
    for rev in revs:
        lines += ["", f"Longest functions at `{rev}`:", ""]
        lines += [f"* {n} lines: `{f}` `{name}`" for n, f, name in rows[rev][1][:8]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("revs", nargs="+", help="git revisions, side by side in this order")
    ap.add_argument("--out", default=None, help="write the markdown here (default: print it)")
    args = ap.parse_args(argv)
    text = report(args.revs)
    if args.out:
        Path(args.out).write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
