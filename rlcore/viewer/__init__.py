"""A PPO round's rollouts file (``metrics/ppo_<round>_rollouts.parquet``) and the HTML page that shows it.

The file holds the ``ppo.log_samples`` rollouts kept at every step of the round, one row each, with the
columns of :data:`ROLLOUT_COLUMNS`. The trainer rewrites it atomically after every step
(:class:`RolloutsFile`), so a crash keeps the steps so far; ``rlcore view`` and the end of each round
turn it into one self-contained page (:func:`render_page`): a table with free-text search, filters by
step, reward and length, click-to-sort columns, and a per-step chart of mean reward and length.

The page is built from three package files beside this module, ``page.html`` (the template, with ``{{NAME}}``
placeholders), ``page.css`` and ``page.js``. It needs no network and no server: the CSS and the script are put
inline, the rows are embedded as JSON in a ``<script type="application/json">`` block (``<``, ``>`` and ``&`` written as ``\\u`` escapes,
so no text can close it), and the script puts every text into the table with ``textContent``: a
response containing ``</script>`` or ``<b>`` shows as those characters. The filters can be set from
the address, e.g. ``page.html#q=12&reward_min=1&sort=-reward``; the page keeps the address in step
with what it shows, so a filtered view can be shared as a link.

Only pandas, pyarrow (its parquet engine) and the standard library are imported here.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any, Sequence

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from rlcore.errors import DataError, InputNotFound

# Where the ppo@<round> stage writes its rollouts (dvc.yaml passes the same path to --rollouts).
ROLLOUTS_PATH = "metrics/ppo_{round}_rollouts.parquet"

# column -> dtype, in file order. policy_version: the number of policy updates behind the weights that
# generated the row (set by the caller; the synchronous loop passes its count of actor updates).
ROLLOUT_DTYPES: dict[str, str] = {
    "step": "int64",             # step of the round (0-based)
    "policy_version": "int64",   # policy updates behind the generating weights
    "uid": "str",                # the prompt's id (its group, for GRPO-style estimators)
    "prompt": "str",             # the question the user message asks (extra_info.question)
    "response": "str",           # the generated text, special tokens dropped
    "ground_truth": "str",       # what the reward function compares against
    "reward": "float64",         # the score the advantage used (rule reward + DAPO overlong penalty)
    "acc": "float64",            # the rule reward alone
    "advantage": "float64",      # mean advantage over the response tokens
    "response_length": "int64",  # response tokens, EOS included
    "log_prob": "float64",       # summed rollout log-prob of the response tokens
}
ROLLOUT_COLUMNS: tuple[str, ...] = tuple(ROLLOUT_DTYPES)
NUMERIC_COLUMNS = tuple(c for c, t in ROLLOUT_DTYPES.items() if t != "str")
ROLLOUT_SCHEMA = pa.schema([(c, {"int64": pa.int64(), "float64": pa.float64(), "str": pa.string()}[t])
                            for c, t in ROLLOUT_DTYPES.items()])
# columns of some rounds only, after the others. turns: a tool-loop trajectory's turns after the prompt, as JSON
# [{"role": "assistant" | "tool" | "user", "content", "name"?}, ...]; the page shows each one.
OPTIONAL_DTYPES: dict[str, str] = {"turns": "str"}
TURNS_SCHEMA = pa.schema([*ROLLOUT_SCHEMA, pa.field("turns", pa.string())])


def rollouts_path(round_name: str) -> str:
    """The rollouts file of round ``round_name``, relative to the repository root."""
    return ROLLOUTS_PATH.format(round=round_name)


def rollouts_table(rows: Sequence[dict[str, Any]]) -> pa.Table:
    """Rollout records (dicts with every column of :data:`ROLLOUT_COLUMNS`) as a typed table in file order;
    no rows gives an empty table with the same columns."""
    if rows and (missing := [c for c in ROLLOUT_COLUMNS if c not in rows[0]]):
        raise ValueError(f"rollout rows lack {', '.join(missing)}")
    return pa.Table.from_pylist(list(rows), schema=TURNS_SCHEMA if rows and "turns" in rows[0] else ROLLOUT_SCHEMA)


def rollouts_frame(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """:func:`rollouts_table` as a frame, typed as :func:`read_rollouts` returns it."""
    return rollouts_table(rows).to_pandas()


def write_rollouts(rows: Sequence[dict[str, Any]] | pa.Table, path: str | Path) -> None:
    """Write rollout records (or a table of them) to the parquet ``path`` atomically: a temporary file
    beside it, then a rename, so a reader (or a crash) only ever sees a complete file."""
    table = rows if isinstance(rows, pa.Table) else rollouts_table(rows)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class RolloutsFile:
    """A rollouts parquet that follows a growing list of records: written empty at once (no stale rows of
    an earlier run survive a crash), then rewritten whole, atomically, by :meth:`update` whenever the list
    grew. Only the new records are converted; the table of the earlier ones is kept. A rewrite costs about
    1 ms at a round's start and 2-5 ms at the end of a 400-step round (3,200 rows), against about 140 ms
    for a step of the default CPU round."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.table = rollouts_table([])
        write_rollouts(self.table, self.path)

    def update(self, rows: Sequence[dict[str, Any]]) -> None:
        """``rows``: every record so far (those already written first, in the same order)."""
        if len(rows) > self.table.num_rows:
            new = rollouts_table(rows[self.table.num_rows:])
            # the first rows decide the columns (a tool-loop round's have turns)
            self.table = new if not self.table.num_rows else pa.concat_tables([self.table, new]).combine_chunks()
            write_rollouts(self.table, self.path)


