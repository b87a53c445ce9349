"""What every stage script shares: argument parsing, config loading, clean failures, outputs.

A stage declares the params sections it reads (``PARAMS``); :func:`stage_config`
hands it only those, so a stage cannot depend on a key that dvc.yaml does not list.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from rlcore.config import Config, ConfigError, load_config, section_dict

REPO_ROOT = Path.cwd()


def parser(doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--metrics", required=True, help="metrics JSON to write")
    return p


@contextmanager
def stage_errors(stage: str) -> Iterator[None]:
    """Bad params, missing files and bad rows end the stage with one line and exit code 2."""
    try:
        yield
    except (ConfigError, FileNotFoundError, ValueError, KeyError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"{stage}: error: {msg}", file=sys.stderr)
        raise SystemExit(2) from None


def require_file(path: str, what: str) -> None:
    if not Path(path).exists():
        raise FileNotFoundError(f"{what} {path!r} not found (run the earlier stages: dvc repro)")


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
