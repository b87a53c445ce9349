"""The ``packages`` check: every installed dependency against the range pyproject.toml declares."""

from __future__ import annotations

import importlib.metadata

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from rlcore.diagnose.base import Check, Context, register, worst
from rlcore.diagnose.requirements import declared_requirements


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
