"""The row schema every dataset in rlcore follows, plus parquet read/write.

Rows follow verl's RL dataset layout, one dict per row::

    {
        "data_source": str,                      # selects the reward function
        "prompt": [{"role": "user", "content": str}, ...],
        "ability": str,
        "reward_model": {"style": "rule", "ground_truth": str},
        "extra_info": {"split": str, "index": int, "question": str, "answer": str},
    }

``extra_info.answer`` is the SFT target: the full demonstration the model should emit.

Row numbers in error messages are 0-based positions, the same numbers ``df.iloc`` takes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence, Union

import numpy as np

from rlcore.errors import DataError, InputNotFound

if TYPE_CHECKING:
    import pandas as pd

# pandas and pyarrow are imported where files are read or written, not here: the reward rules import the data
# sources' constants through this package, and a scoring process or Ray worker has no use for them (seconds).
Rows = Union["pd.DataFrame", Sequence[Mapping[str, Any]]]

# field -> expected python type, for the flat fields and each nested dict.
TOP_FIELDS: dict[str, type] = {
    "data_source": str,
    "prompt": list,
    "ability": str,
    "reward_model": dict,
    "extra_info": dict,
}
REWARD_MODEL_FIELDS: dict[str, type] = {"style": str, "ground_truth": str}
EXTRA_INFO_FIELDS: dict[str, type] = {"split": str, "index": int, "question": str, "answer": str}
MESSAGE_FIELDS: dict[str, type] = {"role": str, "content": str}


def make_row(
    *,
    data_source: str,
    prompt_text: str,
    ability: str,
    ground_truth: str,
    split: str,
    index: int,
    question: str,
    answer: str,
) -> dict[str, Any]:
    """Builds one row in the schema above.

    Args:
        data_source: Dataset name; also the key of the reward function.
        prompt_text: Content of the single user message.
        ability: Coarse task category (e.g. "math").
        ground_truth: What the rule-based reward compares against.
        split: Split name stored in ``extra_info.split``.
        index: Position of the row within its split.
        question: The raw question (without any instruction suffix).
        answer: The SFT target response text.

    Returns:
        The row dict.
    """
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": prompt_text}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": int(index), "question": question, "answer": answer},
    }


def _type_name(value: Any) -> str:
    return type(value).__name__


def _is_missing(value: Any) -> bool:
    # DataFrames and parquet structs fill absent fields with None or NaN instead of dropping them.
    return value is None or (isinstance(value, float) and np.isnan(value))


def _is_type(value: Any, expected: type) -> bool:
    # bool is a subclass of int, but an index of True is a bug, not an int.
    if expected is int:
        return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if expected is list:
        return isinstance(value, (list, tuple, np.ndarray))
    return isinstance(value, expected)


def _check_fields(obj: Mapping[str, Any], fields: Mapping[str, type], where: str) -> str | None:
    """Returns a description of the first missing or mistyped field, or None."""
    for name, expected in fields.items():
        label = f"{where}.{name}" if where else name
        if _is_missing(obj.get(name)):
            return f"missing field {label!r}"
        if not _is_type(obj[name], expected):
            return f"field {label!r} should be {expected.__name__}, got {_type_name(obj[name])}"
    return None


def _check_prompt(prompt: Any) -> str | None:
    if len(prompt) == 0:
        return "field 'prompt' is an empty list; expected at least one message"
    for k, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            return f"field 'prompt[{k}]' should be dict, got {_type_name(message)}"
        problem = _check_fields(message, MESSAGE_FIELDS, f"prompt[{k}]")
        if problem:
            return problem
    if not any(str(m["content"]).strip() for m in prompt):
        return "field 'prompt' has no text (every message's content is empty)"
    return None


def row_problem(row: Mapping[str, Any]) -> str | None:
    """Describes what is wrong with one row, or returns None when it is valid.

    Args:
        row: One row dict.

    Returns:
        A short description naming the bad or missing field, or None.
    """
    if not isinstance(row, Mapping):
        return f"row should be dict, got {_type_name(row)}"
    return (
        _check_fields(row, TOP_FIELDS, "")
        or _check_prompt(row["prompt"])
        or _check_fields(row["reward_model"], REWARD_MODEL_FIELDS, "reward_model")
        or _check_fields(row["extra_info"], EXTRA_INFO_FIELDS, "extra_info")
    )


def _as_records(df_or_rows: Rows) -> list[Mapping[str, Any]]:
    pd = sys.modules.get("pandas")  # a DataFrame is only there if pandas is
    if pd is not None and isinstance(df_or_rows, pd.DataFrame):
        return df_or_rows.to_dict("records")
    return list(df_or_rows)


def validate_rows(df_or_rows: Rows, source: str) -> None:
    """Checks every row against the schema, types included.

    Extra fields are allowed (verl tolerates them too); missing or mistyped ones are not.

    Args:
        df_or_rows: A DataFrame or a sequence of row dicts.
        source: Where the rows came from (usually a file path), named in errors.

    Raises:
        ValueError: ``"<source>: row <i>: <problem>"`` for the first bad row, or
            ``"<source>: no rows"`` when there are none.
    """
    records = _as_records(df_or_rows)
    if not records:
        raise DataError(f"{source}: no rows; expected at least one row")
    for i, row in enumerate(records):
        problem = row_problem(row)
        if problem:
            raise DataError(f"{source}: row {i}: {problem}")


def write_rows(rows: Iterable[Mapping[str, Any]], path: str | Path) -> None:
    """Validates rows and writes them to a parquet file, creating parent directories.

    Args:
        rows: Row dicts in the schema above.
        path: Destination ``.parquet`` file.

    Raises:
        ValueError: If a row does not follow the schema.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [dict(r) for r in rows]
    path = Path(path)
    validate_rows(records, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    # from_pylist keeps prompt as list<struct> and the dicts as structs, which is what
    # verl's parquet datasets look like.
    try:
        table = pa.Table.from_pylist(records)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise DataError(f"{path}: {_mixed_field(records) or 'the rows cannot be stored as parquet'} ({err})") from None
    pq.write_table(table, path)


def _mixed_field(records: Sequence[Mapping[str, Any]]) -> str | None:
    """Names the first ``extra_info`` field whose values have different types in different rows (parquet
    needs one type per column)."""
    import pyarrow as pa

    for key in dict.fromkeys(k for r in records for k in r["extra_info"]):
        try:
            pa.array([r["extra_info"].get(key) for r in records])
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            kinds = sorted({type(r["extra_info"][key]).__name__ for r in records
                            if r["extra_info"].get(key) is not None})
            return f"field 'extra_info.{key}' has different types in different rows ({', '.join(kinds)})"
    return None


def read_rows(path: str | Path) -> pd.DataFrame:
    """Reads a parquet file written by ``write_rows`` and validates it.

    Nested values come back as plain python lists and dicts (not numpy arrays), so
    ``df.iloc[i]["prompt"][0]["content"]`` works as it did before writing.

    Args:
        path: A ``.parquet`` file.

    Returns:
        One DataFrame row per dataset row.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: If a row does not follow the schema.
    """
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise InputNotFound(f"dataset file not found: {path} (run the prepare stage first?)")
    # to_pylist avoids pandas' conversion of list<struct> columns into numpy object arrays.
    try:
        records = pq.read_table(path).to_pylist()
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from None
    validate_rows(records, str(path))
    return pd.DataFrame.from_records(records, columns=list(records[0].keys()))
