"""One reader for the row files users bring: JSON lines or parquet, as plain dicts with their position.

Every file rlcore reads from a user (task data, GSM8K files, preference pairs, generations to score) goes
through :func:`read_records`, so each bad row is reported the same way: ``"<file>: row <i> (line <n>): ..."``
with 0-based row numbers (blank lines of a JSON-lines file are skipped and not counted). Importing this
module loads pyarrow only when a parquet file is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Mapping

from rlcore.errors import DataError, InputNotFound

SUFFIXES = (".jsonl", ".parquet")


def check_suffix(path: str | Path, what: str) -> None:
    """A :class:`DataError` naming ``what`` unless ``path`` ends in one of :data:`SUFFIXES`."""
    if Path(path).suffix not in SUFFIXES:
        raise DataError(f"{what} {str(path)!r}: unsupported file type {Path(path).suffix or '(none)'!r}; "
                        f"expected {' or '.join(SUFFIXES)}")


def read_records(path: str | Path, *, what: str = "file") -> list[tuple[str, dict[str, Any]]]:
    """``(where, record)`` for every row of a ``.jsonl`` or ``.parquet`` file, in file order; ``where`` is
    ``"<path>: row <i>"`` (plus the line number for JSON lines), the prefix of every error about that row.

    Raises:
        InputNotFound: No such file.
        DataError: Another suffix, a line that is not one JSON object, an unreadable parquet file, no rows.
    """
    path = Path(path)
    if not path.is_file():
        raise InputNotFound(f"{what} not found: {path}")
    check_suffix(path, what)
    records = list(_jsonl(path) if path.suffix == ".jsonl" else _parquet(path))
    if not records:
        raise DataError(f"{path}: no rows; expected at least one")
    return records


def _jsonl(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with path.open(encoding="utf-8") as f:
        row = 0
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}: row {row} (line {lineno})"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: expected one JSON object per line ({err.msg})") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield where, record
            row += 1


def _parquet(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from None
    for i, record in enumerate(rows):
        yield f"{path}: row {i}", record


def lookup(record: Mapping[str, Any], dotted: str) -> Any:
    """``record["a"]["b"]`` for ``"a.b"``; None when any part is missing (a column name with a dot in it is
    found whole first)."""
    if dotted in record:
        return record[dotted]
    value: Any = record
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value
