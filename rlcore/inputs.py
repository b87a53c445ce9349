"""The pipeline's inputs from outside the repository's code, recorded by content: data files, reward files, tool files.

DVC can only depend on paths written in ``dvc.yaml``, and the files a user configures (``task.file``,
``reward.functions``) live in ``params.yaml``. So ``dvc.yaml`` has one small stage per configured file
(``task_file@<split>``, ``reward_file@<i>``, ``tool_file@<i>``, ``agent_file@<i>``: a ``foreach`` over the params
list, none when it is empty)
whose only dependency is that file and whose only output is a manifest, ``{"path", "sha256"}``, in a
folder the consuming stages depend on (``inputs/task`` for prepare; ``inputs/reward`` for score, the PPO
rounds and evaluate, the stages that run an agent program too, so its manifest goes there; ``inputs/tools`` for those
and SFT). An agent's manifest records its whole folder (the file and the modules it may import beside it). Editing a file re-runs its manifest stage, which changes the folder, which re-runs
exactly the stages that read the file; the others stay cached.

A consuming stage checks, before anything heavy starts, that each file it is about to read still has the
recorded hash (:func:`recorded_sha256`): a file edited after DVC recorded it would make ``dvc.lock`` describe
a run that did not happen. Light: hashlib and json only.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from rlcore.errors import DataError, InputNotFound

CHUNK = 1 << 20


def sha256_of(path: str | Path) -> str:
    """Hex sha256 of a file's bytes; of a folder, of its files' relative paths and contents in sorted order (Python's
    bytecode caches left out, as DVC leaves them out: ``.dvcignore``)."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                   and p.suffix != ".pyc") if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with f.open("rb") as stream:
            while chunk := stream.read(CHUNK):
                h.update(chunk)
    return h.hexdigest()


def manifest_name(key: str) -> str:
    """A manifest's file name for ``key`` (a split, ``fn_<function>``, ``rm_<model>``)."""
    if not re.fullmatch(r"[A-Za-z0-9_.@-]+", key):
        raise ValueError(f"manifest key {key!r}: use letters, digits, '_', '.', '@' or '-'")
    return f"{key}.json"


def write_manifest(path: str | Path, out: str | Path) -> dict[str, str]:
    """Record ``path`` (a file or folder that must exist) and its sha256 in the JSON file ``out``."""
    path = Path(path)
    if not path.exists():
        raise InputNotFound(f"{path}: not found")
    record = {"path": str(path), "sha256": sha256_of(path)}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    return record


def recorded_sha256(folder: str | Path, key: str, path: str | Path) -> str:
    """The sha256 that ``folder``'s manifest ``key`` recorded for ``path``, after checking that ``path`` still
    has it. Raises a one-line :class:`~rlcore.errors.UserError` when the manifest is missing (the file was not
    recorded: run ``dvc repro``), records another path, or the file changed since."""
    manifest = Path(folder) / manifest_name(key)
    if not manifest.is_file():
        raise InputNotFound(f"{manifest}: no record of {path} (dvc.yaml's stage for it writes one: run the "
                            "pipeline with dvc repro)")
    record = json.loads(manifest.read_text())
    if Path(record["path"]) != Path(path):
        raise DataError(f"{manifest} records {record['path']}, not {path}: run the pipeline with dvc repro")
    if not Path(path).exists():
        raise InputNotFound(f"{path}: not found")
    now = sha256_of(path)
    if now != record["sha256"]:
        raise DataError(f"{path} changed after DVC recorded it in {manifest}: run the pipeline with dvc repro "
                        "(so dvc.lock describes what ran)")
    return now


def recorded_reward_inputs(reward, folder: str | Path) -> dict[str, dict[str, str]]:
    """``{name: {"path", "sha256"}}`` of each reward file (``reward.functions``) and of the reward model folder
    (``reward.model``, as ``"model"``), checked against their manifests in ``folder``: what score, the PPO rounds
    and evaluate log to MLflow. A reward model folder no stage of the pipeline wrote (no manifest records it) is
    hashed here; DVC does not track it."""
    out = {f.name: {"path": f.path, "sha256": recorded_sha256(folder, f"fn_{f.name}", f.path)}
           for f in reward.functions}
    if reward.model is not None:
        path = reward.model.path
        match = [m for m in sorted(Path(folder).glob("rm_*.json"))
                 if Path(json.loads(m.read_text())["path"]) == Path(path)]
        if match:
            out["model"] = {"path": path, "sha256": recorded_sha256(folder, match[0].stem, path)}
        else:
            if not Path(path).exists():
                raise InputNotFound(f"reward.model.path {path!r}: not found (an rm stage writes models/rm/<name>: "
                                    "add it to rm.models, or give a local Hugging Face folder)")
            out["model"] = {"path": path, "sha256": sha256_of(path)}
    return out


