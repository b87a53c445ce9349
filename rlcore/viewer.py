"""A PPO round's rollouts file (``metrics/ppo_<round>_rollouts.parquet``) and the HTML page that shows it.

The file holds the ``ppo.log_samples`` rollouts kept at every step of the round, one row each, with the
columns of :data:`ROLLOUT_COLUMNS`. The trainer rewrites it atomically after every step
(:class:`RolloutsFile`), so a crash keeps the steps so far; ``rlcore view`` and the end of each round
turn it into one self-contained page (:func:`render_page`): a table with free-text search, filters by
step, reward and length, click-to-sort columns, and a per-step chart of mean reward and length.

The page needs no network and no server: the CSS and the script are inline, the rows are embedded as
JSON in a ``<script type="application/json">`` block (``<``, ``>`` and ``&`` written as ``\\u`` escapes,
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


def rollouts_path(round_name: str) -> str:
    """The rollouts file of round ``round_name``, relative to the repository root."""
    return ROLLOUTS_PATH.format(round=round_name)


def rollouts_table(rows: Sequence[dict[str, Any]]) -> pa.Table:
    """Rollout records (dicts with every column of :data:`ROLLOUT_COLUMNS`) as a typed table in file order;
    no rows gives an empty table with the same columns."""
    if rows and (missing := [c for c in ROLLOUT_COLUMNS if c not in rows[0]]):
        raise ValueError(f"rollout rows lack {', '.join(missing)}")
    return pa.Table.from_pylist(list(rows), schema=ROLLOUT_SCHEMA)


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
            self.table = pa.concat_tables([self.table, new]).combine_chunks()
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
    return df[list(ROLLOUT_COLUMNS)]


def _json_value(value: Any) -> Any:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None  # NaN/inf are not JSON; the page shows an empty cell
    return value


def page_data(df: pd.DataFrame) -> dict[str, Any]:
    """What the page embeds: ``{"columns": [...], "rows": [[...], ...]}`` in plain JSON types."""
    columns = list(ROLLOUT_COLUMNS)
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
    fields = {"TITLE": html.escape(title), "SUMMARY": summary, "STYLE": _STYLE,
              "SCRIPT": _SCRIPT.replace("{{PAGE_SIZE}}", str(int(page_size))), "DATA": script_json(page_data(df))}
    # one pass: text put in (a title, the rows) is never searched for placeholders again
    return re.sub(r"\{\{([A-Z_]+)\}\}", lambda m: fields[m.group(1)], _PAGE)


def write_page(df: pd.DataFrame, path: str | Path, title: str) -> Path:
    """Render ``df`` with :func:`render_page` to ``path`` (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_page(df, title), encoding="utf-8")
    return path


