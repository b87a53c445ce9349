"""``rlcore view``: a PPO round's rollouts parquet as one self-contained HTML page (:mod:`rlcore.viewer`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlcore.commands.common import add_config_options, config_from
from rlcore.errors import ConfigError, InputNotFound

HELP = "render a PPO round's rollouts as one HTML page: search, filters, sorting, per-step reward/length chart"
EXAMPLE = "rlcore view --rollouts metrics/ppo_r1_rollouts.parquet --out r1.html"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rollouts", default=None, metavar="FILE",
                   help="rollouts parquet (default: metrics/ppo_<evaluate.final_round>_rollouts.parquet, "
                        "the final round's, from the params)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="HTML page to write (default: the rollouts path with .html)")
    add_config_options(p)


def run(args: argparse.Namespace) -> int:
    from rlcore.viewer import read_rollouts, rollouts_path, write_page

    final_round = None if args.rollouts else config_from(args, runs=False).evaluate.final_round
    source = args.rollouts or rollouts_path(final_round)
    out = Path(args.out) if args.out else Path(source).with_suffix(".html")
    if out.resolve() == Path(source).resolve():
        raise ConfigError(f"--out {str(out)!r} is the rollouts file itself; name another file")
    try:
        df = read_rollouts(source)
    except InputNotFound as err:
        if final_round is None:
            raise
        raise InputNotFound(f"{err} (evaluate.final_round is {final_round!r}: run its round first, "
                            f"dvc repro ppo@{final_round})") from None
    print(write_page(df, out, title=f"rollouts: {source}"))
    return 0
