"""Your own task from files: rows of a ``.jsonl`` or ``.parquet`` file turned into the pipeline's row schema.

``task.name: file`` reads ``task.file.train`` (RL prompts), ``task.file.test`` (held-out prompts) and,
optionally, ``task.file.sft`` (demonstrations; without it the first ``n_sft`` train rows are the SFT split
and the RL split starts after them). ``task.columns`` says where each field is:

* ``prompt``: text (one user message) or a list of chat messages ``{"role", "content"}``;
* ``ground_truth``: what the reward compares against: text, or a number (written as text);
* ``demonstration``: the SFT target, text or chat messages whose last one is the assistant's; required in
  the SFT rows, kept (as ``extra_info.answer``) where present elsewhere;
* ``data_source``: a column naming each row's data_source, or none: every row gets ``task.data_source``.

Column names may be dotted to reach into a nested column (``reward_model.ground_truth`` reads a file in
verl's own schema). Every other column is carried into ``extra_info`` (the fourth argument of a reward
function); a column named ``extra_info`` holding a mapping is merged into it, and ``ability`` becomes the
row's ability. ``extra_info`` always has ``split``, ``index``, ``question`` (the prompt's last user message)
and ``answer`` (the demonstration, or ``""``); a file column of one of those names is kept as
``file_<name>``. Rows are taken in file order. Each bad row stops the prepare stage with one line naming
the file, the row and the field.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from rlcore.data.schema import EXTRA_INFO_FIELDS
from rlcore.data.tables import lookup, read_records
from rlcore.errors import DataError

DEFAULT_ABILITY = "general"
ROLES = ("system", "user", "assistant", "tool")


def _messages(value: Any, where: str, field: str) -> list[dict[str, str]] | None:
    """A list of ``{role, content}`` messages, or None when ``value`` is not a list."""
    if not isinstance(value, (list, tuple)) and type(value).__name__ != "ndarray":
        return None
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: field {field!r}[{k}] should be a message {{\"role\": str, \"content\": str}}, "
                            f"got {str(m)[:80]!r}")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: field {field!r}[{k}] has role {m['role']!r}; expected one of {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _prompt(value: Any, where: str, field: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: field {field!r} is empty; expected the prompt text")
        return [{"role": "user", "content": value}]
    messages = _messages(value, where, field)
    if messages is None:
        raise DataError(f"{where}: field {field!r} should be text or a list of chat messages, "
                        f"got {'nothing' if value is None else type(value).__name__}")
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise DataError(f"{where}: field {field!r} has no user message with text")
    if messages[-1]["role"] == "assistant":
        raise DataError(f"{where}: field {field!r} ends with an assistant message; the prompt is what comes "
                        "before the answer (put the answer in the demonstration column)")
    return messages


def _text(value: Any, where: str, field: str) -> str:
    """A ground truth: text as is, an int or a finite float written as text."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not math.isfinite(value)):
        got = "nothing" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"
        raise DataError(f"{where}: field {field!r} should be text or a number, got {got}")
    return str(value)


def _demonstration(value: Any, where: str, field: str) -> str:
    if isinstance(value, str):
        return value
    messages = _messages(value, where, field)
    if messages is None or not messages or messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: field {field!r} should be the demonstration text, or chat messages ending with "
                        f"the assistant's, got {'nothing' if value is None else type(value).__name__}")
    return messages[-1]["content"]


