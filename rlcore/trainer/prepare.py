"""The prepare stage's work: the task's ``sft_train`` / ``rl_train`` / ``test`` splits as parquet.

One function builds them from the typed config, so every caller (``stages.prepare``, the
benchmark's fixture) passes every task param the same way.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlcore.config import Config
from rlcore.data.arithmetic import arithmetic_rows
from rlcore.data.files import overlap
from rlcore.data.pairs import arithmetic_pairs
from rlcore.data.schema import write_rows
from rlcore.data.splits import build_splits, task_options
from rlcore.inputs import recorded_sha256
from rlcore.registry import options_from
from rlcore.rewards.rule import RULES, compute_score


def check_task_files(cfg: Config, inputs_dir: str | Path) -> dict[str, str]:
    """The sha256 of each ``task.file`` the task reads, checked against what its ``task_file`` stage recorded
    in ``inputs_dir`` (:func:`rlcore.inputs.recorded_sha256`)."""
    if "file" not in task_options(cfg.task.name):
        return {}
    return {split: recorded_sha256(inputs_dir, split, path) for split, path in cfg.task.file.items()}


def write_splits(cfg: Config, out_dir: str | Path) -> dict[str, float]:
    """Build the splits of ``cfg.task`` (seeded by ``cfg.seed``), write ``<split>.parquet`` into
    ``out_dir`` and return the stage metrics: rows per split, how many SFT demonstrations are wrong
    (``task.sft_carry_error_rate``; for a file task, demonstrations that differ from the ground truth) and
    how many test prompts also appear in a training split."""
    wanted = task_options(cfg.task.name)
    options = options_from(cfg.task, wanted - {"seed"})
    if "seed" in wanted:  # a generated task; a file-backed one (gsm8k) has no randomness
        options["seed"] = cfg.seed
    splits = build_splits(cfg.task.name, **options)
    for name, rows in splits.items():
        write_rows(rows, Path(out_dir) / f"{name}.parquet")
    metrics: dict[str, float] = {f"prepare/{name}_rows": len(rows) for name, rows in splits.items()}
    metrics["prepare/sft_wrong_demonstrations"] = sum(map(wrong_demonstration, splits["sft_train"]))
    metrics["prepare/test_prompts_seen_in_training"] = overlap(splits["test"], splits["sft_train"], splits["rl_train"])
    pairs = cfg.task.pairs
    if pairs.n_train or pairs.n_test:
        metrics.update(write_pairs(cfg, splits["test"], Path(out_dir)))
    return metrics


def wrong_demonstration(row: dict) -> bool:
    """Whether a row's SFT demonstration (``extra_info.answer``) is one its data_source's rule would not score as
    correct: a GSM8K solution's ``#### N``, a long-tailed arithmetic answer after its filler, a tool-loop
    demonstration's final turn. A data_source without a rule (a file task's own): the demonstration differs from
    the ground truth. A ground truth the rule cannot read counts as wrong."""
    answer, truth, source = row["extra_info"]["answer"], row["reward_model"]["ground_truth"], row["data_source"]
    if source not in RULES:
        return answer != truth
    try:
        return compute_score(source, answer, truth) < 1.0
    except (ValueError, TypeError):
        return True


def write_pairs(cfg: Config, test_rows: list, out_dir: Path) -> dict[str, float]:
    """The arithmetic task's built-in preference pairs (``task.pairs``): ``pairs_train.parquet`` from questions
    outside the test split, ``pairs_test.parquet`` from the test split's first ``n_test`` questions."""
    t = cfg.task
    config: dict = {"min_digits": t.min_digits, "max_digits": t.max_digits, "ops": tuple(t.ops)}
    held_out = frozenset(r["extra_info"]["question"] for r in test_rows)
    train_rows = arithmetic_rows(t.pairs.n_train, seed=cfg.seed + 7919, split="pairs", exclude=held_out, **config)
    out: dict[str, float] = {}
    for name, rows, flip in (("train", train_rows, t.pairs.flip_rate), ("test", test_rows[:t.pairs.n_test], 0.0)):
        records = arithmetic_pairs(rows, seed=cfg.seed + (7927 if name == "train" else 7933), flip_rate=flip,
                                   config=config)
        out_dir.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(records), out_dir / f"pairs_{name}.parquet")
        out[f"prepare/pairs_{name}_rows"] = len(records)
    return out
