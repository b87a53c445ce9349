"""The import graph of ``rlcore/``, counting every import of an rlcore module anywhere in a module (at the top, inside
a function, under ``TYPE_CHECKING``):

* it has no cycle: a cycle makes the import order matter and was what the round modes' registry
  (``rlcore.trainer.round.modes.ROUND_MODES``) replaced;
* it keeps to the floors of :data:`FLOORS`: no module imports one of a higher floor, so a lower floor can be read,
  tested and reused without the ones above it (a new package has to be given its floor here).

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


# The floors of rlcore, lowest first: a module may import its own floor and the ones below, never one above. A module
# is on the floor of the longest name here that is it or a package above it.
FLOORS = [
    ("foundation", ["rlcore", "rlcore.errors", "rlcore.interrupt", "rlcore.registry", "rlcore.names", "rlcore.cache",
                    "rlcore.import_index", "rlcore.heap", "rlcore.protocol", "rlcore.inputs"]),
    ("settings: the typed params and what reads whole params files", ["rlcore.config", "rlcore.pipeline_run",
                                                                       "rlcore.recipes", "rlcore.pipeline_keys"]),
    ("tensor math and data", ["rlcore.algos", "rlcore.data", "rlcore.viewer"]),
    ("rewards", ["rlcore.rewards"]),
    # rlcore.serve, the OpenAI-compatible server over an engine, is below the agent loops: the openai loop serves the
    # policy to an agent program through it (its command, `rlcore serve`, is a face: rlcore.commands)
    ("CPU kernels, models, generation engines, the OpenAI-compatible server and the agent loops",
     ["rlcore.kernels", "rlcore.engine", "rlcore.rollout", "rlcore.serve", "rlcore.agents"]),
    ("the controller's tools and tracking", ["rlcore.controller", "rlcore.tracking"]),
    ("workers: the ranks of worker groups", ["rlcore.workers"]),
    ("the trainer's loop infrastructure", ["rlcore.trainer.loop"]),
    ("samples on worker groups", ["rlcore.trainer.samples"]),
    ("the PPO round's parts", ["rlcore.trainer.round"]),
    ("stage drivers", ["rlcore.trainer"]),
    ("faces: the stage frame, the command, export, compare, diagnose",
     ["rlcore.stage", "rlcore.commands", "rlcore.__main__", "rlcore.export", "rlcore.compare", "rlcore.diagnose",
      "rlcore.preflight"]),
]


def floor_of(module: str, floors: list[tuple[str, list[str]]] = FLOORS) -> int | None:
    """The index in ``floors`` of ``module``'s floor, or None when no entry covers it."""
    best: tuple[int, int] | None = None  # (length of the matching name, floor)
    for level, (_, names) in enumerate(floors):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[0]):
                best = (len(name), level)
    return None if best is None else best[1]


def upward_imports(graph: dict[str, set[str]], floors: list[tuple[str, list[str]]] = FLOORS) -> list[str]:
    """``"a (floor) -> b (floor)"`` for every import of a module on a higher floor than the importer's."""
    out = []
    for module, targets in sorted(graph.items()):
        here = floor_of(module, floors)
        for target in sorted(targets):
            there = floor_of(target, floors)
            if here is not None and there is not None and there > here:
                out.append(f"{module} ({floors[here][0]}) -> {target} ({floors[there][0]})")
    return out


def test_floors_find_a_planted_upward_import_and_only_then():
    floors = [("low", ["p.low"]), ("high", ["p.high", "p.high.sub"])]
    assert floor_of("p.high.sub.x", floors) == 1 and floor_of("p.low", floors) == 0 and floor_of("q", floors) is None
    assert upward_imports({"p.high.a": {"p.low.b"}, "p.low.b": set()}, floors) == []
    assert upward_imports({"p.low.b": {"p.high.sub.c"}, "p.high.sub.c": set()}, floors) == [
        "p.low.b (low) -> p.high.sub.c (high)"]


def test_no_module_imports_one_of_a_higher_floor():
    modules = module_files(REPO_ROOT)
    unplaced = sorted(m for m in modules if floor_of(m) is None)
    assert not unplaced, f"give these modules a floor in FLOORS: {unplaced}"
    graph = {m: imports(m, f, modules) for m, f in modules.items()}
    assert "rlcore.trainer.loop.steps" in graph["rlcore.trainer.sft"]  # the graph sees the drivers' imports
    upward = upward_imports(graph)
    assert not upward, "imports from a lower floor to a higher one:\n" + "\n".join(upward)


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
