"""The tool loop (``rollout.agent.loop: tool``): model turn, parse the calls, run the tools, append the observation,
next turn, for every row at its own pace.

    runtime = AgentRuntime(spec, tokenizer)            # tool processes, parser, chat template (once per worker)
    out = runtime.run(engine, prompts, prompt_mask, sampling, generator=g, rows=row_infos)

Each row's trajectory lives in one set of response columns (:class:`~rlcore.rollout.turns.Trajectories`): the
model's sampled tokens with their log-probs (``response_mask`` 1), the observation tokens from the chat template
(mask 0), all of them attended to. Nothing is re-tokenized: a turn's text is decoded only to find its calls.

A row stops when:

* its turn calls no tool (tools), or the environment says the episode is over (an environment): the answer;
* the turn that used the last of ``max_turns`` still calls a tool (or the environment goes on): truncated;
* its tokens run out: the budget (``task.max_response_length``, model and observation tokens together) ends
  inside a turn, or not even the chat template's part of the next observation fits with ``min_answer_tokens`` left
  after it: truncated.

The budget rule for observations: an observation that would leave fewer than ``min_answer_tokens`` of the budget
for the model's next turn is cut to fit, each tool message's text to the same number of characters and ``...``
(the longest prefix that fits; ``agent/observations_cut`` counts them), so the model always reads the start of what
its tools said, an error included, and has room to answer.

Tools run in the worker's tool processes (:class:`~rlcore.agents.tools.ToolPool`) while the other rows keep
decoding; the engine only waits for tools when no row has anything to decode (for the first result, then up to as
long again for the others, so that results that come in together start their rows' next turns together). A malformed call, an unknown tool and
every failure of a call are error observations the model reads, counted per kind (``agent/tool_errors``).

With an environment (a class in ``rollout.agent.tools``: ``reset(row)``, ``step(action) -> observation`` or
``(observation, reward, done)``, ``reward() -> float``), each row gets its own instance, reset with the row
(``data_source``, ``ground_truth``, ``extra_info``); the model's whole turn text is the action, the observation
comes back as a user message, and the final ``reward()`` plus the per-step rewards go to the reward functions in
``extra_info`` (``env_reward``, ``turn_rewards``).
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from rlcore.agents.parsers import PARSERS, ToolCall
from rlcore.agents.spec import AgentSpec
from rlcore.agents.template import TurnTemplate
from rlcore.agents.tools import ToolPool, ToolResult

if TYPE_CHECKING:  # (types only: the loop runs on whatever engine a worker built)
    from rlcore.rollout.base import RolloutEngine, SamplingParams

ANSWER, MAX_TURNS, BUDGET = "answer", "max_turns", "budget"  # why a trajectory stopped


@dataclass
class Trajectory:
    """One row's turns after the prompt and its counts."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    """``{"role": "assistant" | "tool" | "user", "content"}`` in order (tool messages carry ``name``): the turns
    the trajectory's tokens hold (an observation that did not fit, or an environment's last, is not among them)."""
    tool_calls: int = 0
    """Calls the loop answered (errors included)."""
    errors: Counter = field(default_factory=Counter)
    stop: str = ""
    cut_observations: int = 0
    """Observations cut to leave room for the answer (the budget rule, module docstring)."""
    turn_rewards: list[float] = field(default_factory=list)
    env_reward: float | None = None
    waiting: list[tuple[ToolCall | None, Future]] = field(default_factory=list)

    @property
    def turns(self) -> int:
        return sum(m["role"] == "assistant" for m in self.messages)

    @property
    def final(self) -> str:
        """The last assistant turn's text: what the reward functions score."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")


def tool_kinds(described: dict) -> tuple[dict[str, dict], str | None]:
    """The function tools' schemas by name and the environment's name (or None), from a tool process's
    ``describe``; ValueError naming each tool that does not load or cannot be described, or a mix of an environment
    with other entries."""
    kinds = described["tools"]
    broken = {**described["broken"], **{n: d["message"] for n, d in kinds.items() if d["kind"] == "error"}}
    if broken:
        raise ValueError("rollout.agent.tools: " + "; ".join(broken.values()))
    functions = {n: d["schema"] for n, d in kinds.items() if d["kind"] == "function"}
    envs = [n for n, d in kinds.items() if d["kind"] == "environment"]
    if len(envs) > 1 or (envs and functions):
        raise ValueError(f"rollout.agent.tools: an environment (a class) must be the only entry, got {', '.join(kinds)}")
    return functions, envs[0] if envs else None


