"""The openai loop's trajectories as training rows, and their metrics. Light: torch and numpy.

A generation call gives one row per trajectory (the row holding its last completion; :mod:`rlcore.agents.openai_loop`)
so that scoring, filtering and logging see one sample per trajectory. Before the PPO update,
:func:`training_rows` makes the rows the update trains on:

* each of a trajectory's other rows (``agent_extra_rows``: a conversation its agent edited or started anew) becomes a
  row of its own, right after the trajectory's, with its fields (``uid``: the same group; ``scores``: the same
  reward): a trajectory of ``k`` rows is ``k`` samples of its group, as when each completion is a sample of its own
  (AReaL's "individual" export);
* a failed trajectory with ``rollout.agent.on_failure: drop`` is not trained: its rows' ``response_mask`` is 0 and
  each has a ``uid`` of its own, so it is in no group's baseline either;
* the batch is padded with such empty rows to a multiple of the data-parallel ranks.

Each row's ``agent_row_kind`` says which it is (:data:`MAIN`, :data:`EXTRA`, :data:`PAD`); :func:`main_rows` gives
back one row per trajectory for the step's metrics and logged samples. The update's mini-batches grow with the
rows (``row_scale``), so a step makes as many optimizer steps as without extra rows.
"""

from __future__ import annotations

import numpy as np
import torch

from rlcore.protocol import Batch

MAIN, EXTRA, PAD = 0, 1, 2
SEQUENCE = ("prompts", "prompt_mask", "responses", "response_mask", "response_attention_mask", "rollout_log_probs")


def _left(ids: list, width: int, pad) -> list:
    return [pad] * (width - len(ids)) + list(ids)


def _right(ids: list, width: int, pad) -> list:
    return list(ids) + [pad] * (width - len(ids))


def _extra_rows(batch: Batch, i: int, rows: list[dict]) -> Batch:
    """Row ``i``'s fields for each of ``rows`` (its trajectory's other rows), their own sequences in place."""
    out = batch.select([i] * len(rows))
    width, budget = batch["prompts"].shape[1], batch["responses"].shape[1]
    pad = rows[0]["pad"]
    seq = {"prompts": torch.tensor([_left(r["prompt"], width, pad) for r in rows], dtype=torch.long),
           "prompt_mask": torch.tensor([_left([1] * len(r["prompt"]), width, 0) for r in rows], dtype=torch.long),
           "responses": torch.tensor([_right(r["response"], budget, pad) for r in rows], dtype=torch.long),
           "response_mask": torch.tensor([_right(r["mask"], budget, 0) for r in rows], dtype=torch.long),
           "response_attention_mask": torch.tensor([_right([1] * len(r["response"]), budget, 0) for r in rows],
                                                   dtype=torch.long),
           "rollout_log_probs": torch.tensor([_right(r["log_probs"], budget, 0.0) for r in rows],
                                             dtype=torch.float32)}
    return out.replace(**seq, agent_row_kind=torch.full((len(rows),), EXTRA, dtype=torch.long))


def _untrained(batch: Batch, index: np.ndarray, tag: str, kind: torch.Tensor) -> Batch:
    """``batch`` with the rows at ``index`` out of training: no tokens in the loss, a group of their own."""
    if not len(index):
        return batch
    mask = batch["response_mask"].clone()
    mask[torch.as_tensor(index)] = 0
    uid = np.array(batch["uid"], dtype=object)
    for i in index:
        uid[i] = f"{uid[i]}#{tag}{i}"
    return Batch({**batch.replace(response_mask=mask).tensors, "agent_row_kind": kind},
                 {**batch.non_tensors, "uid": uid})


def training_rows(batch: Batch, ranks: int) -> tuple[Batch, float]:
    """The rows the update trains on (module docstring) and how many there are per row before (``row_scale``).
    A batch of another loop comes back as it is, scale 1."""
    if "agent_extra_rows" not in batch:
        return batch, 1.0
    before = len(batch)
    drop = batch["agent_dropped"].bool().numpy()
    kind = torch.full((before,), MAIN, dtype=torch.long)
    batch = _untrained(batch.replace(agent_row_kind=kind), np.flatnonzero(drop), "dropped", kind)
    parts = []
    for i in range(before):
        parts.append(batch.slice(i, i + 1))
        extra = batch["agent_extra_rows"][i]
        if extra and not drop[i]:
            parts.append(_extra_rows(batch, i, extra))
    rows = Batch.concat(parts)
    pad = -len(rows) % ranks
    if pad:
        filler = rows.select([len(rows) - 1] * pad)
        filler = filler.replace(agent_row_kind=torch.full((pad,), PAD, dtype=torch.long))
        filler = _untrained(filler, np.arange(pad), "pad", filler["agent_row_kind"])
        rows = Batch.concat([rows, filler])
    return rows, len(rows) / before


def main_rows(batch: Batch) -> Batch:
    """One row per trajectory (the rows :func:`training_rows` added left out)."""
    if "agent_row_kind" not in batch:
        return batch
    return batch.select(np.flatnonzero(batch["agent_row_kind"].numpy() == MAIN))


def mini_batch_rows(rows: int, scale: float) -> int:
    """A mini-batch of ``rows`` rows per rank grown by ``scale`` (the extra rows), so the update makes as many
    optimizer steps."""
    return rows if scale == 1.0 else int(np.ceil(rows * scale))


def endpoint_metrics(batch: Batch, kinds: tuple[str, ...]) -> dict[str, float]:
    """The openai loop's per-step metrics (without their prefix): per trajectory, ``turns`` (completions),
    ``requests``, ``tool_calls_per_sample`` (calls the endpoint returned), ``rows_per_trajectory``, ``split`` (the
    share in more than one row), ``truncated`` (the share whose last completion hit ``max_tokens``),
    ``observation_tokens``; ``kv_not_kept`` (completions whose keys and values found no room,
    ``rollout.agent.kv_cache_mb``: the count); ``failures`` (the count) and ``failures/<kind>`` for each of
    ``kinds``, ``failed`` (the share), ``dropped``; ``returned_reward_mean`` (over the trajectories whose agent
    returned a reward)."""
    n = max(len(batch), 1)
    failures = list(batch["agent_failure"])
    observed = (batch["response_attention_mask"] - batch["response_mask"]).sum(-1).float()
    returned = [r for r, f in zip(batch["agent_reward"], failures) if r is not None and not f]
    m = {"turns": batch["agent_turns"].float().mean().item(), "requests": batch["agent_requests"].float().mean().item(),
         "tool_calls_per_sample": batch["agent_tool_calls"].float().mean().item(),
         "rows_per_trajectory": batch["agent_rows"].float().mean().item(),
         "split": float((batch["agent_rows"] > 1).float().mean()),
         "truncated": batch["agent_truncated"].float().mean().item(),
         "observation_tokens": observed.mean().item(),
         "failures": float(sum(bool(f) for f in failures)), "failed": sum(bool(f) for f in failures) / n,
         "dropped": float(batch["agent_dropped"].sum()),
         "kv_not_kept": float(batch["agent_kv_not_kept"].sum()),
         **{f"failures/{k}": float(failures.count(k)) for k in kinds}}
    if returned:
        m["returned_reward_mean"] = float(np.mean(returned))
    return m
