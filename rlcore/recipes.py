"""Recipes: whole params files, and what each one changes from rlcore's defaults.

DVC reads params.yaml as it is (``dvc.yaml`` interpolates ``${rollout.agent.tools}``, ``${ppo.rounds}``, ... and
each stage lists the keys it depends on), so a pipeline's params file holds every key. A recipe
(``examples/dapo.yaml``) is such a file, so that ``cp examples/dapo.yaml params.yaml && dvc repro`` runs it; the
keys it changes are marked ``# <- examples/dapo.yaml``. What a params file *changes* is what it sets to another
value than rlcore's default (:func:`changes`), whether it holds every key or only a few: that is what
``rlcore config use`` stacks, recipe over recipe, over the defaults (then ``--set`` overrides), validated before
anything is written::

    rlcore config use examples/dapo.yaml examples/quick.yaml     # the recipe at smoke-test sizes
    rlcore config refresh examples/*.yaml                          # every key of this rlcore, the changes kept

A key added to the schema reaches the recipes with ``rlcore config refresh`` (``make recipes``); a test fails
until it has, and the repository's params.yaml is the defaults written out (a test keeps them equal).
Nothing heavy is imported here: this runs before any stage.
"""

from __future__ import annotations

import json
import re
import textwrap
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from rlcore.config import Config, ConfigError, apply_overrides, parse_config, read_yaml

WIDTH = 118  # the repository's line length, comments included

HEADER = ("Every knob of every stage: `dvc repro` reads this file (dvc.yaml), and so does the `rlcore` command. "
          "Written by `rlcore config use{sources}`: rlcore's defaults{over}. Edit any value here; "
          "`rlcore config show KEY` prints a key's whole doc and default, `rlcore config check` validates the file.")
# a period that ends an abbreviation, not a sentence ("Dr. GRPO", "Ziegler et al. 2019", "e.g. 0.9")
_NOT_AN_END = re.compile(r"(?:\b(?:al|Dr|e\.g|i\.e|vs|cf|Fig|Eq|No)\.|\b[A-Z]\.)$")


def read_recipe(path: str | Path) -> dict[str, Any]:
    """A recipe file's mapping (``{}`` for an empty one); a missing file or a non-mapping is a ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: recipe file not found")
    try:
        raw = read_yaml(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}".replace("\n", " ")) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of params keys at the top level, got {type(raw).__name__}")
    return raw


def merge(base: dict[str, Any], over: dict[str, Any], schema: type[BaseModel] = Config) -> dict[str, Any]:
    """``over`` on ``base``, two params mappings of ``schema``: a section (``actor``, ``actor.lora``) merges key by
    key; any other value, a mapping of records too (``ppo.rounds``, ``rm.models``, ``task.file``), replaces the one
    below it whole, as it would in a params file of its own. So a recipe file read alone (``rlcore config check
    --params examples/dapo.yaml``) is the same config as the defaults with it over them."""
    out = dict(base)
    sections = _sections(schema)
    for key, value in over.items():
        below = out.get(key)
        if key in sections and isinstance(value, dict) and isinstance(below, dict):
            out[key] = merge(below, value, sections[key])
        else:
            out[key] = value
    return out


def _sections(schema: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """The fields of ``schema`` that are sections of their own (by their params key), with their schemas; a field
    that may be null (``reward.model``) is a value: a recipe gives it whole."""
    out = {}
    for name, field in schema.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out[field.alias or name] = kind
    return out


def changes(path: str | Path) -> dict[str, Any]:
    """What the params file at ``path`` changes from rlcore's defaults, nested as in params.yaml: the values it sets
    (validated alone over the defaults, so an error names the file and the key) that differ from the default. A
    section is compared key by key; any other value (``ppo.rounds``, ``task.file``) whole."""
    return _changes_of(read_recipe(path), str(path))


def _changes_of(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """:func:`changes` of the params mapping ``raw``, read from ``source``."""
    defaults = Config().model_dump(mode="json")
    alone = parse_config(merge(defaults, raw), source).model_dump(mode="json")
    return _differs(alone, defaults, Config)


def _differs(value: dict[str, Any], default: dict[str, Any], schema: type[BaseModel]) -> dict[str, Any]:
    sections = _sections(schema)
    out = {}
    for key, v in value.items():
        if key in sections:
            inner = _differs(v, default[key], sections[key])
            if inner:
                out[key] = inner
        elif v != default.get(key):
            out[key] = v
    return out


def compose(recipes: list[str | Path], overrides: dict[str, Any] | None = None) -> tuple[Config, dict[str, str]]:
    """The validated config of the defaults with each recipe's :func:`changes` over them in order, then the dotted
    ``overrides``; and, for every leaf key a recipe or an override set, which one set it last (a path, or
    ``--set``). A value a recipe leaves at its default does not undo an earlier recipe's change (``--set`` does)."""
    raw: dict[str, Any] = Config().model_dump(mode="json")
    origin: dict[str, str] = {}
    for path in recipes:
        changed = changes(path)
        raw = merge(raw, changed)
        origin.update({key: str(path) for key in leaf_keys(changed)})
    if overrides:
        raw = apply_overrides(raw, overrides)
        origin.update({key: "--set" for key in overrides})
    source = " + ".join([*map(str, recipes), *(["--set"] if overrides else [])]) or "the defaults"
    return parse_config(raw, source), origin


