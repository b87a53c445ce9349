"""``rlcore config``: the resolved params with defaults and docs (``show``), or a validation (``check``)."""

from __future__ import annotations

import argparse
import difflib
import json
from typing import Any, Iterator

from rlcore.commands.common import add_config_options, config_from, params_source

HELP = "show the resolved params (value, default, doc) or check them"
EXAMPLE = "rlcore config show rollout --set rollout.top_p=0.9   |   rlcore config check"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="<action>", required=True)
    show = sub.add_parser("show", help="the resolved config: each key's value, default, whether it differs, its doc",
                          description="The resolved config, whole or one section or key.",
                          epilog="example:\n  rlcore config show algorithm --set algorithm.adv_estimator=rloo",
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    show.add_argument("key", nargs="?", default=None, help="a section (rollout) or a key (rollout.top_p)")
    show.add_argument("--changed", action="store_true", help="only keys whose value differs from the default")
    show.add_argument("--json", action="store_true", help="print JSON records instead of a table")
    add_config_options(show)
    check = sub.add_parser("check", help="validate the params, task files and reward functions; exit 0, or 2 with a "
                                         "one-line error",
                           description="Validate the params file (and --set overrides) as every stage does; read the "
                                       "first row of each task file; import each reward file and call each function "
                                       "once on a row of the task (its ground truth as the answer).",
                           epilog="example:\n  rlcore config check --params params.yaml",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_options(check)


def one_line(doc: str | None) -> str:
    """The first sentence of a field's docstring, on one line."""
    text = " ".join((doc or "").split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def type_name(annotation: Any) -> str:
    """A field's type as a reader wants it: ``int``, ``one of: llama, qwen2``, ``list of: +, -, *``, ``str or null``."""
    import types
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "one of: " + ", ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        kinds = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(kinds) + (" or null" if type(None) in args else "")
    if origin in (tuple, list):
        return "list of " + type_name(args[0])
    if origin is dict:
        return f"mapping {type_name(args[0])} -> {type_name(args[1])}"
    return getattr(annotation, "__name__", str(annotation))


def value_range(field: Any) -> str:
    """A field's bounds from its constraints (``>= 1``, ``> 0, <= 1``, ``at least 1 character``), or ''."""
    parts = []
    for rule in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(rule, attr, None) is not None:
                parts.append(f"{sign} {getattr(rule, attr)}")
        if getattr(rule, "min_length", None):
            parts.append(f"at least {rule.min_length} item(s) or character(s)")
    return ", ".join(parts)


def entries(model: Any, defaults: Any, prefix: str = "") -> Iterator[dict[str, Any]]:
    """``{key, value, default, changed, doc, text, type, range}`` for every leaf of a config section, in schema
    order: ``doc`` is the first sentence of the field's docstring (the table's), ``text`` all of it.
    Sections recurse; mappings of sections (``ppo.rounds``) are one entry with a JSON value."""
    from pydantic import BaseModel

    for name, field in type(model).model_fields.items():
        value, default = getattr(model, name), getattr(defaults, name, None)
        key = f"{prefix}{field.alias or name}"  # ppo.async: a Python keyword, the field is async_
        if isinstance(value, BaseModel):
            yield from entries(value, default, key + ".")
            continue
        plain = json.loads(json.dumps(_plain(value)))
        plain_default = json.loads(json.dumps(_plain(default)))
        yield {"key": key, "value": plain, "default": plain_default, "changed": plain != plain_default,
               "doc": one_line(field.description), "text": " ".join((field.description or "").split()),
               "type": type_name(field.annotation), "range": value_range(field)}


def _plain(value: Any) -> Any:
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def select(rows: list[dict[str, Any]], key: str | None) -> list[dict[str, Any]]:
    """The rows under ``key`` (a section or a leaf); an unknown key names the closest ones."""
    if key is None:
        return rows
    picked = [r for r in rows if r["key"] == key or r["key"].startswith(key + ".")]
    if not picked:
        from rlcore.errors import ConfigError

        known = sorted({r["key"] for r in rows} | {r["key"].rsplit(".", 1)[0] for r in rows if "." in r["key"]})
        close = difflib.get_close_matches(key, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"config show {key!r}: no such section or key{hint}")
    return picked


def render(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) or value is None else str(value)


def table(rows: list[dict[str, Any]]) -> str:
    """Aligned columns: key, value, default, doc; a ``*`` before the key marks a value that differs."""
    cells = [("  key", "value", "default", "doc")]
    for r in rows:
        cells.append((("* " if r["changed"] else "  ") + r["key"], render(r["value"]), render(r["default"]), r["doc"]))
    width = [min(max(len(c[i]) for c in cells), cap) for i, cap in enumerate((44, 28, 20))]
    return "\n".join(f"{c[0]:<{width[0]}}  {c[1]:<{width[1]}}  {c[2]:<{width[2]}}  {c[3]}".rstrip() for c in cells)


def run(args: argparse.Namespace) -> int:
    from rlcore.config import Config

    cfg = config_from(args)
    source = params_source(args) or "built-in defaults"
    if args.action == "check":
        from rlcore.preflight import check_inputs

        lines = check_inputs(cfg)  # the task's files and the reward functions, called once on a row
        print("\n".join([f"{source}: ok ({len(list(entries(cfg, Config())))} keys valid)", *lines]))
        return 0
    rows = select(list(entries(cfg, Config())), args.key)
    if args.changed:
        rows = [r for r in rows if r["changed"]]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"# {source}; * = differs from the default\n{table(rows)}")
        if len(rows) == 1:  # one key: all of its doc, as the params reference has it
            print("\n" + describe(rows[0]))
    return 0


def describe(row: dict[str, Any]) -> str:
    """One key's type, range and whole doc (``rlcore config show KEY`` and the docs' params reference)."""
    kind = row["type"] + (f", {row['range']}" if row["range"] else "")
    return f"{row['key']} ({kind}; default {render(row['default'])}): {row['text']}"
