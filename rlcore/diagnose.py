"""Is this machine ready to run the pipeline? The checks behind ``rlcore diagnose``.

Each check is a small function ``fn(ctx) -> Check`` registered in :data:`CHECKS`, in the order
the report lists them: Python, installed package versions, torch (CUDA, devices, NCCL), Ray, DVC,
MLflow, disk space, the model folder. A :class:`Check` is ``ok``, ``warn`` (works, but something
deserves a look) or ``fail`` (a stage would not run); warn and fail always say what to do.

Checks only look: none creates an MLflow run or a store, changes the DVC pipeline or leaves a Ray
instance behind (the MLflow store is opened read-only; ``dvc status`` only takes DVC's lock for a moment).
Each one is bounded in time (:func:`run_check`); what may hang (starting or joining Ray, ``dvc
status``) runs in a child process that is killed at the deadline. Importing this module loads
nothing heavy: torch loads inside the torch check, Ray only in the child process.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import traceback
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from rlcore.config import Config

Status = Literal["ok", "warn", "fail"]
STATUSES: tuple[Status, ...] = ("ok", "warn", "fail")

DISTRIBUTION = "rlcore"
# Free space under these is a warning / a failure: a PPO round writes checkpoints under models/,
# which DVC copies into .dvc/cache; a real model is several GiB per copy.
DISK_WARN_GIB = 5.0
DISK_FAIL_GIB = 1.0
DEFAULT_TIMEOUT_S = 60.0
# a check that ignores its own deadline is abandoned this long after it
GRACE_S = 5.0
# the line the Ray child process prints its answer on
PROBE_MARK = "RLCORE_RAY_PROBE "


@dataclass(frozen=True)
class Check:
    """One line of the report: what was checked, how it went, what was found, and what to do."""

    name: str
    status: Status
    detail: str
    fix: str = ""
    """What to do; required for warn and fail."""
    seconds: float = 0.0
    """How long the check took (set by :func:`run_check`)."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check {self.name}: status {self.status!r} is not one of {', '.join(STATUSES)}")
        if self.status != "ok" and not self.fix:
            raise ValueError(f"check {self.name}: a {self.status} needs a fix")


@dataclass(frozen=True)
class Context:
    """What every check may read."""

    cfg: Config
    """The validated params (the built-in defaults when the params do not validate)."""
    root: Path
    """The repository: the folder holding ``.dvc/`` at or above the working directory, else the
    working directory. Relative paths in params (sqlite URI, model.path) resolve against it, as in the stages."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Seconds each check may take."""


CheckFn = Callable[[Context], Check]
# name -> check, in report order
CHECKS: dict[str, CheckFn] = {}
# checks that only wait on child processes (no imports, no shared state): they start with the report
# and overlap the others
BACKGROUND: set[str] = set()


def register(name: str, *, background: bool = False) -> Callable[[CheckFn], CheckFn]:
    def decorator(fn: CheckFn) -> CheckFn:
        if name in CHECKS:
            raise ValueError(f"diagnose check {name!r} is already registered")
        CHECKS[name] = fn
        if background:
            BACKGROUND.add(name)
        return fn

    return decorator


def start_check(name: str, fn: CheckFn, ctx: Context) -> Callable[[], Check]:
    """Start ``fn(ctx)`` in a daemon thread; the returned function waits for its :class:`Check`.

    The wait is bounded by ``ctx.timeout_s`` (plus :data:`GRACE_S`) from the start: a check stuck
    in a call that cannot be interrupted (a CUDA driver that never answers) is abandoned and
    reported as a failure. An exception is a failure too, with its traceback on stderr: the report
    goes on with the other checks.
    """
    box: list[Check] = []

    def target() -> None:
        try:
            check = fn(ctx)
        except Exception as err:
            traceback.print_exc()
            check = Check(name, "fail", f"the check raised {type(err).__name__}: {err}",
                          "see the traceback on stderr (a broken install of what this check loads, or a bug)")
        box.append(replace(check, seconds=round(time.monotonic() - start, 2)))

    start = time.monotonic()
    thread = threading.Thread(target=target, name=f"diagnose-{name}", daemon=True)
    thread.start()

    def wait() -> Check:
        thread.join(max(0.0, start + ctx.timeout_s + GRACE_S - time.monotonic()))
        if not box:
            return Check(name, "fail", f"no answer within {ctx.timeout_s:g}s",
                         "rerun with a longer --timeout; if it hangs again, this is the problem",
                         seconds=round(time.monotonic() - start, 2))
        return box[0]

    return wait