def refresh(path: str | Path, follow_defaults: bool = False) -> str:
    """The params file at ``path`` written again for this rlcore: its leading comment block kept, then every key of
    the schema, its :func:`changes` kept and marked (each with the mark it had, a new one with ``path``). A key
    added to rlcore since takes its default; a key rlcore no longer has is a ConfigError naming it.

    ``follow_defaults``: only the keys the file marks (``# <- ...``) are its changes, every other key takes today's
    default, so a default changed in rlcore reaches the file (the repository's recipes, whose marks say what each
    one changes: ``make recipes``). Without it a value that differs from today's default is kept, marked or not (a
    params.yaml edited by hand or by ``dvc exp run -S``)."""
    path = Path(path)
    text, raw = path.read_text(), read_recipe(path)
    marks = marked(text)
    if follow_defaults and marks:
        chosen: dict[str, Any] = {}
        for key in marks:
            parts, value = key.split("."), raw
            for part in parts:
                value = value[part]
            node = chosen
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
        raw = chosen
    changed = _changes_of(raw, str(path))
    cfg = parse_config(merge(Config().model_dump(mode="json"), changed), str(path))
    origin = {}
    for key in leaf_keys(changed):  # a value given whole (reward.model) is marked on each of its lines
        had = [m for k, m in marks.items() if k == key or k.startswith(key + ".")]
        origin[key] = had[0] if had else str(path)
    lead = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lead.append(line)
    return render(cfg, [path], origin, header=lead or None)


def marked(text: str) -> dict[str, str]:
    """The dotted keys of a params file's lines marked ``# <- SOURCE`` (:func:`render`'s marks), with their
    sources; sections are followed by their indentation."""
    path: list[tuple[int, str]] = []
    out = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        path = [(i, k) for i, k in path if i < indent]
        path.append((indent, line.strip().split(":")[0]))
        match = re.search(r"  # <- (.+)$", line)
        if match:
            out[".".join(k for _, k in path)] = match.group(1)
    return out


def leaf_keys(mapping: dict[str, Any], schema: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Dotted keys of the values a params mapping of ``schema`` sets: into sections, not into the values that are
    mappings themselves (``ppo.rounds`` is one key, as :func:`merge` replaces it whole)."""
    sections = _sections(schema)
    keys = []
    for key, value in mapping.items():
        if key in sections and isinstance(value, dict):
            keys += leaf_keys(value, sections[key], f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def render(cfg: Config, recipes: list[str | Path] = (), origin: dict[str, str] | None = None,
           header: list[str] | None = None) -> str:
    """The whole params.yaml of ``cfg``: every section and key in schema order, each key under the first sentence
    of its doc, and a key whose value a recipe or ``--set`` chose marked with where it came from. ``header``: the
    comment lines to open the file with (a recipe's own); by default, what the file is and which command wrote it."""
    sources = "".join(f" {p}" for p in recipes) + (" --set ..." if origin and "--set" in origin.values() else "")
    over = f", with {' then '.join(map(str, recipes))} over them (keys marked `<-`)" if recipes else ""
    if origin and "--set" in origin.values() and not recipes:
        over = ", with --set values over them (keys marked `<-`)"
    lines = (header or _comment(HEADER.format(sources=sources, over=over), "", whole=True)) + [""]
    _section(cfg, "", 0, origin or {}, lines)
    return "\n".join(lines) + "\n"


def _section(model: BaseModel, prefix: str, indent: int, origin: dict[str, str], lines: list[str]) -> None:
    pad = " " * indent
    for name, field in type(model).model_fields.items():
        key = field.alias or name
        value = getattr(model, name)
        dotted = f"{prefix}{key}"
        if isinstance(value, BaseModel):
            if indent == 0 and lines[-1]:
                lines.append("")
            if field.description:
                lines += _comment(field.description, pad)
            lines.append(f"{pad}{key}:")
            _section(value, dotted + ".", indent + 2, origin, lines)
            continue
        choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else ()
        lines += _comment(field.description, pad, choices=choices)
        text = f"{pad}{key}: {_flow(value)}"
        marks = sorted({where for k, where in origin.items()  # the key, one below it, or a value it is part of
                        if k == dotted or k.startswith(dotted + ".") or dotted.startswith(k + ".")})
        lines.append(text + (f"  # <- {', '.join(marks)}" if marks else ""))


def first_sentence(doc: str | None) -> str:
    """A docstring's first sentence, on one line (a period after an abbreviation does not end it)."""
    text = " ".join((doc or "").split())
    for match in re.finditer(r"\. ", text):
        if not _NOT_AN_END.search(text[: match.start() + 1]):
            return text[: match.start() + 1]
    return text


def _comment(doc: str | None, pad: str, whole: bool = False, choices: tuple = ()) -> list[str]:
    """The first sentence of a field's doc (``whole``: all of it) as comment lines at ``pad``, and the values a
    ``Literal`` field takes."""
    text = " ".join((doc or "").split()) if whole else first_sentence(doc)
    if choices:
        text += f" One of: {', '.join(map(str, choices))}."
    if not text:
        return []
    return textwrap.wrap(text, WIDTH - len(pad), initial_indent=f"{pad}# ", subsequent_indent=f"{pad}# ",
                         break_on_hyphens=False, break_long_words=False)


def _flow(value: Any) -> str:
    """A value as one line of YAML (mappings and lists in flow style)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    plain = json.loads(json.dumps(value, default=lambda v: v.model_dump(mode="json")))
    return yaml.safe_dump(plain, default_flow_style=True, width=10_000, sort_keys=False).strip().removesuffix(
        "\n...").strip()
