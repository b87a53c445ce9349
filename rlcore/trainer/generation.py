"""The rewards of what a worker group generated: the stage's guarded reward functions and the scoring of a batch
(the reward model's forward on its ranks meanwhile). What scoring, evaluation and PPO rounds share."""

from __future__ import annotations

from rlcore.config import Config
from rlcore.data.collate import decode_responses
from rlcore.protocol import Batch
from rlcore.rewards.scoring import Rewards, RewardScorer, probe, samples_of


def reward_scorer(cfg: Config, rows=None, source: str = "") -> RewardScorer:
    """A stage's guarded reward functions (params.yaml ``reward``): counts their failures, warns about each
    function's first once. With ``rows`` (a DataFrame of the stage's data), each function is first called once
    on the first row, its ground truth as the answer (:func:`~rlcore.rewards.scoring.probe`), so a reward file
    that does not import, a missing function or a wrong return type stops the stage before Ray starts."""
    scorer = RewardScorer.from_config(cfg.reward)
    if rows is not None and len(rows):
        row = rows.iloc[0]
        truth = row["reward_model"]["ground_truth"]
        probe(scorer, samples_of([row["data_source"]], [truth], [truth], [row["extra_info"]])[0],
              where=f"{source}: row 0 (its ground truth as the answer)")
    return scorer


def score_responses(tokenizer, batch: Batch, scorer: RewardScorer, *, what: str, reward_model=None) -> Rewards:
    """Score each response with every reward function and, with ``reward_model`` (a
    :class:`~rlcore.trainer.reward_model.RewardModelGroup`), the reward model, whose forward runs on its ranks
    while the functions run in the scoring processes: :class:`~rlcore.rewards.scoring.Rewards`, whose ``total``
    is the training reward and ``acc`` the accuracy score. A batch where every function fails on every sample
    raises :class:`~rlcore.rewards.guard.RewardError` naming ``what``."""
    model = reward_model.submit(batch) if reward_model is not None else None
    texts = decode_responses(tokenizer, batch["responses"], batch["response_mask"])
    extra = batch["extra_info"] if "extra_info" in batch else None
    return scorer.score(samples_of(batch["data_source"], texts, batch["ground_truth"], extra), what=what, model=model)
