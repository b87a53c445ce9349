"""The import graph of ``rlcore/`` has no cycle, counting every import of an rlcore module anywhere in a module
(at the top, inside a function, under ``TYPE_CHECKING``): a cycle makes the import order matter and was what the
round modes' registry (``rlcore.trainer.round.modes.ROUND_MODES``) replaced.

The graph is read from the source with :mod:`ast`; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

from .conftest import REPO_ROOT


def module_files(root: Path) -> dict[str, Path]:
    """``rlcore.x.y`` -> its file, for every module and package of ``root/rlcore``."""
    out = {}
    for f in sorted((root / "rlcore").rglob("*.py")):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def resolve(module: str | None, level: int, here: str, is_package: bool) -> str | None:
    """The absolute module name of an ``import``/``from`` target (relative imports resolved against ``here``)."""
    if level == 0:
        return module
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The rlcore modules ``name`` imports: ``from pkg import sub`` counts as ``pkg.sub`` when that is a module."""
    out: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = resolve(node.module, node.level, name, is_package)
            if target is None:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if sub in modules else target)
    return {m for m in out if m in modules and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first search, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_find_cycle_finds_a_planted_cycle_and_only_then():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"x2"}, "x2": {"x3"}, "x3": {"x2"}}) == ["x2", "x3", "x2"]


def test_imports_see_function_level_relative_and_submodule_imports(tmp_path):
    pkg = tmp_path / "rlcore" / "pkg"
    pkg.mkdir(parents=True)
    (tmp_path / "rlcore" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from rlcore.pkg import b\n    return b\n")
    (pkg / "b.py").write_text("from . import a\nimport rlcore.other\n")
    (tmp_path / "rlcore" / "other.py").write_text("import os\n")
    modules = module_files(tmp_path)
    graph = {m: imports(m, f, modules) for m, f in modules.items()}
    assert graph == {"rlcore": set(), "rlcore.pkg": {"rlcore.pkg.a"}, "rlcore.pkg.a": {"rlcore.pkg.b"},
                     "rlcore.pkg.b": {"rlcore.pkg.a", "rlcore.other"}, "rlcore.other": set()}
    assert find_cycle(graph) == ["rlcore.pkg.a", "rlcore.pkg.b", "rlcore.pkg.a"]


def test_rlcore_has_no_import_cycle():
    modules = module_files(REPO_ROOT)
    assert "rlcore.trainer.round.modes" in modules and "rlcore.trainer.round.async_source" in modules
    graph = {m: imports(m, f, modules) for m, f in modules.items()}
    assert "rlcore.trainer.round.async_source" in graph["rlcore.trainer.round.modes"]  # the round modes' imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
