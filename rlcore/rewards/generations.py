"""Scoring a generations file (``rlcore eval``) and the unbiased pass@k estimator the evaluate stage uses.

A generations file has one row per prompt with a ``responses`` list (``rlcore generate`` writes one), the
row's ``data_source`` (which selects the reward function) and its ground truth (``reward_model.ground_truth``
as in the pipeline's row schema, or a top-level ``ground_truth``). Importing this module loads no torch.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from rlcore.errors import DataError, InputNotFound
from rlcore.rewards.guard import RewardScorer
from rlcore.rewards.rule import REWARD_FNS


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a parquet file or a JSON-lines file, as plain dicts."""
    path = Path(path)
    if not path.is_file():
        raise InputNotFound(f"{path}: file not found")
    if path.suffix in (".jsonl", ".json"):
        rows = []
        for i, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}: line {i + 1}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: line {i + 1}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
        check_columns(rows, path)
    else:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq

            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowInvalid, OSError) as err:
            raise DataError(f"{path}: not a parquet file ({err}); expected .parquet or .jsonl") from None
    if not rows:
        raise DataError(f"{path}: no rows; expected at least one")
    return rows


def check_columns(rows: list[dict[str, Any]], path: Path) -> None:
    """Each field must have one type across the rows of a JSON-lines file, as a parquet column does."""
    import pyarrow as pa

    for key in dict.fromkeys(k for r in rows for k in r):
        try:
            pa.array([r.get(key) for r in rows])
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            kinds = sorted({type(r[key]).__name__ for r in rows if r.get(key) is not None})
            raise DataError(f"{path}: field {key!r} has different types in different rows ({', '.join(kinds)}); "
                            "use one type per field") from None


def ground_truth_of(row: Mapping[str, Any]) -> Any:
    """``reward_model.ground_truth`` (the pipeline's schema) or a top-level ``ground_truth``."""
    rm = row.get("reward_model")
    if isinstance(rm, Mapping) and rm.get("ground_truth") is not None:
        return rm["ground_truth"]
    return row.get("ground_truth")


def score_records(rows: list[dict], source: str, scorer: RewardScorer) -> list[tuple[str, np.ndarray]]:
    """``(data_source, rewards of the row's responses)`` per row, from the reward function registered for
    the row's ``data_source`` (all responses in one guarded batch: ``scorer``); a row that cannot be scored
    is one line naming it and the field."""
    sources: list[str] = []
    texts: list[str] = []
    truths: list[str] = []
    sizes: list[int] = []
    for i, row in enumerate(rows):
        where = f"{source}: row {i}"
        ds, gt, responses = row.get("data_source"), ground_truth_of(row), row.get("responses")
        if not isinstance(ds, str):
            raise DataError(f"{where}: missing field 'data_source' (selects the reward function)")
        if ds not in REWARD_FNS:
            raise DataError(f"{where}: data_source {ds!r} has no reward function; registered: "
                            f"{', '.join(sorted(REWARD_FNS.names()))}")
        if not isinstance(gt, str):
            raise DataError(f"{where}: missing field 'reward_model.ground_truth' (or 'ground_truth'), a string")
        if not isinstance(responses, (list, tuple, np.ndarray)) or not len(responses):
            raise DataError(f"{where}: field 'responses' should be a non-empty list of strings (from rlcore generate)")
        sources += [ds] * len(responses)
        texts += [str(r) for r in responses]
        truths += [gt] * len(responses)
        sizes.append(len(responses))
    rewards = np.split(scorer.score(sources, texts, truths, what=source), np.cumsum(sizes)[:-1])
    return [(sources[start], r) for start, r in zip(np.cumsum([0] + sizes[:-1]), rewards)]


def summarize(rewards: list[np.ndarray], k: int) -> dict[str, float]:
    """Mean reward, pass@1 and the unbiased pass@k over prompts; a response counts as correct when its
    reward is 1 (the rule rewards' full score)."""
    correct = [int((r >= 1.0).sum()) for r in rewards]
    return {
        "n_prompts": len(rewards),
        "n_responses": int(sum(len(r) for r in rewards)),
        "mean_reward": float(np.mean(np.concatenate(rewards))),
        "pass@1": float(np.mean([pass_at_k(len(r), c, 1) for r, c in zip(rewards, correct)])),
        "pass@k": float(np.mean([pass_at_k(len(r), c, k) for r, c in zip(rewards, correct)])),
    }


def evaluate_generations(path: str | Path, k: int, scorer: RewardScorer | None = None) -> dict[str, Any]:
    """``{"k", "pass@1", "pass@k", "mean_reward", "n_prompts", "n_responses", "reward_errors",
    "reward_timeouts", "by_data_source": {...}}`` for a generations file, scored by ``scorer`` (default:
    a :class:`~rlcore.rewards.guard.RewardScorer` with the default ``reward`` params)."""
    rows = read_records(path)
    scorer = scorer or RewardScorer()
    scored = score_records(rows, str(path), scorer)
    for i, (_, r) in enumerate(scored):
        if len(r) < k:
            raise DataError(f"{path}: row {i}: {len(r)} responses; pass@{k} needs at least k={k} "
                            f"(generate with --n {k} or more, or lower --k)")
    by_source: dict[str, list[np.ndarray]] = defaultdict(list)
    for ds, r in scored:
        by_source[ds].append(r)
    return {"k": k, **summarize([r for _, r in scored], k),
            "reward_errors": scorer.errors, "reward_timeouts": scorer.timeouts,
            "by_data_source": {ds: summarize(rs, k) for ds, rs in sorted(by_source.items())}}
