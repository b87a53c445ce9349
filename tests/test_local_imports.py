"""An import inside a function of rlcore/ is there for a reason: it keeps a heavy module out of a process, a command
or a module that would not otherwise load it, or a comment says why.

"Heavy" is what takes a tenth of a second or more to import on these 2-core machines, each in a fresh process after
nothing else (2026-11-28, beside other work; the torch.distributed parts after torch): peft 10 s (torch and
transformers with it), mlflow 3.6 s, torch 3.1 s, transformers 2.1 s, torch.distributed.fsdp / .tensor /
.checkpoint 1.5 s each beyond torch, pandas 1.0 s, ray 0.9 s, math_verify 0.7 s, sympy 0.65 s, fastapi and
matplotlib 0.6 s, rlcore.config 0.54 s (building the params schema), dvc 0.5 s, pyarrow 0.4 s, numpy 0.24 s,
uvicorn 0.18 s; vllm (an optional install) about 25 s. pydantic (0.1 s), yaml and the standard library are not.

A function-local import passes when what it imports loads, through the module-level imports of rlcore's modules,
a heavy module that the importing module does not load at its own top; or when a comment on its line, or on the
line above it or above the run of imports it belongs to, gives the reason (a tool process that must start light,
an engine loaded when it is chosen). Read from the source with :mod:`ast`; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

from .conftest import REPO_ROOT
from .test_import_graph import module_files, resolve

HEAVY = ("torch", "transformers", "peft", "ray", "pyarrow", "pandas", "numpy", "mlflow", "matplotlib", "fastapi",
         "starlette", "uvicorn", "dvc", "math_verify", "sympy", "torch.distributed.fsdp", "torch.distributed.tensor",
         "torch.distributed.checkpoint", "rlcore.config", "vllm")


def targets(node: ast.Import | ast.ImportFrom, name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = resolve(node.module, node.level, name, path.name == "__init__.py") or ""
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def module_level_imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """What each rlcore module imports when it is imported: its top-level statements (a ``try`` block's too; not
    ``if TYPE_CHECKING``)."""
    out = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            for sub in ([node] if isinstance(node, (ast.Import, ast.ImportFrom)) else
                        ast.walk(node) if isinstance(node, ast.Try) else []):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    found.update(targets(sub, name, path, modules))
        out[name] = found
    return out


def heavy_loaded(start: str, top: dict[str, set[str]]) -> set[str]:
    """The heavy modules importing ``start`` loads (its parent packages' imports included)."""
    found, seen, stack = set(), set(), [start]
    while stack:
        mod = stack.pop()
        if mod in seen:
            continue
        seen.add(mod)
        found.update(h for h in HEAVY if mod == h or mod.startswith(h + "."))
        parts = mod.split(".")
        stack.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        stack.extend(top.get(mod, ()))
    return found


def has_reason(lines: list[str], lineno: int) -> bool:
    """A comment on the import's line, or on the line above the run of import lines it is part of."""
    if "#" in lines[lineno - 1]:
        return True
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith(("import ", "from ")):
        if "#" in lines[i]:
            return True
        i -= 1
    return i >= 0 and lines[i].strip().startswith("#")


def unjustified(root: Path) -> list[str]:
    modules = module_files(root)
    top = module_level_imports(modules)
    out = []
    for name, path in modules.items():
        text = path.read_text()
        lines = text.splitlines()
        own = heavy_loaded(name, top)
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                heavy = set().union(*(heavy_loaded(t, top) for t in targets(node, name, path, modules)))
                if not heavy - own and not has_reason(lines, node.lineno):
                    out.append(f"{path.relative_to(root)}:{node.lineno} {lines[node.lineno - 1].strip()}")
    return list(dict.fromkeys(out))  # (a nested function's imports are inside its parent's too)


def test_every_function_local_import_keeps_something_heavy_out_or_says_why():
    found = unjustified(REPO_ROOT)
    assert not found, ("imports inside functions that load nothing heavy the module does not load already: move "
                       "them to the top, or say why in a comment:\n" + "\n".join(found))


def test_the_check_sees_a_light_local_import_and_accepts_a_heavy_one_or_a_reason(tmp_path):
    pkg = tmp_path / "rlcore"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "light.py").write_text("import json\n")
    (pkg / "heavy.py").write_text("import torch\n")
    (pkg / "user.py").write_text(
        "def a():\n    from rlcore import light\n\n"
        "def b():\n    from rlcore import heavy\n\n"
        "def c():\n    # a process of its own starts light\n    import json\n    from rlcore import light\n\n"
        "def d():\n    import torch.distributed.fsdp\n")
    assert unjustified(tmp_path) == ["rlcore/user.py:2 from rlcore import light"]
    (pkg / "heavy_user.py").write_text("import torch\n\ndef e():\n    from rlcore import heavy\n")
    assert "rlcore/heavy_user.py:4 from rlcore import heavy" in unjustified(tmp_path)  # torch is loaded already