def recorded_tool_inputs(agent, folder: str | Path | None) -> dict[str, dict[str, str]]:
    """``{name: {"path", "sha256"}}`` of each tool file of ``rollout.agent.tools`` (with loop ``tool``), checked
    against its manifest ``tool_<name>`` in ``folder``: what the stages that generate (and SFT, whose prompts show
    the tools' schemas) log to MLflow. Without ``folder`` (a stage run by hand, outside DVC) each file is hashed as
    it is."""
    if agent.loop != "tool":
        return {}
    out = {}
    for t in agent.tools:
        if folder is not None:
            out[t.name] = {"path": t.path, "sha256": recorded_sha256(folder, f"tool_{t.name}", t.path)}
        elif not Path(t.path).is_file():
            raise InputNotFound(f"rollout.agent.tools: tool file {t.path} not found")
        else:
            out[t.name] = {"path": t.path, "sha256": sha256_of(t.path)}
    return out


def agent_folder(path: str | Path) -> str:
    """The folder of an agent file (``rollout.agent.agents``), as the agent_file stage records it."""
    return str(Path(path).parent)


def recorded_agent_inputs(agent, folder: str | Path | None) -> dict[str, dict[str, str]]:
    """``{name: {"path", "sha256"}}`` of the agent (``rollout.agent.agents``, with loop ``openai``): its file's folder,
    checked against its manifest ``agent_<name>`` in ``folder`` (the rewards folder: exactly the stages that run the
    agent read it), what they log to MLflow. Without ``folder`` (a stage run by hand) it is hashed as it is."""
    if agent.loop != "openai":
        return {}
    out = {}
    for a in agent.agents:
        where = agent_folder(a.path)
        if folder is not None:
            out[a.name] = {"path": where, "sha256": recorded_sha256(folder, f"agent_{a.name}", where)}
        elif not Path(a.path).is_file():
            raise InputNotFound(f"rollout.agent.agents: agent file {a.path} not found")
        else:
            out[a.name] = {"path": where, "sha256": sha256_of(where)}
    return out


class NotAPythonFile(ImportError):
    """A user file that Python cannot load as a module."""


class UserFileNotFound(FileNotFoundError):
    """A user file that is not there (not a ``FileNotFoundError`` its own code raised while importing)."""


def load_user_module(path: str | Path, prefix: str) -> ModuleType:
    """A user's Python file (a reward or tool file) as a module, loaded once per process under
    ``<prefix>_<hash of its path>``, with its folder on ``sys.path`` so that its sibling modules import as when it
    runs as a script. :class:`UserFileNotFound` for a missing file, :class:`NotAPythonFile` for one that is not; an
    exception the file's own code raises while importing propagates (and the half-made module is forgotten)."""
    file = Path(path).resolve()
    module_name = f"{prefix}_{abs(hash(str(file))):x}"
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    if not file.is_file():
        raise UserFileNotFound(f"{path}: not found")
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise NotAPythonFile(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


class MissingUserObject(LookupError):
    """A user's file that is not there or not Python, or that has no object of the name asked for: the message is
    one line naming the file."""


def load_user_object(path: str | Path, name: str, what: str, prefix: str) -> Any:
    """Object ``name`` of the user's Python file ``path`` (a ``what`` file: "tool", "agent"), loaded by
    :func:`load_user_module` under ``prefix``; :class:`MissingUserObject` when the file or the name is missing or
    the file is not Python (an exception the file's own code raises while importing propagates)."""
    try:
        module = load_user_module(path, prefix)
    except UserFileNotFound:
        raise MissingUserObject(f"{what} file {path}: not found") from None
    except NotAPythonFile:
        raise MissingUserObject(f"{what} file {path}: not a Python file") from None
    if not hasattr(module, name):
        defined = defined_functions(module)
        raise MissingUserObject(f"{what} file {path} has no {name!r} (it defines: {', '.join(defined) or 'nothing'})")
    return getattr(module, name)


def defined_functions(module: ModuleType) -> list[str]:
    """The public callables a user's module defines itself (not the ones it imports), sorted."""
    return sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                  and getattr(v, "__module__", None) == module.__name__)
