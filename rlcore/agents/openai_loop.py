"""The openai loop (``rollout.agent.loop: openai``): the user's agent program, written against the OpenAI API, runs
once per sample; the policy answers it from the worker's engine; every completion it got is recorded and trained.

    runtime = EndpointRuntime(spec, tokenizer)                 # once per worker (AgentRunners)
    batch = runtime.batch(engine, part, sampling, generator, device)

One generation call: each row of ``part`` (its ``messages``, ``data_source``, ``ground_truth``, ``extra_info``) is a
trajectory with its own seed (drawn from the call's generator) and its own base URL on the worker's
:class:`~rlcore.agents.endpoint.AgentEndpoint`; the agent processes (:class:`~rlcore.agents.agent_pool.AgentPool`)
run ``run(client, row)`` for all of them at once, and their requests go through the engine together (a whole turn
per engine call, so any engine serves them: static, hf, vllm). When an agent returns, its trajectory's record
(:mod:`rlcore.agents.recording`) becomes the batch's row for it: the row holding its last completion, with the
trajectory's other rows (a conversation it edited or started anew) in ``agent_extra_rows``, which training adds as
rows of their own (:mod:`rlcore.agents.training_rows`).

The row's fields (``[rows, ...]``): ``prompts``/``prompt_mask`` (what the agent sent first, left-padded to the
dataset's prompt width plus the budget: a prompt of its own may be longer than the dataset's), ``responses``,
``response_mask`` (1 on sampled tokens), ``response_attention_mask``, ``rollout_log_probs`` (as sampled), the tool
loop's ``agent_*`` counts and fields (turns = completions, tool calls returned; ``agent_final``: the last
completion's text, ``agent_messages``: the last request's messages and its answer), and ``agent_reward`` (what
the agent returned: a number or None; a failed trajectory's: ``rollout.agent.failure_reward``),
``agent_reward_extras``, ``agent_failure`` (the kind, or ``""``),
``agent_requests``, ``agent_rows``, ``agent_kv_not_kept`` (completions whose keys and values found no room),
``agent_dropped``, and ``agent_extra_rows`` (each other row's ids).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from rlcore.agents.agent_pool import AgentPool, AgentResult
from rlcore.agents.batch import jsonable
from rlcore.agents.endpoint import FILL_WAIT_S, AgentEndpoint, EndpointServer
from rlcore.agents.endpoint_app import agent_app
from rlcore.agents.recording import TrajectoryRecord
from rlcore.agents.spec import EndpointAgentSpec
from rlcore.protocol import Batch
from rlcore.serve.batcher import Sampling


class EndpointRuntime:
    """A worker's agent processes and endpoint for one :class:`EndpointAgentSpec` (module docstring). The endpoint
    serves the engine of the latest call (a new one when the engine object changes)."""

    def __init__(self, spec: EndpointAgentSpec, tokenizer, *, max_batch_rows: int | None = None,
                 fill_wait_s: float = FILL_WAIT_S, prefix_cache_bytes: int | None = None):
        """``max_batch_rows``: requests per engine call (default: a call's trajectories); ``fill_wait_s``: how long
        an idle engine waits for the agents' next requests (:data:`~rlcore.agents.endpoint.FILL_WAIT_S`);
        ``prefix_cache_bytes``: the most the trajectories' kept keys and values take (0: none kept; every request
        computes its whole history; default: the spec's ``kv_cache_mb``)."""
        self.spec, self.tok = spec, tokenizer
        self.max_batch_rows, self.fill_wait_s = max_batch_rows, fill_wait_s
        self.prefix_cache_bytes = spec.kv_cache_mb << 20 if prefix_cache_bytes is None else prefix_cache_bytes
        self.folder = tempfile.mkdtemp(prefix="rlcore-agents-")
        self.socket = str(Path(self.folder) / "endpoint.sock")
        self.pool = AgentPool(spec, self.socket)
        self.server: EndpointServer | None = None
        self.endpoint: AgentEndpoint | None = None
        self.warned: set[str] = set()

    def _serve(self, engine, device: torch.device, max_rows: int) -> EndpointServer:
        if self.server is not None and self.endpoint is not None and self.endpoint.batcher.engine is engine:
            if self.max_batch_rows is None:  # a call with more trajectories than the ones before
                self.endpoint.batcher.max_batch_rows = max(self.endpoint.batcher.max_batch_rows, max_rows)
            return self.server
        self._stop_server()
        config = engine.model.config
        self.endpoint = AgentEndpoint(self.tok, engine, device=device, context_length=config.max_position_embeddings,
                                      vocab_size=config.vocab_size, parser=self.spec.parser,
                                      max_batch_rows=self.max_batch_rows or max_rows, fill_wait_s=self.fill_wait_s,
                                      prefix_cache_bytes=self.prefix_cache_bytes)
        self.server = EndpointServer(agent_app(self.endpoint), self.socket).__enter__()
        return self.server

    def _stop_server(self) -> None:
        if self.server is not None:
            self.server.__exit__(None, None, None)
        self.server = self.endpoint = None
        Path(self.socket).unlink(missing_ok=True)

    def close(self) -> None:
        self.pool.close()
        self._stop_server()
        shutil.rmtree(self.folder, ignore_errors=True)

    def batch(self, engine, part: Batch, sampling, generator: torch.Generator, device: torch.device) -> Batch:
        """Run the agent once per row of ``part``: the module docstring's fields. ``sampling``: how the policy
        samples, ``max_new_tokens`` each row's budget."""
        server = self._serve(engine, device, max_rows=max(len(part), 1))
        endpoint = self.endpoint
        assert endpoint is not None
        seeds = torch.randint(0, 2**31 - 1, (len(part),), generator=generator, device=generator.device).tolist()
        width = part["prompts"].shape[1] + sampling.max_new_tokens
        records = [TrajectoryRecord(seed=s, budget=sampling.max_new_tokens, prompt_width=width) for s in seeds]
        engine_sampling = Sampling(sampling.max_new_tokens, 0.0 if sampling.greedy else sampling.temperature,
                                   sampling.top_p, sampling.top_k)
        tokens = server.call(endpoint.open, records, engine_sampling, self.spec.max_requests)
        finished: dict[int, Any] = {}

        def done(i: int) -> None:  # (a reader thread) the agent is over: its requests in flight end, then its record
            assert server.loop is not None
            finished[i] = asyncio.run_coroutine_threadsafe(endpoint.close_trajectory(tokens[i]), server.loop)

        rows = [jsonable({k: part[k][i] for k in self.spec.row_fields if k in part}) for i in range(len(part))]
        results = self.pool.run([{"id": i, "token": tokens[i], "row": row} for i, row in enumerate(rows)], done)
        records = [finished[i].result() for i in range(len(part))]
        if endpoint.bugs:
            bug, endpoint.bugs = endpoint.bugs[0], []
            raise RuntimeError("the agent endpoint failed while serving the agents") from bug
        self._warn_once(results, records)
        return trajectories_batch(records, results, part, width, sampling.max_new_tokens, self.tok.pad_token_id,
                                  self.spec.failure_reward, drop_failed=self.spec.on_failure == "drop")

    def _warn_once(self, results: list[AgentResult], records: list[TrajectoryRecord]) -> None:
        """Say the first failure of each kind in the worker's log (later ones are only counted)."""
        for result, record in zip(results, records):
            kind, text = failure_of(result, record)
            if kind is not None and kind not in self.warned:
                self.warned.add(kind)
                trace = f"\n{result.trace}" if result.trace and kind == "raised" else ""
                print(f"warning: rollout.agent: a trajectory failed ({kind}): {text}; the next ones of this kind are "
                      f"only counted (agent/failures/{kind}){trace}", file=sys.stderr, flush=True)


def failure_of(result: AgentResult, record: TrajectoryRecord) -> tuple[str | None, str]:
    """A trajectory's failure kind and line: what the endpoint refused first (the agent may have raised because of
    it), else what its process reported, else ``no_model_call`` when it never asked the model."""
    if record.failure is not None:
        return record.failure, record.failure_text
    if result.failure is not None:
        return result.failure, result.text
    if record.completions == 0:
        return "no_model_call", "the agent returned without a completion from the model"
    return None, ""


def _padded(rows: list[list], width: int, pad: Any, *, left: bool, dtype: torch.dtype) -> torch.Tensor:
    """``[len(rows), width]``: each row right-aligned (``left`` padding) or left-aligned, ``pad`` elsewhere."""
    out = torch.full((len(rows), width), pad, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            if left:
                out[i, width - len(r):] = torch.tensor(r, dtype=dtype)
            else:
                out[i, :len(r)] = torch.tensor(r, dtype=dtype)
    return out


def _row_dict(row, pad_id: int) -> dict[str, Any]:
    return {"prompt": list(row.prompt), "response": list(row.response), "mask": list(row.mask),
            "log_probs": list(row.log_probs), "pad": pad_id}


def trajectories_batch(records: list[TrajectoryRecord], results: list[AgentResult], part: Batch, width: int,
                       budget: int, pad_id: int, failure_reward: float = 0.0, drop_failed: bool = False) -> Batch:
    """The generation call's rows (module docstring): each trajectory's last row; a trajectory with no completion
    keeps the dataset's prompt and an empty response. A failed trajectory's ``agent_reward`` is ``failure_reward``;
    with ``drop_failed`` it is ``agent_dropped`` (not trained: :mod:`rlcore.agents.trajectory_rows`)."""
    main, extra = [], []
    for i, record in enumerate(records):
        if record.rows:
            last = record.last_row()
            main.append(_row_dict(record.rows[last], pad_id))
            extra.append([_row_dict(r, pad_id) for j, r in enumerate(record.rows) if j != last])
        else:
            prompt = part["prompts"][i][part["prompt_mask"][i].bool()].tolist()
            main.append({"prompt": prompt, "response": [], "mask": [], "log_probs": []})
            extra.append([])
    failures = [failure_of(res, rec) for res, rec in zip(results, records)]
    prompts = _padded([m["prompt"] for m in main], width, pad_id, left=True, dtype=torch.long)
    counts = {"agent_turns": [r.completions for r in records], "agent_tool_calls": [r.tool_calls for r in records],
              "agent_tool_errors": [0] * len(records), "agent_cut_observations": [0] * len(records),
              "agent_truncated": [int(bool(r.rows) and not r.rows[r.last_row()].at_eos) for r in records],
              "agent_requests": [r.requests for r in records], "agent_rows": [len(r.rows) for r in records],
              "agent_kv_not_kept": [r.kv_not_kept for r in records],
              "agent_failed": [int(k is not None) for k, _ in failures],
              "agent_dropped": [int(k is not None and drop_failed) for k, _ in failures]}
    tensors = {"prompts": prompts, "prompt_mask": _padded([[1] * len(m["prompt"]) for m in main], width, 0, left=True,
                                                          dtype=torch.long),
               "responses": _padded([m["response"] for m in main], budget, pad_id, left=False, dtype=torch.long),
               "response_mask": _padded([m["mask"] for m in main], budget, 0, left=False, dtype=torch.long),
               "response_attention_mask": _padded([[1] * len(m["response"]) for m in main], budget, 0, left=False,
                                                  dtype=torch.long),
               "rollout_log_probs": _padded([m["log_probs"] for m in main], budget, 0.0, left=False,
                                            dtype=torch.float32),
               **{k: torch.tensor(v, dtype=torch.long) for k, v in counts.items()}}
    values = [res.value if k is None else None for res, (k, _) in zip(results, failures)]
    return Batch(tensors, {
        "agent_messages": [_transcript(r.last_messages) for r in records], "agent_final": [r.last_text for r in records],
        "agent_stop": ["answer" if k is None else "failed" for k, _ in failures],
        "agent_errors": [{} if k is None else {k: 1} for k, _ in failures],
        "agent_turn_rewards": [[] for _ in records], "agent_env_reward": [None] * len(records),
        "agent_reward": [_score(v) if k is None else failure_reward for v, (k, _) in zip(values, failures)],
        "agent_reward_extras": [{k: x for k, x in v.items() if k != "score"} if isinstance(v, dict) else {}
                                for v in values],
        "agent_failure": [k or "" for k, _ in failures], "agent_failure_text": [t for _, t in failures],
        "agent_extra_rows": extra})


def _score(value: Any) -> float | None:
    if isinstance(value, dict):
        return float(value["score"])
    return None if value is None else float(value)


def _transcript(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last request's messages and its answer as the viewer and the reward functions read them: role, text
    (an assistant's tool calls written out), and a tool message's name."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content)
        text = content or ""
        for call in m.get("tool_calls") or ():
            fn = call.get("function", {})
            text += f"<tool_call>{json.dumps({'name': fn.get('name'), 'arguments': fn.get('arguments')})}</tool_call>"
        entry = {"role": m.get("role", ""), "content": text}
        if m.get("name"):
            entry["name"] = m["name"]
        out.append(entry)
    return out


