"""The ``python`` check: this interpreter against rlcore's ``requires-python``."""

from __future__ import annotations

import platform
import sys

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from rlcore.diagnose.base import Check, Context, register
from rlcore.diagnose.requirements import declared_requirements


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