def read_rollouts(path: str | Path) -> pd.DataFrame:
    """The rollouts file at ``path``, checked: a parquet with every column of :data:`ROLLOUT_COLUMNS`,
    the numeric ones numeric. Raises InputNotFound or DataError naming the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise InputNotFound(f"rollouts file {str(path)!r} not found")
    try:
        df = pd.read_parquet(path)
    except (ValueError, OSError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from None
    missing = [c for c in ROLLOUT_COLUMNS if c not in df.columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {', '.join(missing)} (a rollouts file has "
                        f"{', '.join(ROLLOUT_COLUMNS)})")
    for col in NUMERIC_COLUMNS:
        if not pd.api.types.is_numeric_dtype(df[col]) or pd.api.types.is_bool_dtype(df[col]):
            raise DataError(f"{path}: column {col!r} must be numeric, found dtype {df[col].dtype}")
    return df[page_columns(df)]


def page_columns(df: pd.DataFrame) -> list[str]:
    """The columns of :data:`ROLLOUT_COLUMNS`, then the optional ones ``df`` has."""
    return list(ROLLOUT_COLUMNS) + [c for c in OPTIONAL_DTYPES if c in df.columns]


def _json_value(value: Any) -> Any:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None  # NaN/inf are not JSON; the page shows an empty cell
    return value


def page_data(df: pd.DataFrame) -> dict[str, Any]:
    """What the page embeds: ``{"columns": [...], "rows": [[...], ...]}`` in plain JSON types."""
    columns = page_columns(df)
    values = [[_json_value(v) for v in df[c].astype(object).where(df[c].notna(), None).tolist()] for c in columns]
    return {"columns": columns, "rows": [list(r) for r in zip(*values)] if len(df) else []}


def script_json(data: Any) -> str:
    """``data`` as JSON safe inside ``<script>``: no ``<``, ``>`` or ``&`` left (``</script>`` cannot close it)."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(df: pd.DataFrame, title: str, page_size: int = 500) -> str:
    """The rollouts of ``df`` (columns of :data:`ROLLOUT_COLUMNS`) as one self-contained HTML page.

    ``page_size`` rows of the filtered, sorted table are shown at first; a button shows more."""
    steps = sorted(set(df["step"].tolist()))
    span = f"steps {steps[0]}&ndash;{steps[-1]}" if steps else "no steps"
    summary = f"{len(df)} rollouts, {len(steps)} steps ({span})"
    fields = {"TITLE": html.escape(title), "SUMMARY": summary, "STYLE": page_file("page.css"),
              "SCRIPT": page_file("page.js").replace("{{PAGE_SIZE}}", str(int(page_size))),
              "DATA": script_json(page_data(df))}
    # one pass: text put in (a title, the rows) is never searched for placeholders again
    return re.sub(r"\{\{([A-Z_]+)\}\}", lambda m: fields[m.group(1)], page_file("page.html"))


@cache
def page_file(name: str) -> str:
    """One of the page's package files (``page.html``, ``page.css``, ``page.js``), read once. The script is
    hand-written: a table of a few thousand rows needs filtering, sorting and two small charts, which is less
    code than vendoring a table library."""
    return files(__name__).joinpath(name).read_text(encoding="utf-8")


def write_page(df: pd.DataFrame, path: str | Path, title: str) -> Path:
    """Render ``df`` with :func:`render_page` to ``path`` (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_page(df, title), encoding="utf-8")
    return path