def run_check(name: str, fn: CheckFn, ctx: Context) -> Check:
    """``fn(ctx)`` with its duration, bounded in time (:func:`start_check`)."""
    return start_check(name, fn, ctx)()


def run_checks(ctx: Context, skip: frozenset[str] | set[str] = frozenset()) -> Iterator[Check]:
    """Every registered check not in ``skip``, in order, each as soon as it and those before it are
    done. The :data:`BACKGROUND` checks start at once and run beside the others."""
    names = [n for n in CHECKS if n not in skip]
    started = {n: start_check(n, CHECKS[n], ctx) for n in names if n in BACKGROUND}
    for name in names:
        yield started[name]() if name in started else run_check(name, CHECKS[name], ctx)


def repo_root(start: Path) -> Path:
    """The folder holding ``.dvc/`` at or above ``start`` (what ``dvc root`` prints), else ``start``."""
    return find_dvc_root(start) or start


def find_dvc_root(start: Path) -> Path | None:
    for folder in (start.resolve(), *start.resolve().parents):
        if (folder / ".dvc").is_dir():
            return folder
    return None


def model_cache() -> Path:
    """Where the built-in model is materialised: ``rlcore.engine.model.TINY_CACHE`` (not imported
    from there: that module loads torch and transformers)."""
    return Path(os.environ.get("RLCORE_CACHE", Path.home() / ".cache" / "rlcore"))


# ---------------------------------------------------------------------------------------------
# Python and package versions


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


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_is_gpu_build(version: str, requires: list[str] | None) -> bool:
    """A CUDA or ROCm torch wheel: a ``+cu128``/``+rocm6.3`` local version, or (PyPI's Linux wheels)
    dependencies on the ``nvidia-*`` CUDA libraries."""
    try:
        local = Version(version).local or ""
    except InvalidVersion:
        local = ""
    if local.startswith(("cu", "rocm")):
        return True
    return any(canonicalize_name(Requirement(r).name).startswith("nvidia-") for r in requires or [])


_UPPER_BOUNDS = {"<", "<="}


def requirement_check(requirement: str, installed: str | None, *, other_version_ok: bool = False) -> Check:
    """How ``installed`` (None: not installed) stands against ``requirement`` (a PEP 508 string).

    Missing, older than a lower bound, off a pin or on an excluded version: fail. Newer than an
    upper bound only (an untested major version, which may well work): warn. ``other_version_ok``
    turns any miss into a warning (torch: the pin is the CPU wheel; GPU machines bring their own).
    """
    req = Requirement(requirement)
    wanted = f"{req.name}{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}{req.specifier}"
    install = f"pip install '{wanted}'"
    if installed is None:
        return Check(req.name, "fail", f"{req.name} is not installed (needs {req.specifier or 'any version'})", install)
    try:
        version = Version(installed)
    except InvalidVersion:
        return Check(req.name, "fail", f"{req.name} {installed}: not a valid version", install)
    if req.specifier.contains(version, prereleases=True):
        return Check(req.name, "ok", f"{req.name} {installed}")
    missed = [s for s in req.specifier if not s.contains(version, prereleases=True)]
    if other_version_ok:
        return Check(req.name, "warn", f"{req.name} {installed} is not {req.specifier} (the tested CPU wheel); "
                     "a GPU build of another version is allowed",
                     "nothing if python -m pytest tests/gpu passes; CPU machines need " + install)
    if all(s.operator in _UPPER_BOUNDS for s in missed):
        return Check(req.name, "warn", f"{req.name} {installed} is newer than tested ({req.specifier}); it may work",
                     f"if something breaks: {install}")
    return Check(req.name, "fail", f"{req.name} {installed} does not satisfy {req.specifier}", install)


def worst(statuses: list[Status]) -> Status:
    return max(statuses, key=STATUSES.index, default="ok")