def _extra(record: Mapping[str, Any], used: set[str]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    nested = record.get("extra_info")
    if isinstance(nested, Mapping) and "extra_info" not in used:
        extra.update(nested)
        used = used | {"extra_info"}
    for key, value in record.items():
        if key not in used and key != "ability":
            extra[key] = value
    return {(f"file_{k}" if k in EXTRA_INFO_FIELDS else k): v for k, v in extra.items()}


def _column(record: Mapping[str, Any], name: str, key: str, where: str, what: str = "") -> Any:
    """The value of column ``name`` (``task.columns.<key>``, ``what`` it holds); a column the file does not have is a
    DataError naming the key and the columns it has."""
    if name not in record and (name.split(".")[0] not in record or lookup(record, name) is None):
        have = ", ".join(repr(k) for k in record) or "none"
        raise DataError(f"{where}: no column {name!r}, which task.columns.{key} names{what}; the file's columns: "
                        f"{have}")
    return lookup(record, name)


def file_row(record: Mapping[str, Any], where: str, *, columns: Any, data_source: str, split: str, index: int,
             need_demonstration: bool) -> dict[str, Any]:
    """One row of the pipeline's schema from one file record (``columns``: ``task.columns``)."""
    prompt = _prompt(_column(record, columns.prompt, "prompt", where), where, columns.prompt)
    truth = _text(_column(record, columns.ground_truth, "ground_truth", where), where, columns.ground_truth)
    demo = lookup(record, columns.demonstration)
    if demo is None and need_demonstration:  # a column the file lacks: say which it has
        _column(record, columns.demonstration, "demonstration", where, " (the SFT demonstration)")
        raise DataError(f"{where}: missing field {columns.demonstration!r}, the SFT demonstration (task.columns."
                        "demonstration)")
    answer = "" if demo is None else _demonstration(demo, where, columns.demonstration)
    if columns.data_source is not None:
        source = lookup(record, columns.data_source)
        if not isinstance(source, str) or not source:
            raise DataError(f"{where}: field {columns.data_source!r} (task.columns.data_source) should be a "
                            f"data_source name, got {str(source)[:40]!r}")
    else:
        source = data_source
    ability = record.get("ability")
    used = {c.split(".")[0] for c in (columns.prompt, columns.ground_truth, columns.demonstration,
                                      columns.data_source) if c is not None}
    question = next(m["content"] for m in reversed(prompt) if m["role"] == "user")
    return {"data_source": source, "prompt": prompt,
            "ability": ability if isinstance(ability, str) and ability else DEFAULT_ABILITY,
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {**_extra(record, used), "split": split, "index": index, "question": question,
                           "answer": answer}}


def file_rows(path: str, *, columns: Any, data_source: str, split: str, limit: int, start: int = 0,
              need_demonstration: bool = False) -> list[dict[str, Any]]:
    """Rows ``start`` to ``start + limit - 1`` of ``path`` (fewer when the file ends), in the row schema,
    indexed 0.. within ``split``."""
    records = read_records(path, what=f"task file ({split})")[start:start + limit]
    return [file_row(record, where, columns=columns, data_source=data_source, split=split, index=i,
                     need_demonstration=need_demonstration) for i, (where, record) in enumerate(records)]


def no_rows_left(path: str, split: str, start: int, total: int) -> DataError:
    return DataError(f"{path}: no rows left for split {split!r} after the first {start}; the file has only "
                     f"{total} rows (lower task.n_sft, or add task.file.sft)")


def split_files(file: Mapping[str, str], *, columns: Any, data_source: str, n_sft: int, n_rl: int,
                n_test: int) -> dict[str, list[dict[str, Any]]]:
    """The three splits of ``task.name: file`` (see the module docstring)."""
    for key in ("train", "test"):
        if key not in file:
            raise DataError(f"task.name file needs task.file.{key} (a local .jsonl or .parquet file)")
    train, test = file["train"], file["test"]
    if "sft" in file:
        sft = file_rows(file["sft"], columns=columns, data_source=data_source, split="sft_train", limit=n_sft,
                        need_demonstration=True)
        rl_start = 0
    else:
        sft = file_rows(train, columns=columns, data_source=data_source, split="sft_train", limit=n_sft,
                        need_demonstration=True)
        rl_start = len(sft)
    rl = file_rows(train, columns=columns, data_source=data_source, split="rl_train", limit=n_rl, start=rl_start)
    if not rl:
        raise no_rows_left(train, "rl_train", rl_start, rl_start)
    return {"sft_train": sft, "rl_train": rl,
            "test": file_rows(test, columns=columns, data_source=data_source, split="test", limit=n_test)}


def overlap(test: Sequence[Mapping[str, Any]], *others: Sequence[Mapping[str, Any]]) -> int:
    """Test rows whose prompt also appears in another split (reported by prepare: a held-out score on
    prompts the model trained on is not held out)."""
    seen = {str(r["prompt"]) for rows in others for r in rows}
    return sum(str(r["prompt"]) in seen for r in test)
