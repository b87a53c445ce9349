"""Named sections of bench/RESULTS.md that other benchmarks own.

``make bench`` rewrites RESULTS.md as a whole; a benchmark with a report of its own (``bench.serve_load``)
writes it between ``<!-- section:NAME -->`` and ``<!-- /section:NAME -->`` markers, and the rewrite keeps
every such section (:func:`keep_sections`). Writing a section again replaces it in place.
"""

from __future__ import annotations

import re
from pathlib import Path

_SECTION = re.compile(r"<!-- section:(?P<name>[\w.-]+) -->\n.*?<!-- /section:(?P=name) -->\n?", re.DOTALL)


def block(name: str, markdown: str) -> str:
    """``markdown`` between the markers of section ``name``."""
    return f"<!-- section:{name} -->\n{markdown.strip()}\n<!-- /section:{name} -->\n"


def sections(text: str) -> dict[str, str]:
    """Every marked section in ``text``: name -> the block, markers included."""
    return {m["name"]: m.group(0) for m in _SECTION.finditer(text)}


def write_section(path: str | Path, name: str, markdown: str) -> None:
    """Put ``markdown`` into section ``name`` of the file at ``path``: in place of the section's old text
    if it has one, else at the end (the file is created when missing)."""
    path = Path(path)
    text = path.read_text() if path.is_file() else ""
    new = block(name, markdown)
    old = sections(text).get(name)
    if old is not None:
        text = text.replace(old, new if old.endswith("\n") else new.rstrip("\n"), 1)
    else:
        text = (text.rstrip("\n") + "\n\n" if text.strip() else "") + new
    path.write_text(text)


def keep_sections(old_text: str, new_text: str) -> str:
    """``new_text`` followed by the sections of ``old_text`` that it lacks (a whole-file rewrite that keeps
    the other benchmarks' sections)."""
    kept = [b for name, b in sections(old_text).items() if name not in sections(new_text)]
    if not kept:
        return new_text
    return new_text.rstrip("\n") + "\n\n" + "\n".join(b.rstrip("\n") + "\n" for b in kept)


def write_keeping_sections(path: str | Path, text: str) -> None:
    """Rewrite the file at ``path`` with ``text``, keeping the marked sections it had."""
    path = Path(path)
    old = path.read_text() if path.is_file() else ""
    path.write_text(keep_sections(old, text))
