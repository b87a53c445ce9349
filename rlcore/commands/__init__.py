"""The ``rlcore`` console command: everything around training (generate, eval, serve, view, ...).

One module per subcommand. Each defines ``HELP`` (one line for ``rlcore --help``), ``EXAMPLE``
(shown by ``rlcore <command> --help``), ``add_arguments(parser)`` and ``run(args) -> int``. Modules
import nothing heavy at the top, so ``rlcore --help`` and ``rlcore config check`` start in well under
a second; torch, transformers, ray and pandas load inside ``run``.

Every command runs inside :func:`rlcore.stage.frame.stage_errors`: bad input (params, paths, data rows,
model folders) ends with one line on stderr and exit code 2, Ctrl-C with 130, a bug keeps its
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from rlcore.heap import script

# name -> module, in the order ``rlcore --help`` lists them
COMMANDS = ("generate", "eval", "serve", "view", "diagnose", "config", "init-model", "export", "compare")


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"rlcore.commands.{name.replace('-', '_')}")


def build_parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="rlcore", description="rlcore: the tools around RL post-training (the pipeline itself is `dvc repro`).",
        epilog="Run `rlcore <command> --help` for a command's options and an example.")
    sub = top.add_subparsers(dest="command", metavar="<command>", required=True)
    for name in COMMANDS:
        mod = _module(name)
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP, epilog=f"example:\n  {mod.EXAMPLE}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, _name=name)
    return top


def main(argv: list[str] | None = None) -> int:
    from rlcore.stage.frame import stage_errors

    args = build_parser().parse_args(argv)
    with stage_errors(f"rlcore {args._name}"):
        return int(args._run(args) or 0)


def entry() -> None:
    """The console script (``[project.scripts]``; ``python -m rlcore``)."""
    sys.exit(script(main))
