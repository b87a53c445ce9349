"""Every file of ``rlcore/`` that is not Python (the rollout page's HTML, CSS and JavaScript, the portable kernels'
C++ source) is package data in
pyproject.toml, so an installed wheel has it, and the installed package reads it from its own folder."""

from __future__ import annotations

import fnmatch
import tomllib

from .conftest import REPO_ROOT


def package_data() -> dict[str, list[str]]:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]


def test_every_non_python_file_of_rlcore_is_declared_package_data():
    patterns = package_data()
    found = [f for f in sorted((REPO_ROOT / "rlcore").rglob("*"))
             if f.is_file() and f.suffix not in (".py", ".pyc") and "__pycache__" not in f.parts]
    assert found, "the rollout page's files should be here"
    undeclared = []
    for f in found:
        rel = f.relative_to(REPO_ROOT)
        # declared by its package, or by a package above it with the path below (setuptools' "csrc/*.cpp")
        owners = [(".".join(rel.parts[:i]), "/".join(rel.parts[i:])) for i in range(1, len(rel.parts))]
        if not any(fnmatch.fnmatch(below, p) for package, below in owners for p in patterns.get(package, [])):
            undeclared.append(str(rel))
    assert not undeclared, f"add to [tool.setuptools.package-data] in pyproject.toml: {undeclared}"
    # and back: every declared name exists (a pattern naming a moved file ships nothing)
    for package, names in patterns.items():
        folder = REPO_ROOT.joinpath(*package.split("."))
        for pattern in names:
            assert list(folder.glob(pattern)), f"package-data {package}: {pattern} matches no file"


def test_the_page_files_are_read_from_the_package():
    from rlcore.viewer import page_file

    assert page_file("page.html").lstrip().startswith("<!doctype html>")
    assert "{{SCRIPT}}" in page_file("page.html") and "{{STYLE}}" in page_file("page.html")
    assert "var RolloutView" in page_file("page.js") and "#charts" in page_file("page.css")
