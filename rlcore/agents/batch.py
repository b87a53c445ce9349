"""Tool-loop trajectories as a :class:`~rlcore.protocol.Batch`: what a generation call returns with
``rollout.agent.loop: tool``.

Tensors (``[rows, budget]`` unless said): ``responses`` (the whole trajectory after the prompt: model tokens and
observation tokens), ``response_mask`` (1 on the model's own tokens only: the loss, the KL, the entropy and the
log-prob mismatch read it), ``response_attention_mask`` (1 on every trajectory token: what forwards attend to),
``rollout_log_probs`` (the sampled tokens' log-probs, 0 elsewhere); and per row ``agent_turns``,
``agent_tool_calls``, ``agent_tool_errors``, ``agent_truncated`` (1: the budget or ``max_turns`` cut the trajectory),
``agent_cut_observations`` (observations cut to leave room for the answer: the tool loop's budget rule).
Per-row fields: ``agent_messages`` (the turns after the prompt, ``{"role", "content"}``), ``agent_final`` (the last
assistant turn's text: what the reward functions score), ``agent_stop`` (``answer``, ``max_turns`` or ``budget``),
``agent_errors`` (error kind -> count), ``agent_turn_rewards`` and ``agent_env_reward`` (an environment's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlcore.agents.loop import ANSWER, AgentRuntime
from rlcore.agents.recording import FAILURE_KINDS
from rlcore.agents.tools import ERROR_KINDS
from rlcore.agents.trajectory_rows import endpoint_metrics, main_rows
from rlcore.protocol import Batch

if TYPE_CHECKING:
    from rlcore.rollout.base import RolloutEngine, SamplingParams

ROW_FIELDS = ("data_source", "ground_truth", "extra_info")  # what an environment's reset(row) gets


def jsonable(value: Any) -> Any:
    """``value`` with numpy scalars and arrays (parquet rows hold them) as plain Python values."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def row_infos(batch: Batch) -> list[dict[str, Any]]:
    """Each row's ``data_source``, ``ground_truth`` and ``extra_info`` (those the batch has)."""
    present = [k for k in ROW_FIELDS if k in batch]
    return [{k: jsonable(batch[k][i]) for k in present} for i in range(len(batch))]


def trajectory_batch(runtime: AgentRuntime, engine: RolloutEngine, part: Batch, sampling: SamplingParams,
                     generator: torch.Generator, device: torch.device) -> Batch:
    """Run the tool loop over ``part``'s prompts on ``engine``: the module docstring's fields."""
    out, trajs = runtime.run(engine, part["prompts"].to(device), part["prompt_mask"].to(device), sampling,
                             generator=generator, rows=row_infos(part))
    counts = {"agent_turns": [t.turns for t in trajs], "agent_tool_calls": [t.tool_calls for t in trajs],
              "agent_tool_errors": [sum(t.errors.values()) for t in trajs],
              "agent_truncated": [int(t.stop != ANSWER) for t in trajs],
              "agent_cut_observations": [t.cut_observations for t in trajs]}
    tensors = {"responses": out["responses"].cpu(), "response_mask": out["response_mask"].cpu(),
               "rollout_log_probs": out["log_probs"].cpu(), "response_attention_mask": out["attention"].cpu(),
               **{k: torch.tensor(v, dtype=torch.long) for k, v in counts.items()}}
    return Batch(tensors, {
        "agent_messages": [t.messages for t in trajs], "agent_final": [t.final for t in trajs],
        "agent_stop": [t.stop for t in trajs], "agent_errors": [dict(t.errors) for t in trajs],
        "agent_turn_rewards": [list(t.turn_rewards) for t in trajs], "agent_env_reward": [t.env_reward for t in trajs]})


def transcript(messages) -> str:
    """A trajectory's turns as one text: each turn's role (and tool name) in brackets, then its content."""
    return "\n".join(f"[{m['role']}{' ' + m['name'] if m.get('name') else ''}] {m['content']}" for m in messages)


def agent_metrics(batch: Batch, prefix: str = "agent") -> dict[str, float]:
    """A tool-loop batch's ``{prefix}/tool_calls_per_sample``, ``turns`` (means per sample), ``tool_errors`` (the
    batch's count) and ``tool_errors/<kind>`` for every kind, ``truncated`` (the share of samples cut by the budget or
    max_turns) and ``truncated_budget``/``truncated_max_turns``, ``observation_tokens`` (per sample),
    ``observations_cut`` (per sample: observations cut to leave room for the answer), ``error_observations`` (per
    sample: tool errors the model read as observations, whole or cut), and an
    environment's ``env_reward_mean`` and ``turn_reward_mean`` (its steps' rewards); nothing for a single-turn batch."""
    if "agent_turns" not in batch:
        return {}
    if "agent_failure" in batch:  # the openai loop's trajectories
        return {f"{prefix}/{k}": v for k, v in endpoint_metrics(main_rows(batch), FAILURE_KINDS).items()}
    stops = list(batch["agent_stop"])
    kinds = {k: sum(int(e.get(k, 0)) for e in batch["agent_errors"]) for k in ERROR_KINDS}
    observed = (batch["response_attention_mask"] - batch["response_mask"]).sum(-1).float()
    m = {"tool_calls_per_sample": batch["agent_tool_calls"].float().mean().item(),
         "turns": batch["agent_turns"].float().mean().item(),
         "tool_errors": float(batch["agent_tool_errors"].sum()),
         "truncated": batch["agent_truncated"].float().mean().item(),
         "truncated_budget": stops.count("budget") / max(len(stops), 1),
         "truncated_max_turns": stops.count("max_turns") / max(len(stops), 1),
         "observation_tokens": observed.mean().item(),
         "observations_cut": batch["agent_cut_observations"].float().mean().item(),
         "error_observations": float(np.mean([_errors_read(m) for m in batch["agent_messages"]])),
         **{f"tool_errors/{k}": float(v) for k, v in kinds.items()}}
    env = [r for r in batch["agent_env_reward"] if r is not None]
    if env:
        m["env_reward_mean"] = float(np.mean(env))
    turn_rewards = [x for rs in batch["agent_turn_rewards"] for x in rs]
    if turn_rewards:
        m["turn_reward_mean"] = float(np.mean(turn_rewards))
    return {f"{prefix}/{k}": v for k, v in m.items()}


def _errors_read(messages) -> int:
    """Tool messages of a trajectory (the ones its tokens hold) that report an error."""
    return sum(m["role"] == "tool" and str(m["content"]).startswith("error:") for m in messages)

