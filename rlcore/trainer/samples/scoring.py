"""The rewards of what a worker group generated: the stage's guarded reward functions and the scoring of a batch
(the reward model's forward on its ranks meanwhile). What scoring, evaluation and PPO rounds share."""

from __future__ import annotations

from rlcore.config import RewardConfig
from rlcore.data.collate import decode_responses
from rlcore.protocol import Batch
from rlcore.rewards.agent_rewards import model_subset, with_agent_rewards
from rlcore.rewards.scoring import Rewards, RewardScorer, probe, samples_of


def reward_scorer(reward: RewardConfig, rows=None, source: str = "") -> RewardScorer:
    """A stage's guarded reward functions (params.yaml ``reward``): counts their failures, warns about each
    function's first once. With ``rows`` (a DataFrame of the stage's data), each function is first called once
    on the first row, its ground truth as the answer (:func:`~rlcore.rewards.scoring.probe`), so a reward file
    that does not import, a missing function or a wrong return type stops the stage before Ray starts."""
    scorer = RewardScorer.from_config(reward)
    if rows is not None and len(rows):
        row = rows.iloc[0]
        truth = row["reward_model"]["ground_truth"]
        probe(scorer, samples_of([row["data_source"]], [truth], [truth], [row["extra_info"]])[0],
              where=f"{source}: row 0 (its ground truth as the answer)")
    return scorer


def score_responses(tokenizer, batch: Batch, scorer: RewardScorer, *, what: str, reward_model=None) -> Rewards:
    """Score each response with every reward function and, with ``reward_model`` (a
    :class:`~rlcore.trainer.samples.reward_model.RewardModelGroup`), the reward model, whose forward runs on its ranks
    while the functions run in the scoring processes: :class:`~rlcore.rewards.scoring.Rewards`, whose ``total``
    is the training reward and ``acc`` the accuracy score. A batch where every function fails on every sample
    raises :class:`~rlcore.rewards.guard.RewardError` naming ``what``."""
    model = reward_model.submit(batch) if reward_model is not None else None
    samples = samples_of(batch["data_source"], response_texts(tokenizer, batch), batch["ground_truth"],
                         reward_extra_info(batch))
    if "agent_reward" not in batch:
        return scorer.score(samples, what=what, model=model)
    # an agent program's rewards (rlcore.rewards.agent_rewards)
    weights = {f.label: f.weight for f in scorer.functions}
    return with_agent_rewards(batch["agent_reward"], batch["agent_failure"], batch["agent_reward_extras"],
                              lambda index: scorer.score([samples[i] for i in index], what=what,
                                                         model=model_subset(model, index)), weights)


def response_texts(tokenizer, batch: Batch) -> list[str]:
    """What the reward functions score as each sample's ``solution_str``: the response text, or for a tool-loop
    trajectory its last assistant turn (``agent_final``; the whole trajectory is in ``extra_info["agent"]``)."""
    if "agent_final" in batch:
        return [str(t) for t in batch["agent_final"]]
    return decode_responses(tokenizer, batch["responses"], batch["response_mask"])


def reward_extra_info(batch: Batch) -> list[dict] | None:
    """Each sample's ``extra_info`` for the reward functions; a tool-loop trajectory's also holds ``agent``: its
    ``messages`` (the turns after the prompt), ``tool_calls``, ``tool_errors``, ``stop`` (answer, max_turns or
    budget), an environment's ``turn_rewards`` and ``env_reward``."""
    extra = batch["extra_info"] if "extra_info" in batch else None
    if "agent_messages" not in batch:
        return extra
    return [{**(dict(extra[i]) if extra is not None and extra[i] is not None else {}),
             "agent": {"messages": batch["agent_messages"][i], "tool_calls": int(batch["agent_tool_calls"][i]),
                       "tool_errors": int(batch["agent_tool_errors"][i]), "stop": batch["agent_stop"][i],
                       "turn_rewards": batch["agent_turn_rewards"][i], "env_reward": batch["agent_env_reward"][i]}}
            for i in range(len(batch))]
