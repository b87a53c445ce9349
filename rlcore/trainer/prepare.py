"""The prepare stage's work: the task's ``sft_train`` / ``rl_train`` / ``test`` splits as parquet.

One function builds them from the typed config, so every caller (``stages.prepare``, the
benchmark's fixture) passes every task param the same way.
"""

from __future__ import annotations

from pathlib import Path

from rlcore.config import Config
from rlcore.data.schema import write_rows
from rlcore.data.splits import build_splits, task_options
from rlcore.registry import options_from


def write_splits(cfg: Config, out_dir: str | Path) -> dict[str, float]:
    """Build the splits of ``cfg.task`` (seeded by ``cfg.seed``), write ``<split>.parquet`` into
    ``out_dir`` and return the stage metrics: rows per split and how many SFT demonstrations are
    wrong (``task.sft_carry_error_rate``)."""
    wanted = task_options(cfg.task.name)
    options = options_from(cfg.task, wanted - {"seed"})
    if "seed" in wanted:  # a generated task; a file-backed one (gsm8k) has no randomness
        options["seed"] = cfg.seed
    splits = build_splits(cfg.task.name, **options)
    for name, rows in splits.items():
        write_rows(rows, Path(out_dir) / f"{name}.parquet")
    metrics: dict[str, float] = {f"prepare/{name}_rows": len(rows) for name, rows in splits.items()}
    metrics["prepare/sft_wrong_demonstrations"] = sum(
        r["extra_info"]["answer"] != r["reward_model"]["ground_truth"] for r in splits["sft_train"])
    return metrics
