"""What the openai loop records of one trajectory: every completion the policy sampled for an agent, as the token ids
of its prompt, the ids it sampled and their log-probs, laid out as training rows.

    record = TrajectoryRecord(seed=7, budget=96, prompt_width=160)
    plan = record.plan(keys, tools="[]", observation=obs_ids, new_prompt=render)   # where a request's tokens go
    record.add(plan, tokens, log_probs, message_key, at_eos=True)                  # what the policy sampled

**Rows.** A row is a prompt and a response: the first completion of a row is sampled after the row's prompt; each
later one after everything before it in the row. When a request *extends* a row (its messages are the row's
conversation, the assistant message the endpoint returned last included, followed by new messages, with the same
tools), the new messages are appended to the row as the chat template's tokens between turns
(:class:`~rlcore.agents.template.TurnTemplate`: the template's text after the assistant's end-of-turn token up to the
next generation prompt, mask 0), and the completion after them (mask 1). The history is never re-tokenized: the
engine's prompt for that request is the row's own token ids. A completion that did not end at EOS (cut by
``max_tokens`` or a stop string) gets the EOS the template would show, as a template token (mask 0).

A request that extends no row (the agent edited or dropped history, changed its tools, or started another
conversation) starts a new row whose prompt is its messages through the chat template: those tokens are a prompt
only, never trained, so tokenizing them again drifts nothing. Each row is trained with the trajectory's reward.

**Budget.** A row's response (completions and the template's tokens between them) holds at most ``budget`` tokens
(``task.max_response_length``); a request whose new messages leave no room for one more token in its row, or whose
new row's prompt is longer than ``prompt_width`` tokens, fails the trajectory (kind ``budget``).

**Seeds.** Each request is sampled with its own seed, drawn from the trajectory's seed and the request's content
(its messages and tools, and how many identical requests came before it in the trajectory), so an agent that sends
the same requests gets the same completions whatever the order its requests reach the engine in.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

BUDGET, MAX_TURNS, BAD_REQUEST = "budget", "max_turns", "bad_request"
FAILURE_KINDS = ("raised", "timeout", "exited", "lost", "bad_return", "bad_request", "budget", "max_turns",
                 "no_model_call")
"""Every way a trajectory fails (``agent/failures/<kind>``): from the agent's process (raised, timeout, exited, lost,
bad_return: :mod:`rlcore.agents.agent_pool`), from the endpoint (bad_request, budget, max_turns), or after the run
(no_model_call)."""


def canonical(value: Any) -> str:
    """``value`` as JSON with sorted keys and no spaces: equal values, equal text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def message_key(message: dict[str, Any]) -> str:
    """What makes two chat messages the same message for a chat template: role, text, name, tool call id and tool
    calls (each call's name and arguments as a JSON value: ``"{\\"a\\": 1}"`` and ``'{"a":1}'`` are one call; call
    ids are ignored, as templates that render calls key them by position). A missing or null content is empty."""
    content = message.get("content")
    if isinstance(content, list):  # text parts
        content = "".join(str(p.get("text", "")) for p in content)
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # kept as its text: it matches only the same text
        calls.append([fn.get("name"), args])
    return canonical([message.get("role"), content or "", message.get("name"), message.get("tool_call_id"), calls])


@dataclass
class Row:
    """One training row: ``prompt`` ids, then ``response`` ids with ``mask`` 1 on sampled tokens and ``log_probs``."""

    prompt: list[int]
    tools: str
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    conversation: tuple[str, ...] = ()
    """:func:`message_key` of each message the row's tokens hold, the last returned assistant message last."""
    at_eos: bool = True
    """Whether its last completion ended with the EOS it sampled."""
    completions: int = 0
    last_used: int = 0
    """The request index that last put a completion in it (the most recent row is tried first)."""


@dataclass(frozen=True)
class Plan:
    """Where one request's completion goes: ``row`` to extend (None: a new row with ``prompt`` as its prompt), the
    engine's prompt ``prompt`` (ids), the template tokens ``observation`` appended first, and ``room`` (the most
    tokens the completion may have)."""

    row: Row | None
    prompt: list[int]
    observation: list[int]
    room: int
    messages: int
    """How many messages the request held (the row's conversation after it: those, then the completion's)."""


