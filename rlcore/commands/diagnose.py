"""``rlcore diagnose``: is this machine ready to run the pipeline? One line per check, exit code 1 on a failure.

The checks live in :mod:`rlcore.diagnose`; this module parses the options, prints the report
(lines as each check finishes, or one JSON object with ``--json``) and picks the exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rlcore import diagnose
from rlcore.commands.common import add_config_options, params_source, parse_overrides
from rlcore.config import Config, apply_overrides, load_config, parse_config
from rlcore.errors import UserError

HELP = "check this machine for the pipeline: Python, packages, torch/CUDA, Ray, DVC, MLflow, disk, model"
EXAMPLE = "rlcore diagnose --skip ray   |   rlcore diagnose --json --timeout 20"

COLOURS = {"ok": "\033[32m", "warn": "\033[33m", "fail": "\033[31m"}
RESET = "\033[0m"


def check_names(text: str) -> list[str]:
    """``ray`` or ``ray,dvc`` -> the names, each one a registered check."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in diagnose.CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown check {', '.join(unknown) or text!r}; "
                                         f"checks: {', '.join(diagnose.CHECKS)}")
    return names


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_options(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (checks with status, detail, fix; counts) instead of lines")
    p.add_argument("--skip", action="extend", type=check_names, default=[], metavar="CHECK[,CHECK]",
                   help=f"leave checks out (repeatable): {', '.join(diagnose.CHECKS)}; "
                        "ray starts (or joins) Ray, a few seconds")
    p.add_argument("--timeout", type=positive_seconds, default=diagnose.DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"seconds each check may take (default {diagnose.DEFAULT_TIMEOUT_S:g})")


def load_params(source: str | None, overrides: list[str]) -> tuple[Config, diagnose.Check]:
    """The config for the other checks and the ``params`` line. Params that do not validate are a
    failure on that line (the other checks then see the built-in defaults), not the end of the report."""
    where = source if source is not None else "built-in defaults (no params.yaml here)"
    try:
        values = parse_overrides(overrides)
        cfg = load_config(source, values) if source is not None else parse_config(apply_overrides({}, values), "--set")
    except UserError as err:
        return Config(), diagnose.Check("params", "fail", str(err),
                                        "correct the params (rlcore config check shows the same error); "
                                        "the checks below use the built-in defaults")
    extra = f" with {len(overrides)} --set override(s)" if overrides else ""
    return cfg, diagnose.Check("params", "ok", f"{where}{extra}: valid")


def format_check(check: diagnose.Check, colour: bool) -> str:
    """``ok    torch     2.13.0, CUDA: no (CPU only)`` and, for warn/fail, ``      -> what to do``."""
    status = f"{check.status:<5}"
    if colour:
        status = f"{COLOURS[check.status]}{status}{RESET}"
    line = f"{status} {check.name:<9} {check.detail}"
    return line + (f"\n{'':6}-> {check.fix}" if check.status != "ok" else "")


def summary(checks: list[diagnose.Check]) -> dict[str, int]:
    return {s: sum(c.status == s for c in checks) for s in diagnose.STATUSES}


def run(args: argparse.Namespace) -> int:
    skip = list(dict.fromkeys(args.skip))
    cfg, params = load_params(params_source(args), args.overrides)
    ctx = diagnose.Context(cfg=cfg, root=diagnose.repo_root(Path.cwd()), timeout_s=args.timeout)
    colour = not args.json and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    checks = []
    for check in [params, *diagnose.run_checks(ctx, skip=set(skip))]:
        checks.append(check)
        if not args.json:
            print(format_check(check, colour), flush=True)
    counts = summary(checks)
    if args.json:
        print(json.dumps({"checks": [{"name": c.name, "status": c.status, "detail": c.detail, "fix": c.fix,
                                      "seconds": c.seconds} for c in checks],
                          "counts": counts, "skipped": skip, "ok": counts["fail"] == 0}, indent=2))
    else:
        skipped = f" (skipped: {', '.join(skip)})" if skip else ""
        verdict = "ready" if counts["fail"] == 0 else "not ready: fix the fail lines above"
        n = len(checks)
        print(f"{n} check{'s' if n != 1 else ''}: {counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail"
              f"{skipped}; {verdict}")
    return 1 if counts["fail"] else 0