@register("python")
def check_python(ctx: Context) -> Check:
    here = f"{platform.python_version()} ({sys.executable})"
    declared = declared_requirements(ctx.root)
    if declared is None or not declared.requires_python:
        return Check("python", "warn", f"{here}; rlcore is not installed, so its requires-python is unknown",
                     "pip install -e . in the rlcore checkout")
    try:
        spec = SpecifierSet(declared.requires_python)
    except InvalidSpecifier:
        return Check("python", "fail", f"{here}; requires-python {declared.requires_python!r} in "
                     f"{declared.source} does not parse", "fix requires-python in pyproject.toml")
    if spec.contains(platform.python_version(), prereleases=True):
        return Check("python", "ok", f"{here}, needs {spec}")
    return Check("python", "fail", f"{here} does not satisfy requires-python {spec}",
                 f"create the venv with a Python {spec}: PYTHON=python3.11 make setup (after rm -rf .venv)")


@register("packages")
def check_packages(ctx: Context) -> Check:
    declared = declared_requirements(ctx.root)
    if declared is None:
        return Check("packages", "fail", "rlcore is not installed and there is no rlcore pyproject.toml here",
                     "pip install -e . in the rlcore checkout")
    results = []
    for text in declared.dependencies:
        try:
            req = Requirement(text)
        except InvalidRequirement as err:
            results.append(Check(text, "fail", f"{text!r} in {declared.source}: {err}", "fix the requirement"))
            continue
        version = installed_version(req.name)
        lenient = (canonicalize_name(req.name) == "torch" and version is not None
                   and torch_is_gpu_build(version, importlib.metadata.requires("torch")))
        results.append(requirement_check(text, version, other_version_ok=lenient))
    bad = [r for r in results if r.status != "ok"]
    status = worst([r.status for r in results])
    head = f"{len(results) - len(bad)}/{len(results)} dependencies in range ({declared.source})"
    if declared.stale:
        status = worst([status, "warn"])
        head += f"; the installed metadata disagrees with pyproject.toml on {', '.join(declared.stale)}"
    if status == "ok":
        return Check("packages", "ok", head)
    detail = "; ".join([head, *(r.detail for r in bad)])
    reinstall = "pip install -e . (reinstall rlcore: its metadata is older than pyproject.toml)"
    fixes = [r.fix for r in bad] + ([reinstall] if declared.stale else [])
    return Check("packages", status, detail, "; ".join(dict.fromkeys(fixes)))


# ---------------------------------------------------------------------------------------------
# torch


