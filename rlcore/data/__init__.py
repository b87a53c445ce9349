"""Datasets in verl's RL row schema: generation, loading, splitting, parquet I/O."""

from rlcore.data.arithmetic import arithmetic_rows, count_problems, make_problem
from rlcore.data.gsm8k import gsm8k_rows
from rlcore.data.schema import read_rows, validate_rows, write_rows
from rlcore.data.splits import SPLITS, TASKS, build_splits

__all__ = [
    "SPLITS",
    "TASKS",
    "arithmetic_rows",
    "build_splits",
    "count_problems",
    "gsm8k_rows",
    "make_problem",
    "read_rows",
    "validate_rows",
    "write_rows",
]
