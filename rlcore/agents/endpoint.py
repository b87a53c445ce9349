"""The openai loop's endpoint: the policy in a worker's engine behind OpenAI's chat completions API, one base URL per
trajectory, every completion recorded (:mod:`rlcore.agents.recording`).

    endpoint = AgentEndpoint(tokenizer, engine, device=cpu, context_length=128, vocab_size=102, parser="hermes")
    with EndpointServer(agent_app(endpoint), socket) as server:   # uvicorn on a Unix socket, in a thread of its own
        tokens = server.call(endpoint.open, records, sampling, max_requests=4)
        ...                                           # agents POST {base}/t/<token>/v1/chat/completions
        record = server.call(endpoint.close_trajectory, token)

It is :class:`~rlcore.serve.server.ModelServer` (the schema, the chat template, stop strings, tool calls parsed from
the text with ``rollout.agent.parser``, a malformed call left as plain content as vLLM does, the batcher that puts
concurrent requests into one engine call) with these differences:

* **one trajectory per path**: ``/t/<token>/v1/chat/completions``, the token known only to the trajectory's agent;
  ``/v1/...`` without one is 404, so nothing the policy samples goes unrecorded;
* **the policy samples as the generation call says** (``rollout.temperature``, ``top_p``, ``top_k``; greedy in
  validation and evaluation): a request's ``temperature``, ``top_p``, ``top_k`` and ``seed`` are ignored, so the
  recorded log-probs are those of the distribution the trainer trains. ``max_tokens`` (or ``max_completion_tokens``)
  and ``stop`` apply; ``n`` must be 1;
* **each request has its own seed** (:meth:`~rlcore.agents.recording.TrajectoryRecord.request_seed`) and shares
  an engine call with the other agents' requests (the engines' per-row seeds: its tokens do not depend on the call);
* **a request that fails the trajectory**: past ``max_requests`` (kind ``max_turns``), over the budget (``budget``:
  400 ``context_length_exceeded``), or one the API refuses (``bad_request``: a body that does not validate, an
  unsupported field, ``n`` > 1). Later requests of a failed trajectory get 400 too.
* **batches wait for the agents**: when the engine is idle, a call starts once every running agent has a request
  waiting, once none has come in for :data:`QUIET_S`, or :data:`FILL_WAIT_S` after the first (each as long as the
  last engine call took when that is longer: :meth:`~rlcore.serve.batcher.Batcher.patience`), so the agents' turns go
  through the engine together. The engine waits so before every call, not only when no request was waiting: the
  agents whose requests came late for one call (and went through the next one on their own) and those answered by
  that next call join again in one call rather than taking turns at the engine from then on.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import sys
import threading
from collections import Counter
from dataclasses import replace
from typing import Any

import torch

from rlcore.agents.event_loop import new_event_loop
from rlcore.agents.recording import BAD_REQUEST, BUDGET, MAX_TURNS, BudgetError, TrajectoryRecord, canonical, \
    message_key
from rlcore.agents.template import TurnTemplate
from rlcore.serve.batcher import Sampling
from rlcore.serve.http import APIError
from rlcore.serve.schema import ChatRequest
from rlcore.serve.server import ModelServer, ServeOptions, _stops, _usage

FILL_WAIT_S = 1.0
"""The most an idle engine waits for the running agents' next requests before it starts a call without them (or as
long as its last call took, when that is longer)."""
QUIET_S = 0.05
"""An idle engine's wait for the agents' next requests also ends once none has come in for this long (an agent busy
with its own tools does not hold the others up for :data:`FILL_WAIT_S`)."""
MODEL_NAME = "policy"

class Failed(APIError):
    """A request that fails its trajectory (kind ``kind``), answered as an OpenAI error."""

    def __init__(self, kind: str, status: int, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(status, message, code=code, param=param)
        self.kind = kind


class AgentEndpoint(ModelServer):
    """The server behind the agents' base URLs (module docstring)."""

    def __init__(self, tokenizer, engine, *, device: torch.device, context_length: int, vocab_size: int,
                 parser: str = "hermes", max_batch_rows: int = 512, fill_wait_s: float = FILL_WAIT_S,
                 prefix_cache_bytes: int):
        options = ServeOptions(served_model_name=MODEL_NAME, max_batch_size=max_batch_rows,
                               batch_wait_ms=fill_wait_s * 1000, max_n=1, max_tokens=context_length,
                               max_queue=1 << 30, request_timeout_s=1e9)
        super().__init__(tokenizer, engine, device=device, context_length=context_length, vocab_size=vocab_size,
                         default_max_tokens=context_length, options=options, tool_parser=parser)
        self.batcher.context_length, self.batcher.expected_rows = context_length, lambda: len(self.live)
        self.batcher.quiet_s = QUIET_S
        self.records: dict[str, TrajectoryRecord] = {}
        self.live: set[str] = set()  # trajectories whose agent still runs
        self.inflight: Counter = Counter()  # requests being answered, per trajectory
        self.sampling = Sampling(1, 1.0)
        self.max_requests = 1
        self.templates: dict[str, TurnTemplate | None] = {}
        self.bugs: list[BaseException] = []  # what internal_error saw: the caller raises them
        self.id_prefix, self.answered = secrets.token_hex(6), itertools.count()  # completion ids, unique per endpoint
        # each live trajectory's keys and values after its last completion (engines that reuse them: static)
        self.reuse = bool(getattr(engine, "reuses_prefixes", False)) and prefix_cache_bytes > 0
        self.prefix_cap, self.prefix_bytes = prefix_cache_bytes, 0
        self.prefixes: dict[str, Any] = {}
        self.prefix_stats = {"kept": 0, "full": 0}
        """Completions whose keys and values were kept for the trajectory's next request, and those that were not
        for want of room (``prefix_cache_bytes``: the most, on the engine's device, the live trajectories' kept keys
        and values take; ``rollout.agent.kv_cache_mb``)."""

    # -- trajectories (called on the server's loop: EndpointServer.call) -------------------------------------
    async def open(self, records: list[TrajectoryRecord], sampling: Sampling, max_requests: int) -> list[str]:
        """Serve ``records`` (one per trajectory) with ``sampling`` (``max_tokens``: unused); their tokens."""
        self.sampling, self.max_requests = sampling, max_requests
        tokens = []
        for record in records:
            record.eos = self.tokenizer.eos_token_id
            token = secrets.token_hex(12)
            self.records[token] = record
            self.live.add(token)
            tokens.append(token)
        return tokens

    async def close_trajectory(self, token: str, wait_s: float = 30.0) -> TrajectoryRecord:
        """The trajectory's agent is done: once its requests still in flight are answered (at most ``wait_s``),
        its record, which takes no more requests."""
        self.live.discard(token)
        deadline = asyncio.get_running_loop().time() + wait_s
        while self.inflight[token] and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        self.inflight.pop(token, None)
        self._drop_prefix(token)
        return self.records.pop(token)

    def internal_error(self, what: str, err: BaseException | None = None) -> APIError:
        self.bugs.append(err or sys.exc_info()[1] or RuntimeError(what))
        return super().internal_error(what, err)

    # -- requests ------------------------------------------------------------------------------------------
    def record_of(self, token: str) -> TrajectoryRecord:
        record = self.records.get(token)
        if record is None:
            raise APIError(404, "No trajectory at this base URL (its agent run is over)", code="not_found")
        return record

    async def agent_chat(self, token: str, req: ChatRequest) -> dict[str, Any]:
        """Answer a trajectory's chat completion and record it; a request that fails the trajectory marks it."""
        record = self.record_of(token)
        self.inflight[token] += 1
        try:
            if record.failure is not None:
                raise APIError(400, f"This trajectory already failed ({record.failure}: {record.failure_text})",
                               code="trajectory_failed")
            return await self._answer(token, record, req)
        except Failed as err:
            record.fail(err.kind, err.message)
            raise
        except APIError as err:
            if err.status < 500 and err.code != "trajectory_failed":
                record.fail(BAD_REQUEST, err.message)
            raise
        finally:
            self.inflight[token] -= 1

    def check_agent_request(self, req: ChatRequest) -> None:
        """What the endpoint refuses before any work (module docstring): ``n`` > 1, and what rlcore serve refuses
        (unsupported fields, a ``tool_choice`` other than auto or none, bad stop strings); any model name is taken."""
        if (req.n or 1) != 1:
            raise APIError(400, f"n: the agent endpoint records one completion per request; send {req.n} requests "
                                "instead", param="n")
        model, req.model = req.model, None  # any name: the check must not look at it
        try:
            self.check_request(req)
        finally:
            req.model = model

    async def _answer(self, token: str, record: TrajectoryRecord, req: ChatRequest) -> dict[str, Any]:
        self.check_agent_request(req)
        record.requests += 1
        if record.requests > self.max_requests:
            raise Failed(MAX_TURNS, 400, f"This trajectory has made its {self.max_requests} requests "
                                         "(rollout.agent.max_turns)", code="too_many_requests")
        try:
            plan, given, keys, tools = await self.off_loop(self._plan, record, req)
        except BudgetError as err:
            raise Failed(BUDGET, 400, str(err), code="context_length_exceeded", param="messages") from None
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        room = min(plan.room, self.context_length - len(plan.prompt))
        if room < 1:
            raise Failed(BUDGET, 400, f"The conversation ({len(plan.prompt)} tokens) leaves no room in the model's "
                                      f"context of {self.context_length}", code="context_length_exceeded")
        sampling = replace(self.sampling, max_tokens=min(asked or room, room))
        seed = record.request_seed(canonical([keys, tools, asked, req.stop]))
        rows = await self._generate(token, plan.prompt, sampling, seed)
        out = self.finish(rows.tokens[0], rows.log_probs[0], _stops(req))
        message, finish_reason = self.assistant_message(out, bool(req.tools) and req.tool_choice != "none")
        record.add(plan, keys, tools, out.tokens, out.log_probs, message_key(message),
                   at_eos=bool(out.tokens) and out.tokens[-1] == self.tokenizer.eos_token_id)
        record.tool_calls += len(message.get("tool_calls") or ())
        record.last_text = out.text
        record.last_messages = [*given, message]
        choice = {"index": 0, "message": message, "finish_reason": finish_reason,
                  "logprobs": self.chat_logprobs(out) if req.logprobs else None}
        return {"id": f"chatcmpl-{self.id_prefix}{next(self.answered)}", "object": "chat.completion",
                "created": self.created, "model": MODEL_NAME, "choices": [choice], "usage": _usage([plan.prompt], [out])}

    def _plan(self, record: TrajectoryRecord, req: ChatRequest):
        """(In the tokenizing thread.) The request's :class:`~rlcore.agents.recording.Plan`, its messages as dicts,
        their keys and its tools' key."""
        given = [m.model_dump(exclude_none=True) for m in req.messages]
        keys = [message_key(m) for m in given]
        schemas = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else []
        tools = canonical(schemas)
        rendered = self.chat_messages(req)

        def observation(start: int) -> list[int] | None:
            template = self._template(tools, schemas)
            if template is None:
                return None
            try:
                return template.observations_ids([rendered[start:]])[0]
            except ValueError:  # the template renders earlier turns differently once more follow
                return None

        return record.plan(keys, tools, observation, lambda: self.chat_prompt(req)), given, keys, tools

    def _template(self, key: str, schemas: list[dict]) -> TurnTemplate | None:
        """The chat template as token ids between turns, with these tools (None: it cannot give them)."""
        if key not in self.templates:
            try:
                self.templates[key] = TurnTemplate(self.tokenizer, tools=schemas or None)
            except ValueError:
                self.templates[key] = None
        return self.templates[key]

    async def _generate(self, token: str, prompt: list[int], sampling: Sampling, seed: int):
        """The engine's answer to a trajectory's request. With an engine that reuses prefixes, the request continues
        from the keys and values the trajectory's last completion left (as far as the prompt repeats its tokens: the
        usual request extends the last answer) and leaves its own for the next."""
        prefix = self._drop_prefix(token) if self.reuse else None
        try:
            if not self.reuse:
                return await self.batcher.generate([prompt], sampling, row_seeds=[seed])
            rows = await self.batcher.generate([prompt], sampling, row_seeds=[seed], prefixes=[prefix],
                                               keep_prefixes=True)
        except Exception:  # noqa: BLE001 - an engine failure: a 500 here, raised by the generation call after
            raise self.internal_error("generation failed") from None
        kept = rows.prefixes[0] if rows.prefixes else None
        if kept is not None and token in self.live:
            if self.prefix_bytes + kept.nbytes <= self.prefix_cap:
                self.prefixes[token] = kept
                self.prefix_bytes += kept.nbytes
                self.prefix_stats["kept"] += 1
            else:
                self.prefix_stats["full"] += 1
                self.records[token].kv_not_kept += 1
        return rows

    def _drop_prefix(self, token: str):
        """The trajectory's kept keys and values, no longer counted (None if it has none)."""
        prefix = self.prefixes.pop(token, None)
        if prefix is not None:
            self.prefix_bytes -= prefix.nbytes
        return prefix


class EndpointServer:
    """An ASGI app (:func:`rlcore.agents.endpoint_app.agent_app`) served by uvicorn on a Unix socket in a thread of its
    own, with its own event loop (a context manager: started on entry, stopped on exit)."""

    def __init__(self, app, socket_path: str):
        self.app, self.socket_path = app, socket_path
        self.server = None
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> EndpointServer:
        import uvicorn  # only in a process that serves agents

        config = uvicorn.Config(self.app, uds=self.socket_path, log_level="warning", lifespan="on",
                                timeout_keep_alive=600, limit_concurrency=None, backlog=4096,
                                proxy_headers=False)  # a Unix socket the agent processes reach directly
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._serve, name="rlcore-agent-endpoint", daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the agent endpoint did not start (its log has the error)")
            self.thread.join(0.01)
        return self

    def _serve(self) -> None:
        self.loop = new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def call(self, fn, *args: Any, timeout: float | None = None, **kwargs: Any):
        """``await fn(*args, **kwargs)`` on the server's loop, from another thread; its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(fn(*args, **kwargs), self.loop).result(timeout)

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)