# The page; render_page fills the {{NAME}} placeholders.
_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{TITLE}}</title>
<style>{{STYLE}}</style>
</head>
<body>
<header>
<h1>{{TITLE}}</h1>
<p class="summary">{{SUMMARY}}</p>
</header>
<section id="charts" aria-label="mean reward and response length per step (of the rows shown)"></section>
<form id="filters" autocomplete="off">
<label class="search">search <input type="search" id="q" placeholder="prompt, response, ground truth"></label>
<fieldset><legend>step</legend><input type="number" id="step_min" placeholder="min"> &ndash;
<input type="number" id="step_max" placeholder="max"></fieldset>
<fieldset><legend>reward</legend><input type="number" step="any" id="reward_min" placeholder="min"> &ndash;
<input type="number" step="any" id="reward_max" placeholder="max"></fieldset>
<fieldset><legend>length</legend><input type="number" id="len_min" placeholder="min"> &ndash;
<input type="number" id="len_max" placeholder="max"></fieldset>
<button type="button" id="reset">reset</button>
<output id="count" aria-live="polite"></output>
</form>
<table id="rows">
<thead><tr></tr></thead>
<tbody></tbody>
</table>
<p><button type="button" id="more" hidden>show more</button></p>
<noscript><p>This page draws its table with JavaScript; enable it to see the rollouts.</p></noscript>
<script>{{SCRIPT}}</script>
<script id="rollouts-data" type="application/json">{{DATA}}</script>
<script>RolloutView.start(JSON.parse(document.getElementById("rollouts-data").textContent));</script>
</body>
</html>
"""

_STYLE = """
:root { --fg: #1f2328; --muted: #656d76; --line: #d0d7de; --head: #f6f8fa; --reward: #0969da; --len: #bc4c00; }
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg); margin: 1.2em 2em; }
h1 { font-size: 1.4em; margin: 0 0 .2em; }
.summary { color: var(--muted); margin: 0 0 1em; }
#charts { display: flex; flex-wrap: wrap; gap: 1.5em; margin-bottom: 1em; }
#charts figure { margin: 0; }
#charts figcaption { font-weight: 600; margin-bottom: .2em; }
#charts svg { border: 1px solid var(--line); background: #fff; }
#charts text { font-size: 11px; fill: var(--muted); }
.line { fill: none; stroke-width: 1.5; }
.reward .line, .reward circle { stroke: var(--reward); fill: var(--reward); }
.reward .line { fill: none; }
.length .line, .length circle { stroke: var(--len); fill: var(--len); }
.length .line { fill: none; }
#filters { display: flex; flex-wrap: wrap; align-items: end; gap: .8em; margin-bottom: .8em; }
#filters fieldset { border: 1px solid var(--line); padding: .1em .5em .4em; }
#filters legend { color: var(--muted); font-size: .9em; }
#filters input[type=number] { width: 6em; }
#q { width: 22em; }
#count { color: var(--muted); margin-left: auto; }
table { border-collapse: collapse; width: 100%; }
th, td { border: 1px solid var(--line); padding: .25em .5em; vertical-align: top; text-align: left; }
th { background: var(--head); cursor: pointer; user-select: none; white-space: nowrap; position: sticky; top: 0; }
th[aria-sort=ascending]::after { content: " \\25B2"; }
th[aria-sort=descending]::after { content: " \\25BC"; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.text { white-space: pre-wrap; word-break: break-word; max-width: 40em; }
td.text div { max-height: 12em; overflow: auto; }
td.response { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: .92em; }
"""

# Hand-written: a table of a few thousand rows needs filtering, sorting and two small charts, which is
# less code than vendoring a table library into the repository.
_SCRIPT = r"""
var RolloutView = (function () {
  "use strict";
  var PAGE_SIZE = {{PAGE_SIZE}};
  var SVG = "http://www.w3.org/2000/svg";
  // shown columns: key, header, kind (int | num | text), digits for num
  var SHOWN = [
    ["step", "step", "int"], ["policy_version", "version", "int"], ["uid", "uid", "text"],
    ["prompt", "prompt", "text"], ["response", "response", "text"], ["ground_truth", "ground truth", "text"],
    ["reward", "reward", "num", 3], ["acc", "acc", "num", 3], ["advantage", "advantage", "num", 3],
    ["response_length", "length", "int"], ["log_prob", "log-prob", "num", 2]
  ];
  var RANGES = {step: "step", reward: "reward", len: "response_length"};  // filter name -> column
  var KEYS = ["q", "step_min", "step_max", "reward_min", "reward_max", "len_min", "len_max"];
  var rows = [], state = {sort: "step", desc: false, limit: PAGE_SIZE};

  function $(id) { return document.getElementById(id); }

  function number(text) {
    if (text === null || text === undefined || String(text).trim() === "") return null;
    var x = Number(text);
    return isFinite(x) ? x : null;
  }

  function kind(key) {
    for (var i = 0; i < SHOWN.length; i++) if (SHOWN[i][0] === key) return SHOWN[i][2];
    return null;
  }

  // the address: ?q=... and #q=... both work; the fragment wins
  function readAddress() {
    var p = new URLSearchParams(location.search);
    new URLSearchParams(location.hash.replace(/^#/, "")).forEach(function (v, k) { p.set(k, v); });
    KEYS.forEach(function (k) { $(k).value = p.has(k) ? p.get(k) : ""; });
    var sort = p.get("sort") || "step";
    var desc = sort.charAt(0) === "-";
    sort = desc ? sort.slice(1) : sort;
    state.sort = kind(sort) ? sort : "step";
    state.desc = desc && kind(sort) !== null;
    state.limit = PAGE_SIZE;
  }

  function writeAddress() {
    var p = new URLSearchParams();
    KEYS.forEach(function (k) { if ($(k).value.trim() !== "") p.set(k, $(k).value.trim()); });
    if (state.sort !== "step" || state.desc) p.set("sort", (state.desc ? "-" : "") + state.sort);
    var hash = p.toString();
    try {
      history.replaceState(null, "", hash ? "#" + hash : location.pathname + location.search);
    } catch (e) { /* some browsers refuse it for file:// pages: the view still works */ }
  }

  function filtered() {
    var q = $("q").value.trim().toLowerCase();
    var limits = Object.keys(RANGES).map(function (name) {
      return [RANGES[name], number($(name + "_min").value), number($(name + "_max").value)];
    });
    return rows.filter(function (r) {
      if (q && r._text.indexOf(q) < 0) return false;
      return limits.every(function (l) {
        var v = r[l[0]];
        if (l[1] !== null && !(v !== null && v >= l[1])) return false;
        return !(l[2] !== null && !(v !== null && v <= l[2]));
      });
    });
  }

  function compare(a, b) {
    var x = a[state.sort], y = b[state.sort];
    if (x === null || y === null) return x === y ? 0 : (x === null ? 1 : -1);  // empty cells last
    var c = typeof x === "string" ? x.localeCompare(y) : x - y;
    return state.desc ? -c : c;
  }

  function format(value, spec) {
    if (value === null || value === undefined) return "";
    if (spec[2] === "num") return value.toFixed(spec[3]);
    return String(value);
  }

  function renderTable(list) {
    var body = document.createElement("tbody");
    list.slice(0, state.limit).forEach(function (r) {
      var tr = document.createElement("tr");
      tr.dataset.step = r.step;
      SHOWN.forEach(function (spec) {
        var td = document.createElement("td");
        td.className = (spec[2] === "text" ? "text " : "num ") + spec[0];
        if (spec[2] === "text") {
          var div = document.createElement("div");
          div.textContent = format(r[spec[0]], spec);  // text, never markup
          td.appendChild(div);
        } else {
          td.textContent = format(r[spec[0]], spec);
          if (spec[2] === "num" && r[spec[0]] !== null) td.title = String(r[spec[0]]);
        }
        tr.appendChild(td);
      });
      body.appendChild(tr);
    });
    var table = $("rows");
    table.replaceChild(body, table.tBodies[0]);
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th) {
      if (th.dataset.key === state.sort) th.setAttribute("aria-sort", state.desc ? "descending" : "ascending");
      else th.removeAttribute("aria-sort");
    });
    var more = $("more"), left = list.length - Math.min(list.length, state.limit);
    more.hidden = left <= 0;
    more.textContent = "show " + Math.min(left, PAGE_SIZE) + " more (" + left + " not shown)";
  }

  function svg(tag, attrs, parent) {
    var el = document.createElementNS(SVG, tag);
    Object.keys(attrs).forEach(function (k) { el.setAttribute(k, attrs[k]); });
    if (parent) parent.appendChild(el);
    return el;
  }

  function label(parent, x, y, text, anchor) {
    svg("text", {x: x, y: y, "text-anchor": anchor || "start"}, parent).textContent = text;
  }

  // mean of `key` per step over `list`: [[step, mean, count], ...] by step
  function perStep(list, key) {
    var acc = {};
    list.forEach(function (r) {
      if (r[key] === null) return;
      var a = acc[r.step] || (acc[r.step] = [0, 0]);
      a[0] += r[key];
      a[1] += 1;
    });
    return Object.keys(acc).map(Number).sort(function (a, b) { return a - b; }).map(function (s) {
      return [s, acc[s][0] / acc[s][1], acc[s][1]];
    });
  }

  function chart(list, key, name, cls, digits) {
    var W = 460, H = 170, L = 48, R = 12, T = 10, B = 24;
    var fig = document.createElement("figure"), cap = document.createElement("figcaption");
    cap.textContent = "mean " + name + " per step";
    fig.appendChild(cap);
    var root = svg("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H, "class": cls, role: "img"}, fig);
    svg("title", {}, root).textContent = "mean " + name + " per step";
    var pts = perStep(list, key);
    if (!pts.length) { label(root, W / 2, H / 2, "no rows", "middle"); return fig; }
    var s0 = pts[0][0], s1 = pts[pts.length - 1][0];
    var ys = pts.map(function (p) { return p[1]; });
    var y0 = Math.min.apply(null, ys), y1 = Math.max.apply(null, ys);
    if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
    function px(s) { return s1 === s0 ? (L + W - R) / 2 : L + (s - s0) / (s1 - s0) * (W - L - R); }
    function py(v) { return T + (y1 - v) / (y1 - y0) * (H - T - B); }
    svg("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#d0d7de"}, root);
    svg("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#d0d7de"}, root);
    label(root, L - 4, T + 8, y1.toFixed(digits), "end");
    label(root, L - 4, H - B, y0.toFixed(digits), "end");
    label(root, L, H - 6, "step " + s0, "start");
    if (s1 !== s0) label(root, W - R, H - 6, "step " + s1, "end");
    svg("polyline", {"class": "line", points: pts.map(function (p) { return px(p[0]) + "," + py(p[1]); }).join(" ")},
        root);
    pts.forEach(function (p) {
      var c = svg("circle", {"class": "point", cx: px(p[0]), cy: py(p[1]), r: 3, "data-step": p[0]}, root);
      svg("title", {}, c).textContent = "step " + p[0] + ": " + p[1].toFixed(digits) + " (" + p[2] + " rows)";
    });
    return fig;
  }

  function render() {
    var list = filtered().sort(compare);
    $("count").textContent = list.length + " of " + rows.length + " rows";
    renderTable(list);
    var charts = $("charts");
    charts.textContent = "";
    charts.appendChild(chart(list, "reward", "reward", "reward", 3));
    charts.appendChild(chart(list, "response_length", "response length", "length", 2));
  }

  function update() { state.limit = PAGE_SIZE; writeAddress(); render(); }

  function start(data) {
    rows = data.rows.map(function (values, i) {
      var r = {};
      data.columns.forEach(function (c, j) { r[c] = values[j]; });
      r._text = [r.prompt, r.response, r.ground_truth].join("\n").toLowerCase();
      return r;
    });
    var head = $("rows").tHead.rows[0];
    SHOWN.forEach(function (spec) {
      var th = document.createElement("th");
      th.textContent = spec[1];
      th.dataset.key = spec[0];
      th.title = "sort by " + spec[1];
      th.addEventListener("click", function () {
        state.desc = state.sort === spec[0] ? !state.desc : false;
        state.sort = spec[0];
        writeAddress();
        render();
      });
      head.appendChild(th);
    });
    KEYS.forEach(function (k) { $(k).addEventListener("input", update); });
    $("filters").addEventListener("submit", function (e) { e.preventDefault(); });
    $("reset").addEventListener("click", function () {
      KEYS.forEach(function (k) { $(k).value = ""; });
      state.sort = "step";
      state.desc = false;
      update();
    });
    $("more").addEventListener("click", function () { state.limit += PAGE_SIZE; render(); });
    window.addEventListener("hashchange", function () { readAddress(); render(); });
    readAddress();
    render();
  }

  return {start: start};
})();
"""
