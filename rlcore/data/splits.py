"""Builds the three splits the pipeline uses: ``sft_train``, ``rl_train`` and ``test``.

Task builders live in the ``TASKS`` registry, so ``params.yaml`` names a task and an
unknown name fails with the list of allowed ones. Each builder names exactly the ``task``
settings it reads (:func:`task_options`); :func:`build_splits` refuses any other keyword.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from rlcore.data.arithmetic import add_demonstrator_errors, add_long_tail, arithmetic_rows, available_problems
from rlcore.data.calculator import with_demonstrations
from rlcore.data.files import split_files
from rlcore.data.gsm8k import gsm8k_rows
from rlcore.errors import ConfigError, DataError
from rlcore.registry import Registry, check_keywords, keyword_names

SPLITS = ("sft_train", "rl_train", "test")

Splits = dict[str, list[dict[str, Any]]]
TASKS: Registry[Callable[..., Splits]] = Registry("task")


def _split_seed(seed: int, split: str) -> int:
    """Derives an independent seed per split so the splits do not share random streams."""
    return int(np.random.SeedSequence([seed, SPLITS.index(split)]).generate_state(1)[0])


def _reindexed(rows: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """Copies rows with ``extra_info.split``/``index`` set to ``split`` and 0..n-1."""
    out = []
    for index, row in enumerate(rows):
        extra = {**row["extra_info"], "split": split, "index": index}
        out.append({**row, "extra_info": extra})
    return out


@TASKS.register("arithmetic")
def _arithmetic_splits(
    *,
    seed: int,
    n_sft: int,
    n_rl: int,
    n_test: int,
    min_digits: int,
    max_digits: int,
    ops: tuple[str, ...],
    sft_carry_error_rate: float = 0.0,
    long_tail_frac: float = 0.0,
    long_tail_length: int = 24,
) -> Splits:
    """Generates test first, then train splits that never contain a test question.

    ``sft_train`` and ``rl_train`` are disjoint too when the problem space holds all
    three; otherwise ``rl_train`` may repeat ``sft_train`` questions (never test ones).
    With ``sft_carry_error_rate`` > 0 the SFT demonstrations come from an imperfect
    demonstrator who forgets carries at that rate (see ``add_demonstrator_errors``).
    With ``long_tail_frac`` > 0 that share of every split's rows asks for a long answer:
    ``long_tail_length`` filler characters before the number (see ``add_long_tail``).
    """
    config = {"min_digits": min_digits, "max_digits": max_digits, "ops": tuple(ops)}
    sft, rl, test = _problem_splits(seed, n_sft, n_rl, n_test, config)
    if sft_carry_error_rate:
        sft, _ = add_demonstrator_errors(sft, sft_carry_error_rate, _split_seed(seed, "sft_train") + 1)
    splits = {"sft_train": sft, "rl_train": rl, "test": test}
    if long_tail_frac:  # after the exclusions above, which compare unmarked questions
        for name, rows in splits.items():
            splits[name], _ = add_long_tail(rows, long_tail_frac, long_tail_length, _split_seed(seed, name) + 2)
    return splits


def _problem_splits(seed: int, n_sft: int, n_rl: int, n_test: int, config: dict[str, Any]) -> tuple[list, list, list]:
    """Arithmetic problems of ``config``: test first, then SFT and RL rows that never hold a test question (and,
    while the problem space allows, not each other's)."""
    test = arithmetic_rows(n_test, seed=_split_seed(seed, "test"), split="test", **config)
    held_out = frozenset(r["extra_info"]["question"] for r in test)
    sft = arithmetic_rows(
        n_sft, seed=_split_seed(seed, "sft_train"), split="sft_train", exclude=held_out, **config
    )
    sft_questions = frozenset(r["extra_info"]["question"] for r in sft)
    rl_exclude = held_out | sft_questions
    if available_problems(exclude=rl_exclude, **config) < n_rl:
        rl_exclude = held_out  # too few problems: let RL reuse SFT prompts, still not test ones
    rl = arithmetic_rows(
        n_rl, seed=_split_seed(seed, "rl_train"), split="rl_train", exclude=rl_exclude, **config
    )
    return sft, rl, test


@TASKS.register("calculator")
def _calculator_splits(*, seed: int, n_sft: int, n_rl: int, n_test: int, min_digits: int, max_digits: int,
                       sft_tool_rate: float = 0.5, sft_tool_error_rate: float = 0.0) -> Splits:
    """Multiplication problems (``"37*85"``) that need the ``calculator`` tool (``rlcore.data.calculator``): the
    splits as the arithmetic task draws them; the SFT rows' demonstrations call the calculator on a share
    ``sft_tool_rate`` of the problems and type ``+`` for ``*`` on a share ``sft_tool_error_rate`` of those calls
    (``extra_info.messages``, multi-turn)."""
    config = {"min_digits": min_digits, "max_digits": max_digits, "ops": ("*",)}
    sft, rl, test = _problem_splits(seed, n_sft, n_rl, n_test, config)
    sft = with_demonstrations(sft, tool_rate=sft_tool_rate, error_rate=sft_tool_error_rate,
                              seed=_split_seed(seed, "sft_train") + 1)
    return {"sft_train": sft, "rl_train": rl, "test": test}


@TASKS.register("gsm8k")
def _gsm8k_splits(*, n_sft: int, n_rl: int, n_test: int, file: Mapping[str, str]) -> Splits:
    """Splits GSM8K-format files in file order: ``test`` is the first ``n_test`` rows of ``task.file.test``.

    Without ``task.file.sft``, ``sft_train`` is the first ``n_sft`` rows of ``task.file.train`` and ``rl_train``
    the next ``n_rl``; with it (demonstrations of their own, e.g. worked answers from another source than the
    answers the reward checks), ``sft_train`` is its first ``n_sft`` rows and ``rl_train`` the train file's first
    ``n_rl``. When a file has fewer rows than asked for, a split gets all that is left (so it may be shorter than
    requested), but a split left with no rows at all is an error.
    """
    missing = [k for k in ("train", "test") if k not in file]
    if missing:
        raise ConfigError(f"task 'gsm8k' needs task.file.{missing[0]} (a local .jsonl or .parquet file)")
    train = gsm8k_rows(file["train"], split="train")
    test = gsm8k_rows(file["test"], split="test")
    if "sft" in file:  # demonstrations of their own: RL takes the train file from its first row
        sft_path, sft, rl_start = file["sft"], gsm8k_rows(file["sft"], split="sft"), 0
    else:
        sft_path, sft, rl_start = file["train"], train, n_sft
    splits = {
        "sft_train": _reindexed(sft[:n_sft], "sft_train"),
        "rl_train": _reindexed(train[rl_start : rl_start + n_rl], "rl_train"),
        "test": _reindexed(test[:n_test], "test"),
    }
    sources = {"sft_train": (sft_path, sft), "rl_train": (file["train"], train), "test": (file["test"], test)}
    for name, rows in splits.items():
        if not rows:
            path, file_rows = sources[name]
            raise DataError(
                f"{path}: no rows left for split {name!r}; the file has only {len(file_rows)} rows"
            )
    return splits


@TASKS.register("file")
def _file_splits(*, n_sft: int, n_rl: int, n_test: int, file: Mapping[str, str], columns: Any,
                 data_source: str) -> Splits:
    """Your own task from ``.jsonl``/``.parquet`` files (``task.file``, ``task.columns``; see
    :mod:`rlcore.data.files`): the first ``n_sft`` SFT rows, ``n_rl`` RL rows and ``n_test`` test rows."""
    return split_files(file, columns=columns, data_source=data_source, n_sft=n_sft, n_rl=n_rl, n_test=n_test)


def task_options(task: str) -> frozenset[str]:
    """The settings the builder of ``task`` takes (``seed`` and ``task`` section fields)."""
    return keyword_names(TASKS.get(task))


def build_splits(task: str, **options: Any) -> Splits:
    """Builds the ``sft_train``, ``rl_train`` and ``test`` splits of a task.

    Args:
        task: A name in ``TASKS`` ("arithmetic", "gsm8k" or "file").
        **options: Exactly what the task's builder takes (``task_options``): ``seed`` and the sizes
            ``n_sft``/``n_rl``/``n_test`` for both; ``min_digits``, ``max_digits``, ``ops``,
            ``sft_carry_error_rate``, ``long_tail_frac`` and ``long_tail_length`` (arithmetic); ``file`` (gsm8k,
            file); ``columns`` and ``data_source`` (file).

    Returns:
        ``{"sft_train": rows, "rl_train": rows, "test": rows}``, each split's rows having
        ``extra_info.split`` set to its name and ``extra_info.index`` 0..n-1.

    Raises:
        KeyError: For an unknown task, listing the allowed ones.
        TypeError: For an option the task does not take.
        ValueError: For sizes below 1 or sizes the task cannot provide.
    """
    builder = TASKS.get(task)
    check_keywords(f"task {task!r}", options, task_options(task))
    for name in ("n_sft", "n_rl", "n_test"):
        if options.get(name, 1) < 1:
            raise ValueError(f"{name} must be >= 1, got {options[name]}")
    if "ops" in options:
        options["ops"] = tuple(options["ops"])
    return builder(**options)
