"""GSM8K grade-school math word problems, read from a local file.

Each input record has ``question`` and ``answer``; the answer is a worked solution that
ends in ``#### N``. The whole solution is the SFT target and N (commas removed) is the
ground truth, as in verl's GSM8K preprocessing.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rlcore.data.schema import make_row
from rlcore.data.tables import read_records
from rlcore.errors import DataError

DATA_SOURCE = "gsm8k"
ABILITY = "math"
DEFAULT_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
REQUIRED_FIELDS = ("question", "answer")

_FINAL_ANSWER_RE = re.compile(r"####\s*(-?[0-9.,]+)\s*$")


def final_answer(answer: str) -> str | None:
    """Extracts N from a reference solution ending in ``#### N``.

    Args:
        answer: A GSM8K reference solution.

    Returns:
        N with thousands separators removed (``"#### 1,234"`` -> ``"1234"``), or None
        when the text does not end in ``#### N``.
    """
    match = _FINAL_ANSWER_RE.search(answer)
    return None if match is None else match.group(1).replace(",", "")


def _checked_fields(record: Any, where: str) -> tuple[str, str, str]:
    """Returns ``(question, answer, ground_truth)`` or raises naming the bad field."""
    if not isinstance(record, dict):
        got = type(record).__name__
        raise DataError(f"{where}: expected an object with fields {list(REQUIRED_FIELDS)}, got {got}")
    for field in REQUIRED_FIELDS:
        if not isinstance(record.get(field), str):
            got = "nothing" if field not in record else type(record[field]).__name__
            raise DataError(f"{where}: expected string field {field!r}, got {got}")
    ground_truth = final_answer(record["answer"])
    if ground_truth is None:
        raise DataError(f"{where}: expected 'answer' to end in '#### <number>'")
    return record["question"], record["answer"], ground_truth


def gsm8k_rows(
    path: str | Path, *, split: str, instruction: str = DEFAULT_INSTRUCTION
) -> list[dict[str, Any]]:
    """Reads GSM8K records from a ``.jsonl`` or ``.parquet`` file into schema rows.

    Args:
        path: Local file with ``question`` and ``answer`` fields.
        split: Stored in ``extra_info.split``.
        instruction: Appended to the question (after a space) to form the prompt.

    Returns:
        One row per record, in file order, indexed 0..n-1.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: For an unknown suffix, a missing column or field, or an answer
            that does not end in ``#### N``; the message names the file and row.
    """
    path = Path(path)
    rows = []
    for index, (where, record) in enumerate(read_records(path, what="GSM8K file")):
        question, answer, ground_truth = _checked_fields(record, where)
        rows.append(
            make_row(
                data_source=DATA_SOURCE,
                prompt_text=f"{question} {instruction}",
                ability=ABILITY,
                ground_truth=ground_truth,
                split=split,
                index=index,
                question=question,
                answer=answer,
            )
        )
    return rows
