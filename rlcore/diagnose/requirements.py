"""What rlcore declares it needs (``requires-python``, ``[project] dependencies``), from the checkout's
pyproject.toml or the installed metadata: read by the ``python`` and ``packages`` checks."""

from __future__ import annotations

import importlib.metadata
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

DISTRIBUTION = "rlcore"


@dataclass(frozen=True)
class Declared:
    """What rlcore declares it needs: ``requires-python`` and ``[project] dependencies``."""

    requires_python: str | None
    dependencies: tuple[str, ...]
    source: str
    """``pyproject.toml`` (the checkout's, when the working tree is rlcore's) or ``installed metadata``."""
    stale: tuple[str, ...] = field(default=())
    """Requirements on which the installed metadata and pyproject.toml disagree (an old ``pip install``)."""


def _applies(text: str) -> bool:
    """Whether a requirement is a core dependency on this platform (no extra, its marker true); one
    that does not parse counts, so that the packages check reports it."""
    try:
        req = Requirement(text)
    except InvalidRequirement:
        return True
    return req.marker is None or req.marker.evaluate({"extra": ""})


def _canonical(text: str) -> str:
    try:
        return str(Requirement(text))
    except InvalidRequirement:
        return text


def declared_requirements(root: Path) -> Declared | None:
    """The checkout's pyproject.toml when ``root`` holds rlcore's, else the installed distribution's
    metadata (which works without the source tree); None when neither exists."""
    try:
        meta = importlib.metadata.metadata(DISTRIBUTION)
        installed = tuple(r for r in importlib.metadata.requires(DISTRIBUTION) or [] if _applies(r))
    except importlib.metadata.PackageNotFoundError:
        meta, installed = None, None
    project: dict = {}
    pyproject = root / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text()).get("project", {}) if pyproject.is_file() else {}
    except tomllib.TOMLDecodeError:  # not ours to judge: fall back to the installed metadata
        project = {}
    if project.get("name") == DISTRIBUTION:
        deps = tuple(r for r in project.get("dependencies", []) if _applies(r))
        stale: tuple[str, ...] = ()
        if installed is not None:
            mine, theirs = {_canonical(r) for r in deps}, {_canonical(r) for r in installed}
            stale = tuple(sorted(mine ^ theirs))
        return Declared(project.get("requires-python"), deps, "pyproject.toml", stale)
    if meta is None:
        return None
    return Declared((meta.get_all("Requires-Python") or [None])[0], installed or (), "installed metadata")
