"""The params keys ``dvc.yaml`` reads itself: what ``dvc repro`` needs written in params.yaml, defaults or not.

DVC reads params.yaml on its own, without rlcore's defaults. A key that dvc.yaml interpolates (``${task.file}``,
``${ppo.rounds}``) must be in the file, or DVC cannot build the pipeline at all (``failed to parse
'stages.task_file.foreach' in 'dvc.yaml': Could not find 'task.file'``); a key a stage lists under ``params`` must
be too, or DVC stops at that stage (``Parameters 'seed' are missing from 'params.yaml'``), after it has deleted the
stage's outputs. ``rlcore config check`` and the ``check_params`` stage refuse such a file first, in one line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import yaml

from rlcore.errors import ConfigError

PARAMS_FILE = "params.yaml"
# ${name} in dvc.yaml; ${item...} and ${key} are a foreach stage's own names, not params
INTERPOLATION = re.compile(r"\$\{\s*([^}\s]+)\s*\}")
FOREACH_NAMES = ("item", "key")


def _strings(node: Any) -> Iterator[str]:
    """Every string in a YAML tree, keys included."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)


def _listed(params: Any) -> Iterator[str]:
    """The params.yaml keys of a stage's ``params`` list (``- seed``, ``- params.yaml: [a, b]``; a whole file
    (``- params.yaml:``) names no key, and other files are not params.yaml's)."""
    for entry in params or []:
        if isinstance(entry, str):
            yield entry
        elif isinstance(entry, dict):
            for file, keys in entry.items():
                if file == PARAMS_FILE and isinstance(keys, list):
                    yield from (k for k in keys if isinstance(k, str))


def pipeline_keys(dvc_yaml: Path) -> dict[str, str]:
    """``{key: where dvc.yaml reads it}`` for every params key dvc.yaml interpolates or a stage lists, in file
    order (``{"task.file": "stage task_file", "seed": "stage prepare's params", ...}``)."""
    try:
        spec = yaml.safe_load(dvc_yaml.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{dvc_yaml}: cannot read the pipeline ({err})".replace("\n", " ")) from None
    keys: dict[str, str] = {}
    stages = spec.get("stages") or {}
    for name, body in stages.items() if isinstance(stages, dict) else ():
        for text in _strings(body):
            for key in INTERPOLATION.findall(text):
                if key.split(".")[0] not in FOREACH_NAMES:
                    keys.setdefault(key, f"stage {name}")
        stage = body.get("do", body) if isinstance(body, dict) else {}
        for key in _listed(stage.get("params") if isinstance(stage, dict) else None):
            keys.setdefault(key, f"stage {name}'s params")
    for text in _strings({k: v for k, v in spec.items() if k != "stages"}):  # top-level plots, ...
        for key in INTERPOLATION.findall(text):
            keys.setdefault(key, "dvc.yaml")
    return keys


def has_key(raw: Any, dotted: str) -> bool:
    """Whether the params mapping holds ``dotted`` (``task.file``: ``raw["task"]["file"]``)."""
    node = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def missing_keys(raw: Any, dvc_yaml: Path) -> dict[str, str]:
    """The keys of :func:`pipeline_keys` that ``raw`` (a params file's mapping) lacks, with where each is read."""
    return {key: where for key, where in pipeline_keys(dvc_yaml).items() if not has_key(raw, key)}


def check_pipeline_keys(raw: Any, dvc_yaml: Path, source: str) -> int:
    """Raise ConfigError naming what ``raw`` lacks of what dvc.yaml reads; else the number of keys it read."""
    missing = missing_keys(raw, dvc_yaml)
    if missing:
        shown = ", ".join(f"{key} ({where})" for key, where in list(missing.items())[:4])
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise ConfigError(f"{source} lacks keys that dvc repro reads from it ({dvc_yaml}, without rlcore's defaults): "
                          f"{shown}{more}; `rlcore config use {source}` writes every key into it, keeping its values")
    return len(pipeline_keys(dvc_yaml))
