"""The pages generated from the code, so they cannot drift from it.

Committed, so that their links work when the repository is browsed (tests/test_docs.py fails while one differs from
what this writes; ``make reference``, or ``python docs/hooks/reference.py``, writes them again):

* ``reference/params.md``: every params.yaml key from rlcore/config.py's field docstrings, with its type, default
  and range, in the words ``rlcore config show KEY`` prints (rlcore.commands.config.entries);
* ``reference/commands.md``: every ``rlcore`` command's ``--help``, from the argparse definitions.

And, as an MkDocs hook, at build time:

* ``results/img/*.png``: the results pages' plots, drawn from the committed CSVs and bench/RESULTS.md
  (docs/hooks/plots.py);
* the examples page's table of examples/*.yaml and the results index's list of ``rlcore compare`` reports.
"""

from __future__ import annotations

import argparse
import html
import os
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `mkdocs build` with a python whose rlcore is not this checkout's
    sys.path.insert(0, str(ROOT))


def _plots():
    """docs/hooks/plots.py (MkDocs loads a hook by its path, so its folder is not importable)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rlcore_docs_plots", Path(__file__).with_name("plots.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _escape(text: str) -> str:
    """Docstring text as Markdown that shows it literally."""
    return re.sub(r"([\\`*_\[\]])", r"\\\1", html.escape(text, quote=False))


def params_page() -> str:
    from rlcore.commands.config import entries, render
    from rlcore.config import Config

    rows = list(entries(Config(), Config()))
    lines = ["# Params reference", "",
             "Every key of `params.yaml`, generated from the field docstrings of `rlcore/config.py` (`make "
             "reference`; tests/test_docs.py keeps it current): the words `rlcore config show KEY` prints. Defaults "
             "are the code's; the `params.yaml` in the repository changes some of them (`rlcore config show "
             "--changed` lists which). A wrong key, type, range "
             "or name stops a stage before anything heavy starts, with one line naming the key.", ""]
    section = None
    for row in rows:
        top = row["key"].split(".", 1)[0]
        if top != section:
            section = top
            lines += [f"## {top}", ""]
        facts = [f"**type** {_escape(row['type'])}", f"**default** `{render(row['default'])}`"]
        if row["range"]:
            facts.append(f"**range** {_escape(row['range'])}")
        lines += [f"### `{row['key']}` {{#{row['key']}}}", "", " · ".join(facts), "", _escape(row["text"]), ""]
    return "\n".join(lines)


def _help(parser: argparse.ArgumentParser) -> list[str]:
    """The parser's --help, and each sub-command's after it."""
    out = ["```text", parser.format_help().rstrip(), "```", ""]
    for action in parser._actions:  # argparse keeps sub-commands here and nowhere public
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += [f"#### `{sub.prog}`", ""] + _help(sub)
    return out


def commands_page() -> str:
    from rlcore.commands import build_parser

    os.environ["COLUMNS"] = "110"  # argparse wraps at the terminal's width: the same page on every machine
    top = build_parser()
    lines = ["# Command reference", "",
             "`rlcore` is everything around training (the pipeline itself is `dvc repro`). Generated from the "
             "argparse definitions in `rlcore/commands/` (`make reference`; tests/test_docs.py keeps it current): the "
             "text `rlcore <command> --help` prints.", ""] + _help_top(top)
    return "\n".join(lines)


def _help_top(top: argparse.ArgumentParser) -> list[str]:
    lines = ["```text", top.format_help().rstrip(), "```", ""]
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        lines += [f"## `rlcore {name}` {{#{name}}}", ""] + _help(parser)
    return lines


def examples_table() -> str:
    """One row per examples/*.yaml: its file, its first comment line, the keys it changes from rlcore's defaults (a
    recipe is a whole params file, those keys marked in it)."""
    from rlcore.commands.config import render
    from rlcore.recipes import changes, leaf_keys

    lines = ["| file | what it shows | keys it changes from the defaults |", "| --- | --- | --- |"]
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        about = example_about(path.read_text())
        changed = changes(path)
        changed = [f"`{key}: {render(_at(changed, key))}`" for key in leaf_keys(changed)]
        lines.append(f"| `examples/{path.name}` | {_escape(about)} | {'<br>'.join(changed) or 'none'} |")
    return "\n".join(lines)


def example_about(text: str) -> str:
    """What a recipe shows: its leading comment up to the lines on how to use it (``Use:``, ``Every key``, ``Why``),
    as one line."""
    about = []
    for line in text.splitlines():
        words = line.lstrip("#").strip()
        if not line.startswith("#") or words.startswith(("Use:", "Every key", "Why these values")):
            break
        about.append(words)
    return " ".join(about)


def _at(mapping: dict, dotted: str):
    for part in dotted.split("."):
        mapping = mapping[part]
    return mapping


def compare_reports() -> str:
    """A list item per report `rlcore compare` wrote into docs/results (its first heading as the title)."""
    items = []
    for path in sorted((ROOT / "docs/results").glob("compare-*.md")):
        title = next((line.lstrip("# ").strip() for line in path.read_text().splitlines() if line.startswith("#")),
                     path.stem)
        items.append(f"* [{_escape(title)}]({path.name})")
    return "\n".join(items) or "* none yet in this checkout"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "how-to/examples.md":
        return markdown.replace("<!-- examples table -->", examples_table())
    if page.file.src_uri == "results/index.md":
        return markdown.replace("<!-- compare reports -->", compare_reports())
    return markdown


GENERATED_NOTE = "<!-- written by `make reference` from the code (docs/hooks/reference.py); edit the code, not this -->"


def reference_pages() -> dict[str, str]:
    """``{path under docs/: text}`` of the generated reference pages."""
    return {"reference/params.md": f"{GENERATED_NOTE}\n{params_page()}\n",
            "reference/commands.md": f"{GENERATED_NOTE}\n{commands_page()}\n"}


def on_files(files: Files, config) -> Files:
    for uri, png in _plots().draw_all(ROOT).items():
        files.append(File.generated(config, uri, content=png))
    return files


if __name__ == "__main__":
    for rel, text in reference_pages().items():
        path = ROOT / "docs" / rel
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            print(f"docs/{rel}: written")