class BudgetError(Exception):
    """A request that does not fit its row's budget or the prompt width (module docstring)."""


@dataclass
class TrajectoryRecord:
    """Every completion of one trajectory, as rows (module docstring)."""

    seed: int
    budget: int
    prompt_width: int
    eos: int = -1
    """The EOS token id: what a completion that did not end with it gets before the next messages."""
    rows: list[Row] = field(default_factory=list)
    requests: int = 0
    completions: int = 0
    tool_calls: int = 0
    """Tool calls the endpoint returned (completions parsed into ``tool_calls``)."""
    kv_not_kept: int = 0
    """Completions whose keys and values the endpoint had no room to keep (the next request computed its whole
    history)."""
    failure: str | None = None
    failure_text: str = ""
    seen: Counter = field(default_factory=Counter)
    last_text: str = ""
    """The last completion's text, as the model wrote it (its tool calls included): what the reward functions score."""
    last_messages: list[dict[str, Any]] = field(default_factory=list)
    """The last request's messages and the last completion's message: the transcript."""

    def fail(self, kind: str, text: str) -> None:
        """Mark the trajectory failed (the first failure is the one counted)."""
        if self.failure is None:
            self.failure, self.failure_text = kind, text

    def request_seed(self, request: str) -> int:
        """The seed of a request whose content (messages, tools, settings) is ``request`` (module docstring)."""
        k = self.seen[request]
        self.seen[request] += 1
        digest = hashlib.sha256(f"{self.seed}\0{k}\0{request}".encode()).digest()
        return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF

    def extended_row(self, keys: Sequence[str], tools: str) -> Row | None:
        """The row a request of message ``keys`` and ``tools`` extends, the most recently used first; None."""
        for row in sorted(self.rows, key=lambda r: -r.last_used):
            n = len(row.conversation)
            if row.tools == tools and len(keys) > n and tuple(keys[:n]) == row.conversation:
                return row
        return None

    def plan(self, keys: Sequence[str], tools: str, observation: Callable[[int], list[int] | None],
             new_prompt: Callable[[], list[int]]) -> Plan:
        """Where a request goes (module docstring). ``observation(n)``: the template's tokens of the request's
        messages from the ``n``-th on (None when the template cannot give them); ``new_prompt()``: the request's
        messages through the chat template. Raises :class:`BudgetError`."""
        row = self.extended_row(keys, tools)
        if row is not None:
            obs = observation(len(row.conversation))
            if obs is not None:
                obs = ([] if row.at_eos else [self.eos]) + obs
                room = self.budget - len(row.response) - len(obs)
                if room < 1:
                    raise BudgetError(f"the conversation's new messages ({len(obs)} tokens) leave no room in the "
                                      f"trajectory's budget of {self.budget} tokens (task.max_response_length; "
                                      f"{len(row.response)} used)")
                return Plan(row, row.prompt + row.response + obs, obs, room, len(keys))
        prompt = new_prompt()
        if len(prompt) > self.prompt_width:
            raise BudgetError(f"the prompt is {len(prompt)} tokens; a trajectory's rows take prompts of at most "
                              f"{self.prompt_width} (task.max_prompt_length + task.max_response_length)")
        return Plan(None, prompt, [], self.budget, len(keys))

    def add(self, plan: Plan, keys: Sequence[str], tools: str, tokens: list[int], log_probs: list[float],
            message: str, *, at_eos: bool) -> None:
        """Record a completion (``tokens``, their ``log_probs``) sampled for ``plan``; ``keys`` and ``tools`` are its
        request's, ``message`` the :func:`message_key` of the assistant message returned."""
        self.completions += 1
        row = plan.row
        if row is None:
            row = Row(list(plan.prompt), tools)
            self.rows.append(row)
        row.response += plan.observation + tokens
        row.mask += [0] * len(plan.observation) + [1] * len(tokens)
        row.log_probs += [0.0] * len(plan.observation) + list(log_probs)
        row.conversation = (*keys, message)
        row.at_eos, row.completions, row.last_used = at_eos, row.completions + 1, self.completions

    def last_row(self) -> int:
        """The index of the row that holds the last completion (the trajectory's answer)."""
        return max(range(len(self.rows)), key=lambda i: self.rows[i].last_used)
