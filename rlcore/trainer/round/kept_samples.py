"""The samples a round keeps for inspection (``ppo.log_samples``): a few rows of each step's batch as records (the
rollouts file's rows, :mod:`rlcore.viewer`), and the page of all of them logged to MLflow at the end."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from rlcore.agents.batch import transcript
from rlcore.data.collate import decode_responses
from rlcore.engine.sequence import response_attention
from rlcore.protocol import Batch
from rlcore.viewer import rollouts_frame, write_page


def sample_rows(batch: Batch, tokenizer, step: int, k: int, policy_version: int) -> list[dict[str, Any]]:
    """``k`` rows of a step's batch, spread evenly over it (so over its prompts), as records with the columns
    of the rollouts file (:data:`rlcore.viewer.ROLLOUT_COLUMNS`): the prompt's question, the response text,
    the reward (``scores``) and rule reward (``acc``), the mean advantage over the response, its length and
    summed log-prob. ``policy_version`` is the caller's count of policy updates behind the weights that
    generated the batch."""
    if k <= 0 or len(batch) == 0:
        return []
    rows = np.unique(np.linspace(0, len(batch) - 1, min(k, len(batch))).round().astype(int))
    part = batch.select(rows)
    mask = part["response_mask"].float()
    lengths = response_attention(part).sum(-1)
    adv = (part["advantages"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    logp = (part["rollout_log_probs"] * mask).sum(-1)
    agent = "agent_messages" in part
    # a trajectory's text shows every turn, assistant or tool (and rlcore view shows them one by one: turns)
    texts = [transcript(m) for m in part["agent_messages"]] if agent else decode_responses(
        tokenizer, part["responses"], part["response_mask"])
    out = [{"step": step, "policy_version": policy_version, "uid": str(part["uid"][i]),
            "prompt": str(part["question"][i]), "response": texts[i], "ground_truth": str(part["ground_truth"][i]),
            "reward": float(part["scores"][i]), "acc": float(part["acc"][i]), "advantage": float(adv[i]),
            "response_length": int(lengths[i]), "log_prob": float(logp[i])} for i in range(len(rows))]
    if agent:
        for row, messages in zip(out, part["agent_messages"]):
            row["turns"] = json.dumps(list(messages), ensure_ascii=False)
    return out


def log_rollouts_page(tracker, rows: list[dict], title: str) -> None:
    """The kept samples as one HTML page (:func:`rlcore.viewer.render_page`), logged to the run as the artifact
    ``rollouts.html`` (a null tracker drops it); nothing without rows."""
    if not rows:
        return
    with tempfile.TemporaryDirectory() as tmp:
        tracker.log_artifact(write_page(rollouts_frame(rows), Path(tmp) / "rollouts.html", title))