@register("torch")
def check_torch(ctx: Context) -> Check:
    import torch
    import torch.distributed as dist

    use_gpu = ctx.cfg.resources.use_gpu
    if not dist.is_available():
        return Check("torch", "fail", f"{torch.__version__}: built without torch.distributed",
                     "install a torch wheel from pytorch.org (the workers form gloo/nccl groups)")
    if not torch.cuda.is_available():
        build = f", a CUDA {torch.version.cuda} build but no GPU visible" if torch.version.cuda else ""
        detail = f"{torch.__version__}, CUDA: no (CPU only{build}); gloo: {'yes' if dist.is_gloo_available() else 'no'}"
        if use_gpu:
            return Check("torch", "fail", detail + "; resources.use_gpu asks for GPUs",
                         "set resources.use_gpu: false, or run where nvidia-smi lists GPUs with a CUDA build "
                         "of torch")
        if not dist.is_gloo_available():
            return Check("torch", "fail", detail, "install a torch wheel with gloo (the CPU workers need it)")
        return Check("torch", "ok", detail)
    names = Counter(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    devices = ", ".join(f"{n} x {name}" for name, n in names.items())
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else None
    detail = f"{torch.__version__}, CUDA {torch.version.cuda or torch.version.hip}: {devices}; NCCL: {nccl or 'no'}"
    if use_gpu and nccl is None:
        return Check("torch", "fail", detail, "install a torch CUDA wheel with NCCL (GPU workers use nccl groups)")
    if not use_gpu:
        detail += "; resources.use_gpu is false (training runs on the CPU)"
    return Check("torch", "ok", detail)


# ---------------------------------------------------------------------------------------------
# Ray


def ray_probe(address: str, num_cpus: int) -> None:
    """Run in a child process by :func:`check_ray`: start a private Ray (``local``) or join
    ``address``, print what it has as one JSON line after :data:`PROBE_MARK`, shut down."""
    import ray

    try:
        if address == "local":
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        res = ray.cluster_resources()
        try:
            nodes: int | None = sum(1 for n in ray.nodes() if n.get("Alive"))
        except Exception:  # a Ray client (ray://) connection may not list nodes; the resources suffice
            nodes = None
        out = {"cpus": res.get("CPU", 0.0), "gpus": res.get("GPU", 0.0), "nodes": nodes, "version": ray.__version__}
    except Exception as err:
        out = {"error": f"{type(err).__name__}: {' '.join(str(err).split())}"}
    print(PROBE_MARK + json.dumps(out), flush=True)
    ray.shutdown()


def run_bounded(cmd: list[str], timeout_s: float, cwd: Path | None = None) -> tuple[int | None, str, str]:
    """``cmd``'s exit code, stdout and stderr; exit code None when it ran past ``timeout_s``, in which
    case its whole process group (Ray's raylet and GCS included) is killed."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return None, out, err


def _host_port(address: str) -> tuple[str, int] | None:
    """``host:port`` or ``ray://host:port`` -> (host, port); None for ``auto`` and what does not parse."""
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def resource_shortfall(cpus: float, gpus: float, cfg: Config) -> str | None:
    """What ``cpus``/``gpus`` lack for one resource pool of ``resources`` (None: enough)."""
    r = cfg.resources
    need_cpu = r.n_workers * r.cpus_per_worker
    lacks = []
    if cpus < need_cpu:
        lacks.append(f"{need_cpu:g} CPUs (resources.n_workers {r.n_workers} x cpus_per_worker "
                     f"{r.cpus_per_worker:g}), has {cpus:g}")
    if r.use_gpu and gpus < r.n_workers:
        lacks.append(f"{r.n_workers} GPUs (one per rank, resources.use_gpu), has {gpus:g}")
    return "; ".join(lacks) or None


@register("ray", background=True)
def check_ray(ctx: Context) -> Check:
    address, num_cpus = ctx.cfg.ray.address, ctx.cfg.ray.num_cpus
    local = address == "local"
    hp = _host_port(address)
    if hp is not None:
        try:
            socket.create_connection(hp, timeout=min(5.0, ctx.timeout_s)).close()
        except OSError as err:
            return Check("ray", "fail", f"ray.address {address}: nothing answers at {hp[0]}:{hp[1]} "
                         f"({err.strerror or err})",
                         f"start the head node there (ray start --head --port {hp[1]}), or set ray.address: "
                         "local for a private Ray on this machine")
    code = f"from rlcore.diagnose import ray_probe; ray_probe({address!r}, {num_cpus})"
    rc, out, stderr = run_bounded([sys.executable, "-c", code], ctx.timeout_s, cwd=ctx.root)
    where = "local (private)" if local else f"ray.address {address}"
    if rc is None:
        fix = ("rerun with a longer --timeout (Ray starts slowly on a busy machine); python -c 'import ray; "
               "ray.init()' shows what it waits on" if local else
               "check the cluster (ray status on the head node) and that it runs this Ray version")
        return Check("ray", "fail", f"{where}: Ray did not answer within {ctx.timeout_s:g}s", fix)
    lines = [ln for ln in out.splitlines() if ln.startswith(PROBE_MARK)]
    if not lines:
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        return Check("ray", "fail", f"{where}: the Ray probe exited with code {rc}: {last}",
                     "run python -c 'import ray; ray.init()' to see the full error")
    answer = json.loads(lines[-1][len(PROBE_MARK):])
    if "error" in answer:
        fix = ("start a cluster (ray start --head) or set ray.address: local" if address == "auto" else
               "check the address and that the cluster runs the same Ray version (ray status)")
        if local:
            fix = "run python -c 'import ray; ray.init()' to see the full error"
        if "InvalidAuthToken" in stderr:  # Ray >= 2.52 token authentication: the head wants a token
            return Check("ray", "fail", f"{where}: the cluster refused this process's Ray auth token",
                         "export RAY_AUTH_MODE=token, with the head node's token in ~/.ray/auth_token or "
                         "RAY_AUTH_TOKEN (ray get-auth-token on the head prints it)")
        return Check("ray", "fail", f"{where}: {answer['error']}", fix)
    cpus, gpus = float(answer["cpus"]), float(answer["gpus"])
    r = ctx.cfg.resources
    needs = f"{r.n_workers * r.cpus_per_worker:g} CPUs" + (f", {r.n_workers} GPUs" if r.use_gpu else "")
    nodes = "" if answer["nodes"] is None else f"{answer['nodes']} node(s), "
    found = (f"{where}, Ray {answer['version']}: {nodes}{cpus:g} CPUs, {gpus:g} GPUs "
             f"(the pipeline needs {needs})")
    short = resource_shortfall(cpus, gpus, ctx.cfg)
    if short:
        fix = ("lower resources.n_workers or cpus_per_worker" +
               (", or raise ray.num_cpus" if local and "CPUs" in short else "") +
               (", or set resources.use_gpu: false" if "GPUs" in short else "") +
               ("" if local else ", or add nodes to the cluster"))
        return Check("ray", "fail", f"{where}, Ray {answer['version']}: {nodes}needs {short}", fix)
    cores = os.cpu_count() or 1
    if local and num_cpus > cores:
        return Check("ray", "warn", f"{found}; ray.num_cpus {num_cpus} > {cores} cores here: ranks share cores",
                     f"set ray.num_cpus: {cores} unless the oversubscription is meant")
    return Check("ray", "ok", found)


# ---------------------------------------------------------------------------------------------
# DVC and git


@register("dvc", background=True)
def check_dvc(ctx: Context) -> Check:
    root = find_dvc_root(ctx.root)
    if root is None:
        return Check("dvc", "fail", f"not a DVC repository: no .dvc/ in {ctx.root.resolve()} or above",
                     "run rlcore diagnose in the rlcore checkout (where dvc.yaml is), or set one up: "
                     "git init && dvc init")
    try:
        head = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=ctx.timeout_s)
        inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=root, capture_output=True,
                                text=True, timeout=ctx.timeout_s)
    except FileNotFoundError:
        return Check("dvc", "fail", f"{root}: git is not installed", "install git (DVC pipelines live in a git repo)")
    except subprocess.TimeoutExpired:
        return Check("dvc", "fail", f"{root}: git rev-parse did not answer within {ctx.timeout_s:g}s",
                     "run git status there to see what it waits on")
    if inside.returncode != 0:
        return Check("dvc", "fail", f"{root}: DVC repo but not a git repository",
                     "git init && git add -A && git commit -m 'initial' (dvc repro and dvc exp need git)")
    if head.returncode != 0:
        return Check("dvc", "fail", f"{root}: git repository without a commit",
                     "git add -A && git commit -m 'initial' (dvc exp needs a commit to start from)")
    commit = head.stdout.strip()[:8]
    if not (root / "dvc.yaml").is_file():
        return Check("dvc", "warn", f"{root}: git {commit}, but no dvc.yaml (no pipeline)",
                     "run rlcore diagnose in the rlcore checkout, where dvc.yaml defines the stages")
    rc, out, err = run_bounded([sys.executable, "-m", "dvc", "status", "--json"], ctx.timeout_s, cwd=root)
    if rc is None:
        return Check("dvc", "fail", f"{root}: dvc status did not finish within {ctx.timeout_s:g}s",
                     "run dvc status to see what it waits on (a lock held by a running dvc repro?)")
    if rc != 0:
        last = (err.strip().splitlines() or out.strip().splitlines() or ["no output"])[-1]
        return Check("dvc", "fail", f"{root}: dvc status failed: {last}", "run dvc status to see the full error")
    try:
        changed = json.loads(out or "{}")
    except json.JSONDecodeError:
        return Check("dvc", "fail", f"{root}: dvc status printed no JSON: {out.strip()[:200]}",
                     "run dvc status to see the full error")
    if not changed:
        return Check("dvc", "ok", f"{root}: git {commit}, pipeline up to date")
    return Check("dvc", "warn", f"{root}: git {commit}, {len(changed)} stage(s) out of date: {', '.join(changed)}",
                 "run dvc repro (only the changed stages re-run; dvc status shows why each changed)")


