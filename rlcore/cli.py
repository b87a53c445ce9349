"""What every stage script shares: argument parsing, config loading, clean failures, outputs.

A stage declares the params sections it reads (``PARAMS``); :func:`stage_config`
hands it only those, so a stage cannot depend on a key that dvc.yaml does not list.
Importing this module loads no torch, pandas, pyarrow or ray: a stage validates its params
and input paths before anything heavy starts.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from rlcore.config import Config, load_config, section_dict
from rlcore.errors import InputNotFound, UserError

REPO_ROOT = Path.cwd()


def parser(doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--metrics", required=True, help="metrics JSON to write")
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt, so every ``finally`` and
    context manager on the way out runs (worker groups stopped, the MLflow run marked KILLED)."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated("SIGTERM")


@contextmanager
def stage_errors(stage: str) -> Iterator[None]:
    """How a stage ends when something goes wrong.

    * Bad input (``rlcore.errors.UserError``: params, paths, data rows, model folders): one line on
      stderr naming the key, file or row, exit code 2.
    * Ctrl-C or SIGTERM: one line, exit code 130 or 143.
    * Anything else is a bug: it propagates with its full traceback (exit code 1).
    """
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except UserError as err:
        print(f"{stage}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except Terminated:
        print(f"{stage}: terminated (SIGTERM)", file=sys.stderr)
        raise SystemExit(128 + signal.SIGTERM) from None
    except KeyboardInterrupt:
        print(f"{stage}: interrupted", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def require_file(path: str, what: str) -> None:
    if not Path(path).exists():
        raise InputNotFound(f"{what} {path!r} not found (run the earlier stages: dvc repro)")


class DeclaredConfig:
    """A view of Config that refuses sections the stage did not declare in dvc.yaml."""

    def __init__(self, cfg: Config, sections: tuple[str, ...], stage: str):
        self._cfg, self._sections, self._stage = cfg, frozenset(sections), stage

    def __getattr__(self, name: str) -> Any:
        if name not in self._sections:
            raise AttributeError(f"stage {self._stage} reads params section {name!r}, which it does not declare "
                                 f"(declared: {', '.join(sorted(self._sections))}); add it to PARAMS and dvc.yaml")
        return getattr(self._cfg, name)


def stage_config(path: str, sections: tuple[str, ...], stage: str) -> tuple[Config, dict[str, Any]]:
    """The config, validated as a whole, as seen by ``stage``, and its declared sections as plain data."""
    cfg = load_config(path)
    return DeclaredConfig(cfg, sections, stage), section_dict(cfg, sections)  # type: ignore[return-value]


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
