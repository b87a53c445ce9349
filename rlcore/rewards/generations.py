"""Scoring a generations file (``rlcore eval``) and the unbiased pass@k estimator the evaluate stage uses.

A generations file has one row per prompt with a ``responses`` list (``rlcore generate`` writes one), the
row's ``data_source`` (which selects the built-in rule), its ground truth (``reward_model.ground_truth`` as in
the pipeline's row schema, or a top-level ``ground_truth``) and, optionally, its ``extra_info``. Each response is
scored with params.yaml's reward functions, as the pipeline does, unless an agent program gave its reward
(``agent_rewards``: rollout.agent.loop openai), which stands, as in the pipeline. Importing this module loads no
torch.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from rlcore.data.tables import read_records as read_table
from rlcore.errors import DataError
from rlcore.rewards.agent_rewards import model_subset, with_agent_rewards
from rlcore.rewards.rule import RULES
from rlcore.rewards.scoring import Rewards, RewardScorer, samples_of


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a parquet file or a JSON-lines file, as plain dicts."""
    rows = [record for _, record in read_table(path, what="generations file")]
    if Path(path).suffix == ".jsonl":
        check_columns(rows, Path(path))
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


def score_records(rows: list[dict], source: str, scorer: RewardScorer,
                  reward_model=None) -> list[tuple[str, Rewards]]:
    """``(data_source, Rewards of the row's responses)`` per row, every response scored in one guarded batch
    (``scorer``) and by ``reward_model`` (:class:`~rlcore.engine.reward_model.LocalRewardModel`, which needs each
    row's ``prompt``); a row that cannot be scored is one line naming it and the field."""
    sources: list[str] = []
    texts: list[str] = []
    truths: list[str] = []
    extras: list[dict] = []
    sizes: list[int] = []
    prompts: list[list[dict]] = []
    ended: list[bool] = []
    only_rules = [f.label for f in scorer.functions] == ["rule"] and reward_model is None
    for i, row in enumerate(rows):
        where = f"{source}: row {i}"
        ds, gt, responses = row.get("data_source"), ground_truth_of(row), row.get("responses")
        if not isinstance(ds, str):
            raise DataError(f"{where}: missing field 'data_source' (selects the reward function)")
        if only_rules and ds not in RULES:
            raise DataError(f"{where}: data_source {ds!r} has no built-in rule (those: "
                            f"{', '.join(sorted(RULES.names()))}) and no reward.functions are configured")
        if not isinstance(gt, str):
            raise DataError(f"{where}: missing field 'reward_model.ground_truth' (or 'ground_truth'), a string")
        if not isinstance(responses, (list, tuple, np.ndarray)) or not len(responses):
            raise DataError(f"{where}: field 'responses' should be a non-empty list of strings (from rlcore generate)")
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), Mapping) else {}
        if reward_model is not None:
            if not isinstance(row.get("prompt"), (list, tuple, np.ndarray)):
                raise DataError(f"{where}: missing field 'prompt' (chat messages): reward.model scores the response "
                                "to its prompt")
            reasons = row.get("finish_reasons")
            prompts += [list(row["prompt"])] * len(responses)
            ended += [r != "length" for r in reasons] if isinstance(reasons, (list, tuple, np.ndarray)) and \
                len(reasons) == len(responses) else [True] * len(responses)
        sources += [ds] * len(responses)
        texts += [str(r) for r in responses]
        truths += [gt] * len(responses)
        extras += [extra] * len(responses)
        sizes.append(len(responses))
    model = (lambda: reward_model(prompts, texts, ended)) if reward_model is not None else None
    samples = samples_of(sources, texts, truths, extras)
    agent = agent_columns(rows, sizes)
    if agent is None:
        rewards = scorer.score(samples, what=source, model=model)
    else:  # an agent program's rewards stand (rlcore generate with rollout.agent.loop openai)
        rewards = with_agent_rewards(*agent, lambda index: scorer.score(
            [samples[i] for i in index], what=source, model=model_subset(model, index)),
            {f.label: f.weight for f in scorer.functions})
    starts = np.cumsum([0] + sizes[:-1])
    return [(sources[a], rewards.select(np.arange(a, a + size))) for a, size in zip(starts, sizes)]


def agent_columns(rows: list[dict], sizes: list[int]) -> tuple[list, list, list] | None:
    """Each response's agent reward, failure kind and extras (``agent_rewards``, ``agent_failures``,
    ``agent_reward_extras`` as JSON: what ``rlcore generate`` writes for an agent program), flat; None when the file
    has none."""
    if not rows or "agent_rewards" not in rows[0]:
        return None
    returned, failures, extras = [], [], []
    for row, size in zip(rows, sizes):
        returned += [None if r is None or r != r else float(r) for r in row["agent_rewards"]][:size]
        failures += [str(f or "") for f in row.get("agent_failures", [""] * size)][:size]
        extras += [json.loads(e) if e else {} for e in row.get("agent_reward_extras", [""] * size)][:size]
    return returned, failures, extras


def summarize(rewards: list[Rewards], k: int) -> dict[str, float]:
    """Mean training reward, pass@1 and the unbiased pass@k over prompts (a response is correct when its
    accuracy score is >= 1: the rules' full score), and each reward function's mean."""
    correct = [int((r.acc >= 1.0).sum()) for r in rewards]
    every = Rewards.concat(rewards)
    return {
        "n_prompts": len(rewards),
        "n_responses": len(every),
        "mean_reward": float(every.total.mean()),
        "pass@1": float(np.mean([pass_at_k(len(r), c, 1) for r, c in zip(rewards, correct)])),
        "pass@k": float(np.mean([pass_at_k(len(r), c, k) for r, c in zip(rewards, correct)])),
        **{key.removeprefix("reward/"): value for key, value in every.metrics().items()
           if key.endswith("/mean") and key.count("/") == 2},
    }


def evaluate_generations(path: str | Path, k: int, scorer: RewardScorer | None = None,
                         reward_model=None) -> dict[str, Any]:
    """``{"k", "pass@1", "pass@k", "mean_reward", "n_prompts", "n_responses", "<function>/mean", ...,
    "reward_errors", "reward_timeouts", "by_data_source": {...}}`` for a generations file, scored by ``scorer``
    (default: the built-in rules with the default ``reward`` params) and ``reward_model``."""
    rows = read_records(path)
    scorer = scorer or RewardScorer()
    scored = score_records(rows, str(path), scorer, reward_model)
    for i, (_, r) in enumerate(scored):
        if len(r) < k:
            raise DataError(f"{path}: row {i}: {len(r)} responses; pass@{k} needs at least k={k} "
                            f"(generate with --n {k} or more, or lower --k)")
    by_source: dict[str, list[Rewards]] = defaultdict(list)
    for ds, r in scored:
        by_source[ds].append(r)
    every = Rewards.concat([r for _, r in scored]).metrics()
    return {"k": k, **summarize([r for _, r in scored], k),
            "reward_errors": every["reward/errors"], "reward_timeouts": every["reward/timeouts"],
            "by_data_source": {ds: summarize(rs, k) for ds, rs in sorted(by_source.items())}}