# ---------------------------------------------------------------------------------------------
# MLflow


def mlflow_schema_head() -> str | None:
    """The database schema revision the installed MLflow expects (None: cannot tell)."""
    try:
        from mlflow.store.db.utils import _get_latest_schema_revision

        return _get_latest_schema_revision()
    except Exception:  # a private MLflow helper: when it moves, skip the schema comparison
        return None


def _writable_folder(folder: Path) -> tuple[Status, str]:
    """Whether files can be created in ``folder``, or in it once ``mkdir -p`` made it: ok (it exists and
    is writable), warn (missing but creatable), fail (not writable, or a file stands in the way)."""
    if folder.is_dir():
        return ("ok", "") if os.access(folder, os.W_OK | os.X_OK) else ("fail", f"{folder} is not writable")
    ancestor = folder
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return "fail", f"{ancestor} is a file, so the folder {folder} cannot be created"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return "fail", f"{folder} does not exist and {ancestor} is not writable"
    return "warn", f"the folder {folder} does not exist yet"


def _sqlite_store(uri: str, path: Path, experiment: str) -> Check:
    status, why = _writable_folder(path.parent)
    if status == "fail":
        return Check("mlflow", "fail", f"{uri}: {why}",
                     "point tracking.uri at a writable place (sqlite:///mlflow.db is the repo), or set "
                     "tracking.enabled: false")
    if status == "warn":
        return Check("mlflow", "warn", f"{uri}: {why}", f"mkdir -p {path.parent}")
    if not path.exists():
        return Check("mlflow", "ok", f"{uri}: new store (the first stage creates it)")
    if not os.access(path, os.W_OK):
        return Check("mlflow", "fail", f"{uri}: {path} is read-only",
                     f"chmod u+w {path}, or point tracking.uri elsewhere")
    try:
        con = sqlite3.connect(f"file:{urllib.parse.quote(str(path))}?mode=ro", uri=True, timeout=5)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables:
                return Check("mlflow", "ok", f"{uri}: empty database (the first stage sets it up)")
            if not {"alembic_version", "experiments", "runs"} <= tables:
                return Check("mlflow", "fail", f"{uri}: an sqlite database, but not an MLflow store "
                             f"(tables: {', '.join(sorted(tables)[:6])})",
                             "point tracking.uri at another file (sqlite:///mlflow.db)")
            revision = con.execute("SELECT version_num FROM alembic_version").fetchone()
            row = con.execute("SELECT experiment_id, lifecycle_stage FROM experiments WHERE name = ?",
                              (experiment,)).fetchone()
            runs = (con.execute("SELECT COUNT(*) FROM runs WHERE experiment_id = ?", (row[0],)).fetchone()[0]
                    if row else 0)
        finally:
            con.close()
    except sqlite3.Error as err:
        return Check("mlflow", "fail", f"{uri}: {path} does not open as sqlite ({err})",
                     "move the file away (MLflow starts a new store) or point tracking.uri elsewhere")
    head = mlflow_schema_head()
    revision = revision[0] if revision else None
    if head is not None and revision != head:
        return Check("mlflow", "fail", f"{uri}: schema {revision}, the installed MLflow expects {head}",
                     f"back the file up, then: mlflow db upgrade {uri} (or upgrade mlflow if a newer one made it)")
    if row is not None and row[1] != "active":
        return Check("mlflow", "fail", f"{uri}: experiment {experiment!r} (id {row[0]}) is {row[1]}",
                     f"restore it (mlflow experiments restore --experiment-id {row[0]}) or set another "
                     "tracking.experiment")
    found = f"experiment {experiment!r} has {runs} run(s)" if row else f"experiment {experiment!r} not created yet"
    return Check("mlflow", "ok", f"{uri}: writable, schema current; {found}")


