"""``rlcore config``: the resolved params with defaults and docs (``show``), a validation (``check``), or a recipe
written over the defaults as the pipeline's params.yaml (``use``, :mod:`rlcore.recipes`)."""

from __future__ import annotations

import argparse
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel

from rlcore.stage.frame import check_engine_installed
from rlcore.commands.common import DEFAULT_PARAMS, add_config_options, config_from, params_source, parse_overrides
from rlcore.config import Config, apply_overrides, load_config, read_yaml
from rlcore.errors import ConfigError
from rlcore.pipeline_keys import check_pipeline_keys, missing_keys
from rlcore.preflight import check_inputs
from rlcore.recipes import compose, first_sentence, refresh as refreshed, render as render_params

HELP = ("write recipes over the defaults as params.yaml (use), bring params files up to this rlcore (refresh), show "
        "the resolved params (show), or check them")
EXAMPLE = ("rlcore config use examples/dapo.yaml examples/quick.yaml   |   rlcore config show rollout --set "
           "rollout.top_p=0.9   |   rlcore config check")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="<action>", required=True)
    use = sub.add_parser("use", help="write params.yaml: rlcore's defaults with recipes (examples/*.yaml) over them",
                         description="Write the pipeline's params file: every key at rlcore's default, what each "
                                     "recipe file changes from the defaults over them in order (a recipe may hold "
                                     "every key or only a few; a value at its default changes nothing), then the "
                                     "--set values; validated first, nothing is written if it is not valid. Each "
                                     "key a recipe or --set chose is marked in the file.",
                         epilog="examples:\n  rlcore config use examples/dapo.yaml examples/quick.yaml   # at "
                                "smoke-test sizes\n"
                                "  rlcore config use params.yaml examples/quick.yaml          # the same, after "
                                "cp examples/dapo.yaml params.yaml\n"
                                "  rlcore config use                                          # the defaults",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    use.add_argument("recipes", nargs="*", metavar="RECIPE", help="recipe files, applied in order")
    use.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override one param after the recipes (dotted key, YAML value); repeatable")
    use.add_argument("--out", default=DEFAULT_PARAMS, metavar="FILE", help="the file to write (default: params.yaml)")
    refresh = sub.add_parser("refresh", help="write params files again with every key of this rlcore, their "
                                             "changes and leading comments kept",
                             description="Rewrite each params file in place (a recipe, your params.yaml after an "
                                         "upgrade): every key of this rlcore in schema order, the values the file "
                                         "changes from the defaults kept and marked, its leading comment kept. A key "
                                         "added to rlcore since takes its default; a key rlcore no longer has is a "
                                         "one-line error and nothing is written. With --follow-defaults only the "
                                         "marked keys are kept, so a default changed in rlcore reaches the file.",
                             epilog="examples:\n  rlcore config refresh params.yaml\n"
                                    "  rlcore config refresh --check examples/*.yaml   # exit 1 naming the stale ones",
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    refresh.add_argument("files", nargs="+", metavar="FILE", help="params files to rewrite in place")
    refresh.add_argument("--check", action="store_true", help="write nothing; exit 1 if any file is not current")
    refresh.add_argument("--follow-defaults", action="store_true",
                         help="only the keys a file marks (# <- ...) are its own; every other key takes today's "
                              "default (the repository's recipes: make recipes)")
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
                           description="Validate the params file (and --set overrides) as every stage does; in the "
                                       "pipeline's params.yaml, find every key dvc.yaml reads (dvc repro reads them "
                                       "from the file, without rlcore's defaults); check model.path and each model "
                                       "or file a stage starts from; read the first row of each task file; import "
                                       "each reward file and call each function once on a row of the task (its "
                                       "ground truth as the answer). The pre-flight of dvc repro and dvc exp run.",
                           epilog="example:\n  rlcore config check --params params.yaml",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_options(check)


def one_line(doc: str | None) -> str:
    """The first sentence of a field's docstring, on one line."""
    return first_sentence(doc)


def type_name(annotation: Any) -> str:
    """A field's type as a reader wants it: ``int``, ``one of: llama, qwen2``, ``list of: +, -, *``, ``str or null``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # a type with validation settings (strictness): the type
        return type_name(args[0])
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
    if args.action == "use":
        return use(args)
    if args.action == "refresh":
        return refresh(args)
    if args.action == "check":
        return check(args)
    cfg = config_from(args, runs=False)  # the params alone: valid whatever this environment has installed
    source = params_source(args) or "built-in defaults"
    rows = select(list(entries(cfg, Config())), args.key)
    if args.changed:
        rows = [r for r in rows if r["changed"]]
        if not rows and not args.json:
            where = f" under {args.key}" if args.key else ""
            print(f"# {source}: every key{where} is at its default (`rlcore config show` lists them all)")
            return 0
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"# {source}; * = differs from the default\n{table(rows)}")
        if len(rows) == 1:  # one key: all of its doc, as the params reference has it
            print("\n" + describe(rows[0]))
    return 0


def check(args: argparse.Namespace) -> int:
    """``rlcore config check``: what a stage refuses (the schema) and what ``dvc repro`` refuses (a key dvc.yaml
    reads missing from the pipeline's params.yaml, a model or file a stage starts from not there), then the task's
    files and the reward functions, called once on a row."""
    source = params_source(args)
    pipeline = Path(source or DEFAULT_PARAMS).parent / "dvc.yaml"
    if source is None and pipeline.is_file():
        raise ConfigError(f"no {DEFAULT_PARAMS} here, beside {pipeline}: dvc repro reads it; `rlcore config use` "
                          "writes rlcore's defaults into it")
    cfg = config_from(args, runs=False)  # the params alone: valid whatever this environment has installed
    lines = []
    if source is not None and pipeline.is_file():
        raw = apply_overrides(read_yaml(Path(source).read_text()) or {}, parse_overrides(args.overrides))
        if Path(source).name == DEFAULT_PARAMS:  # the file dvc repro reads
            lines.append(f"{pipeline}: the {check_pipeline_keys(raw, pipeline, source)} keys it reads are in the file")
        elif missing_keys(raw, pipeline):  # a recipe holding a few keys: fine for rlcore config use, not for dvc
            lines.append(f"note: {source} is not {DEFAULT_PARAMS} and lacks keys {pipeline} reads; `rlcore config "
                         f"use {source}` writes it as {DEFAULT_PARAMS} with every key")
    lines += check_inputs(cfg)
    try:
        check_engine_installed(cfg, source or "--set")
    except ConfigError as err:  # a fact of this environment, not of the params
        lines.append(f"warning: {err}")
    print("\n".join([f"{source or 'built-in defaults'}: ok ({len(list(entries(cfg, Config())))} keys valid)",
                      *lines]))
    return 0


def describe(row: dict[str, Any]) -> str:
    """One key's type, range and whole doc (``rlcore config show KEY`` and the docs' params reference)."""
    kind = row["type"] + (f", {row['range']}" if row["range"] else "")
    return f"{row['key']} ({kind}; default {render(row['default'])}): {row['text']}"


def refresh(args: argparse.Namespace) -> int:
    """``rlcore config refresh``: every file checked first (an invalid one stops all before anything is written),
    then each stale one rewritten, or with ``--check`` named."""
    texts = {path: refreshed(path, follow_defaults=args.follow_defaults) for path in map(Path, args.files)}
    stale = [path for path, text in texts.items() if path.read_text() != text]
    for path in stale:
        if args.check:
            print(f"{path}: not current (`rlcore config refresh {path}` writes it with every key of this rlcore)")
        else:
            path.write_text(texts[path])
            print(f"{path}: written again with every key of this rlcore")
    if not stale:
        print(f"{len(texts)} file(s) current")
    return 1 if stale and args.check else 0


def use(args: argparse.Namespace) -> int:
    """``rlcore config use``: compose, validate, then write; the keys of the file it replaces that held values of
    their own (neither the default nor the new value) are named, since they are gone."""
    cfg, origin = compose(args.recipes, parse_overrides(args.overrides))
    out = Path(args.out)
    lost: list[str] = []
    if out.is_file():
        try:
            old = load_config(out)
        except Exception:  # an invalid file being replaced: nothing of it to keep track of
            old = None
        if old is not None:
            new = {r["key"]: r["value"] for r in entries(cfg, Config())}
            lost = [f"{r['key']}={render(r['value'])}" for r in entries(old, Config())
                    if r["changed"] and r["value"] != new.get(r["key"], r["default"])]
    out.write_text(render_params(cfg, args.recipes, origin))
    changed = sum(r["changed"] for r in entries(cfg, Config()))
    what = " then ".join(args.recipes) + " over the defaults" if args.recipes else "rlcore's defaults"
    print(f"{out}: {what} ({changed} key(s) differ from the defaults; `rlcore config show --changed` lists them)")
    if lost:
        print(f"{out}: replaced values of the previous file: {', '.join(lost)}")
    return 0
