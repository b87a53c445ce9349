"""What the reward can score, checked before anything heavy starts.

A row that no reward applies to (its ``data_source`` has no built-in rule and no function of yours or reward
model is configured), or whose ground truth the built-in rule cannot compare with (``"forty"`` for an integer
answer), would otherwise fail in the middle of a PPO step, after Ray started and models loaded.
:func:`check_ground_truths` stops the stage at load time instead, with one line naming the file, the row and
the field.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from rlcore.data.arithmetic import DATA_SOURCE as ARITHMETIC
from rlcore.data.gsm8k import DATA_SOURCE as GSM8K
from rlcore.data.schema import read_rows
from rlcore.errors import DataError
from rlcore.rewards.rule import RULES

# data_source -> (pattern the ground truth must match in full, what it is)
GROUND_TRUTH_FORMATS: dict[str, tuple[re.Pattern[str], str]] = {
    ARITHMETIC: (re.compile(r"-?[0-9]+"), "an integer such as '46' or '-3'"),
    GSM8K: (re.compile(r"-?[0-9]+(\.[0-9]+)?"), "a number without commas such as '18' or '2.5'"),
}


def check_ground_truths(rows: Iterable[Mapping[str, Any]], source: str, *, others: bool = False) -> None:
    """Raise DataError for the first row whose data_source has no built-in rule while nothing else scores it
    (``others``: functions of yours or a reward model are configured) or whose ``reward_model.ground_truth``
    does not have its data_source's format."""
    for i, row in enumerate(rows):
        ds = row["data_source"]
        if ds not in RULES:
            if others:
                continue
            raise DataError(f"{source}: row {i}: field 'data_source' is {ds!r}, which has no built-in rule "
                            f"(those: {', '.join(sorted(RULES.names()))}) and no reward.functions or reward.model "
                            "is configured to score it")
        fmt = GROUND_TRUTH_FORMATS.get(ds)
        truth = row["reward_model"]["ground_truth"]
        if fmt is not None and not fmt[0].fullmatch(truth):
            raise DataError(f"{source}: row {i}: field 'reward_model.ground_truth' is {truth!r}; "
                            f"data_source {ds} expects {fmt[1]}")


def read_reward_rows(path: str, reward: Any = None):
    """The rows of a dataset parquet (``rlcore.data.schema.read_rows``: the schema checked), with every
    row's data_source and ground truth checked as above against params.yaml's ``reward`` section (None: the
    built-in rules alone): what score, PPO rounds and evaluate read."""
    df = read_rows(path)
    others = reward is not None and bool(reward.functions or reward.model)
    check_ground_truths(df.to_dict("records"), str(path), others=others)
    return df