def _http_store(uri: str, experiment: str, timeout_s: float) -> Check:
    query = urllib.parse.urlencode({"experiment_name": experiment})
    request = urllib.request.Request(f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/get-by-name?{query}")
    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        request.add_header("Authorization", f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            lifecycle = json.loads(response.read() or b"{}").get("experiment", {}).get("lifecycle_stage", "active")
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return Check("mlflow", "ok", f"{uri}: server answers; experiment {experiment!r} not created yet")
        return Check("mlflow", "fail", f"{uri}: server answered HTTP {err.code} {err.reason}",
                     "check the URI and credentials (MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME/PASSWORD)")
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        return Check("mlflow", "fail", f"{uri}: no answer within {timeout_s:g}s ({reason})",
                     "start the server (mlflow server --backend-store-uri sqlite:///mlflow.db --port 5000), fix "
                     "tracking.uri, or set tracking.enabled: false")
    if lifecycle != "active":
        return Check("mlflow", "fail", f"{uri}: experiment {experiment!r} is {lifecycle}",
                     "restore it in the MLflow UI or set another tracking.experiment")
    return Check("mlflow", "ok", f"{uri}: server answers; experiment {experiment!r} exists (read-only check)")


@register("mlflow")
def check_mlflow(ctx: Context) -> Check:
    from rlcore.tracking import resolve_uri

    tracking = ctx.cfg.tracking
    if not tracking.enabled:
        return Check("mlflow", "ok", "tracking.enabled is false: stages log nothing")
    uri = resolve_uri(tracking.uri, ctx.root)
    scheme = urllib.parse.urlparse(uri).scheme
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///"):]
        if path in ("", ":memory:"):
            return Check("mlflow", "warn", f"{uri}: an in-memory store keeps nothing after a stage",
                         "use a file: tracking.uri: sqlite:///mlflow.db")
        return _sqlite_store(uri, Path(path), tracking.experiment)
    if scheme in ("http", "https"):
        return _http_store(uri, tracking.experiment, ctx.timeout_s)
    if scheme in ("", "file"):
        folder = Path(urllib.parse.urlparse(uri).path if scheme else uri)
        folder = folder if folder.is_absolute() else ctx.root / folder
        status, why = _writable_folder(folder)
        if status == "ok":
            return Check("mlflow", "ok", f"{uri}: file store, writable")
        return Check("mlflow", status, f"{uri}: {why}",
                     f"mkdir -p {folder}" if status == "warn" else "point tracking.uri at a writable place")
    return Check("mlflow", "warn", f"{uri}: a {scheme} store, which rlcore diagnose does not check",
                 "check it with the MLflow client yourself; sqlite and http(s) stores are checked")


# ---------------------------------------------------------------------------------------------
# disk space and the model


def disk_status(free_bytes: float) -> Status:
    """ok, or warn under :data:`DISK_WARN_GIB`, or fail under :data:`DISK_FAIL_GIB`."""
    gib = free_bytes / 2**30
    return "fail" if gib < DISK_FAIL_GIB else "warn" if gib < DISK_WARN_GIB else "ok"


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@register("disk")
def check_disk(ctx: Context) -> Check:
    places = {"repo": ctx.root, "model cache": model_cache(), "temp (Ray)": Path(tempfile.gettempdir())}
    filesystems: dict[int, tuple[list[str], float]] = {}
    for label, path in places.items():
        here = _existing(path)
        dev = here.stat().st_dev
        labels, free = filesystems.get(dev, ([], shutil.disk_usage(here).free))
        filesystems[dev] = (labels + [f"{label} {path}"], free)
    parts, statuses = [], []
    for labels, free in filesystems.values():
        statuses.append(disk_status(free))
        parts.append(f"{free / 2**30:.1f} GiB free for {', '.join(labels)}")
    status = worst(statuses)
    fix = (f"free some space: under {DISK_FAIL_GIB:g} GiB a stage fails writing checkpoints"
           if status == "fail" else f"under {DISK_WARN_GIB:g} GiB: checkpoints under models/ (and their copies in "
           ".dvc/cache) may not fit; dvc gc -w drops unused cache entries")
    return Check("disk", status, "; ".join(parts), "" if status == "ok" else fix)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def _chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    cfg_file = folder / "tokenizer_config.json"
    try:
        return bool(cfg_file.is_file() and json.loads(cfg_file.read_text()).get("chat_template"))
    except (json.JSONDecodeError, OSError):
        return False


@register("model")
def check_model(ctx: Context) -> Check:
    path = ctx.cfg.model.path
    if path == "tiny":
        t = ctx.cfg.model.tiny
        return Check("model", "ok", f"tiny (built in: {t.arch}, hidden {t.hidden_size}, {t.num_layers} layers; "
                     f"cached under {model_cache()})")
    folder = Path(path) if Path(path).is_absolute() else ctx.root / path
    what = "a local Hugging Face model folder (config.json, weights, tokenizer with a chat template), or tiny"
    if not folder.is_dir():
        return Check("model", "fail", f"model.path {path!r}: no such folder ({folder})",
                     f"point model.path at {what}; nothing is downloaded at run time")
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(any(folder.glob(p)) for p in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors)")
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        missing.append(f"a tokenizer ({' or '.join(TOKENIZER_FILES)})")
    elif not _chat_template(folder):
        missing.append("a chat template (chat_template.jinja or tokenizer_config.json chat_template)")
    if missing:
        return Check("model", "fail", f"model.path {path!r}: {folder} lacks {', '.join(missing)}",
                     f"point model.path at {what}; save_pretrained writes all of it")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (json.JSONDecodeError, OSError) as err:
        return Check("model", "fail", f"model.path {path!r}: config.json does not parse ({err})",
                     "rewrite it (save_pretrained) or point model.path elsewhere")
    arch = ", ".join(config.get("architectures") or [config.get("model_type", "unknown type")])
    return Check("model", "ok", f"{folder}: {arch}, weights, tokenizer, chat template")