def _done(result: ToolResult) -> Future:
    f: Future = Future()
    f.set_result(result)
    return f


class AgentRuntime:
    """A worker's tool processes, parser and chat template for one :class:`AgentSpec` (module docstring)."""

    def __init__(self, spec: AgentSpec, tokenizer):
        self.spec, self.tok = spec, tokenizer
        self.parse = PARSERS.get(spec.parser).parse
        self.pool = ToolPool(spec, start=True)
        try:
            self.functions, self.environment = tool_kinds(self.pool.describe())
        except BaseException:
            self.pool.close()
            raise
        self.template = TurnTemplate(tokenizer, tools=list(self.functions.values()) or None)

    def close(self) -> None:
        self.pool.close()

    def run(self, engine: RolloutEngine, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            params: SamplingParams, *, generator: torch.Generator | None = None, rows: Sequence[dict] | None = None
            ) -> tuple[dict[str, torch.Tensor], list[Trajectory]]:
        """Every row's trajectory (module docstring): the tensors of :meth:`Trajectories.result` and each row's
        :class:`Trajectory`. ``rows``: each row's ``data_source``, ``ground_truth`` and ``extra_info`` (what an
        environment's ``reset`` gets)."""
        t = engine.open_rows(input_ids, attention_mask, params, budget=params.max_new_tokens, generator=generator,
                             deterministic=self.spec.deterministic)
        trajs = [Trajectory() for _ in range(len(t))]
        waiting: set[int] = set()  # rows whose calls are out
        if self.environment is not None:  # every row's own instance, before its first turn
            resets = self.pool.environments("reset", [(r, {"name": self.environment, "row": rows[r] if rows else {}})
                                                      for r in range(len(t))])
            for traj, reset in zip(trajs, resets):
                traj.waiting.append((None, reset))
            self._collect(t, trajs, set(range(len(t))), block=True, resets=True)
        while t.active():
            ended = t.step()
            if ended:
                waiting.update(self._end_turns(t, ended, trajs))
            self._collect(t, trajs, waiting, block=not t.running())
        if self.environment is not None:
            self._env_rewards(trajs)
        return t.result(), trajs

    # ------------------------------------------------------------------------------------------------- turns
    def _end_turns(self, t, rows: list[int], trajs: list[Trajectory]) -> list[int]:
        """``rows``' turns ended: record them, then stop each row or start its tools (all the turns' calls queued
        at once); the rows now waiting for tools."""
        steps: list[tuple[int, dict]] = []  # an environment's (row, step request)
        calls: list[tuple[Trajectory, int, ToolCall]] = []  # (trajectory, index in its waiting, call) for the pool
        for r, tokens in zip(rows, t.turns(rows)):
            traj = trajs[r]
            at_eos = bool(tokens) and tokens[-1] == t.eos
            text = self.tok.decode(tokens[:-1] if at_eos else tokens, skip_special_tokens=False)
            traj.messages.append({"role": "assistant", "content": text})
            if not at_eos:
                self._stop(t, r, traj, BUDGET)
            elif self.environment is not None:
                if traj.turns >= self.spec.max_turns:
                    self._stop(t, r, traj, MAX_TURNS)
                else:
                    steps.append((r, {"action": text}))
            elif not (parsed := self.parse(text).calls):
                self._stop(t, r, traj, ANSWER)
            elif traj.turns >= self.spec.max_turns:
                self._stop(t, r, traj, MAX_TURNS)
            else:
                for call in parsed:
                    answer = self._answer_at_once(call)
                    if answer is None:
                        calls.append((traj, len(traj.waiting), call))
                        answer = Future()  # a place held for the pool's future (below)
                    traj.waiting.append((call, answer))
        for (r, _), f in zip(steps, self.pool.environments("step", steps)):
            trajs[r].waiting.append((None, f))
        for (traj, i, call), f in zip(calls, self.pool.calls([(c.name, c.arguments) for _, _, c in calls])):
            traj.waiting[i] = (call, f)
        return [r for r in rows if trajs[r].waiting]

    def _answer_at_once(self, call: ToolCall) -> Future | None:
        """The error observation of a call that goes to no tool (malformed, unknown); None for a call to run."""
        if call.error:
            return _done(ToolResult(f"error: malformed tool call: {call.error}", "malformed"))
        if call.name not in self.functions:
            known = ", ".join(sorted(self.functions)) or "none"
            return _done(ToolResult(f"error: unknown tool {call.name!r} (tools: {known})", "unknown_tool"))
        return None

    def _collect(self, t, trajs: list[Trajectory], waiting: set[int], *, block: bool, resets: bool = False) -> None:
        """Hand every row of ``waiting`` whose calls have all returned its observation (and take it out of
        ``waiting``); with ``block``, first wait until one call returns (no row has anything to decode)."""
        if not waiting:
            return
        if block:
            pending = [f for r in waiting for _, f in trajs[r].waiting if not f.done()]
            if resets and pending:
                wait(pending, return_when=ALL_COMPLETED)
            elif pending:  # the first result, then up to as long again for the others: a turn's results that come
                start = time.monotonic()  # in together start the rows' next turns in the same steps
                _, left = wait(pending, return_when=FIRST_COMPLETED)
                if left:
                    wait(left, timeout=time.monotonic() - start)
        ready = [r for r in sorted(waiting) if all(f.done() for _, f in trajs[r].waiting)]
        waiting.difference_update(ready)
        results = {}
        for r in ready:
            traj = trajs[r]
            results[r] = [(call, f.result()) for call, f in traj.waiting]
            traj.waiting = []
            if resets:
                traj.errors.update(res.error for _, res in results[r] if res.error)
        if not resets:
            self._observe(t, trajs, results)

    def _observe(self, t, trajs: list[Trajectory], results: dict[int, list[tuple[ToolCall | None, ToolResult]]]
                 ) -> None:
        """Each row's results as its observation, appended (all rows' tokenized in one call), or the row's end."""
        rows, observations = [], []
        for r, row_results in results.items():
            traj, messages = trajs[r], []
            for call, res in row_results:
                if res.error:
                    traj.errors[res.error] += 1
                if res.reward is not None:
                    traj.turn_rewards.append(res.reward)
                if call is None:  # an environment's step
                    messages.append({"role": "user", "content": res.text})
                else:
                    traj.tool_calls += 1
                    messages.append({"role": "tool", "name": call.name, "content": res.text})
            if self.environment is not None and row_results[0][1].done:
                self._stop(t, r, traj, ANSWER)
            else:
                rows.append(r)
                observations.append(messages)
        fits = []
        for r, messages, ids in zip(rows, observations, self.template.observations_ids(observations)):
            room = t.room(r) - max(self.spec.min_answer_tokens, 1)  # what the observation may take
            if len(ids) > room:
                messages, ids = self._cut(messages, room)
                trajs[r].cut_observations += ids is not None
            if ids is None:  # not even the template's part of it fits
                self._stop(t, r, trajs[r], BUDGET)
            else:
                trajs[r].messages.extend(messages)  # the turns the trajectory's tokens hold
                fits.append((r, ids))
        t.append_many([r for r, _ in fits], [ids for _, ids in fits])

    def _cut(self, messages: list[dict[str, Any]], room: int) -> tuple[list[dict[str, Any]], list[int] | None]:
        """``messages`` with each text cut to the most characters (the same number for all, ``...`` marking a cut)
        whose observation takes at most ``room`` tokens, and its tokens; ``(messages, None)`` if not even the
        template's part of it (empty texts) fits."""
        def cut_to(n: int) -> list[dict[str, Any]]:
            return [{**m, "content": m["content"] if len(m["content"]) <= n else m["content"][:n] + "..."}
                    for m in messages]

        def tokens(candidate: list[dict[str, Any]]) -> list[int]:
            return self.template.observations_ids([candidate])[0]

        low, high = 0, max(len(m["content"]) for m in messages)  # cut_to(high) is the whole observation
        if len(tokens(cut_to(0))) > room:  # not even "..." fits: the template's part alone, or nothing
            empty = [{**m, "content": ""} for m in messages]
            ids = tokens(empty)
            return (empty, ids) if len(ids) <= room else (messages, None)
        while low < high:  # the largest n whose observation fits (fewer characters never take more tokens)
            mid = (low + high + 1) // 2
            if len(tokens(cut_to(mid))) <= room:
                low = mid
            else:
                high = mid - 1
        best = cut_to(low)
        return best, tokens(best)

    def _stop(self, t, r: int, traj: Trajectory, why: str) -> None:
        traj.stop = why
        t.finish(r)

    def _env_rewards(self, trajs: list[Trajectory]) -> None:
        futures = self.pool.environments("reward", [(r, {}) for r in range(len(trajs))])
        for traj, f in zip(trajs, futures):
            res = f.result()
            if res.error:
                traj.errors[res.error] += 1
            traj.env_reward = res.reward
