"""What a generation call needs to run an agent loop (params.yaml ``rollout.agent``), as frozen values a worker
method can take: the tool loop's :class:`AgentSpec`, the openai loop's :class:`EndpointAgentSpec`. Light: no
torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ToolRef:
    """One entry of ``rollout.agent.tools``: an object of a Python file, a function (a tool) or a class (an
    environment)."""

    path: str
    """The file, absolute (workers on other nodes and other working directories read the same path)."""
    name: str

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "name": self.name}


@dataclass(frozen=True)
class AgentSpec:
    """The tool loop of a generation call (``rollout.agent``, loop ``tool``)."""

    tools: tuple[ToolRef, ...]
    parser: str = "hermes"
    """``rlcore.agents.parsers.PARSERS`` name."""
    max_turns: int = 4
    """Model turns per trajectory; a trajectory whose last allowed turn still calls a tool is truncated."""
    max_tool_response_chars: int = 1024
    """A tool's output longer than this is cut to it, marked, and counted as an error (``oversized``)."""
    min_answer_tokens: int = 8
    """Tokens of the budget an observation leaves for the model's next turn: an observation that would leave fewer
    is cut to fit (``rlcore.agents.loop``), so the model reads what the tool said, an error included."""
    timeout_s: float = 10.0
    """Per tool call (and environment step): past it, the tool process is killed and the call is an error."""
    memory_mb: int = 1024
    """Address-space limit of each tool process (0 = none)."""
    processes: int = 2
    """Tool processes per generating worker: calls of different rows run in parallel."""
    deterministic: bool = False
    """Rows' numbers independent of when tools answer (``rlcore.rollout.turns``): runs repeat exactly."""
    row_fields = ("data_source", "ground_truth", "extra_info")
    """What a generation call ships of each row besides its prompt tensors (an environment's ``reset(row)``)."""
    sets_prompts = False
    """Whether the call's rows come back with prompts of their own (the loop keeps the dataset's)."""

    def key(self) -> tuple[Any, ...]:
        """What a worker's tool processes depend on (a new key: new processes)."""
        return (self.tools, self.timeout_s, self.memory_mb, self.processes)


def tool_spec(agent: Any, root: str | Path = ".") -> AgentSpec:
    """The spec of params.yaml ``rollout.agent`` (an ``AgentConfig``) with loop ``tool``, tool paths made absolute
    against ``root``."""
    tools = tuple(ToolRef(str((Path(root) / t.path).resolve()), t.name) for t in agent.tools)
    return AgentSpec(tools=tools, parser=agent.parser, max_turns=agent.max_turns,
                     max_tool_response_chars=agent.max_tool_response_chars,
                     min_answer_tokens=agent.min_answer_tokens, timeout_s=agent.timeout_s,
                     memory_mb=agent.memory_mb, processes=agent.processes, deterministic=agent.deterministic)


@dataclass(frozen=True)
class EndpointAgentSpec:
    """The openai loop of a generation call (``rollout.agent``, loop ``openai``): the user's agent program, run in
    guarded processes against an OpenAI-compatible endpoint over the worker's engine (:mod:`rlcore.agents.openai_loop`).
    """

    agent: ToolRef
    """The agent function (``async def run(client, row)``) and its file, absolute."""
    parser: str = "hermes"
    """``rlcore.agents.parsers.PARSERS`` name: how tool calls are read from a completion's text."""
    max_requests: int = 4
    """Requests to the model per trajectory (``rollout.agent.max_turns``); one more is refused and fails it."""
    timeout_s: float = 300.0
    """Seconds per trajectory (``rollout.agent.agent_timeout_s``)."""
    memory_mb: int = 1024
    """Address-space limit of each agent process (0 = none)."""
    processes: int = 2
    """Agent processes per generating worker."""
    on_failure: str = "reward"
    """``reward``: a failed trajectory is trained with ``failure_reward``; ``drop``: not trained."""
    failure_reward: float = 0.0
    kv_cache_mb: int = 1024
    """The most the trajectories' kept keys and values take, per worker (``rollout.agent.kv_cache_mb``)."""
    row_fields = ("data_source", "ground_truth", "extra_info", "messages")
    """What a generation call ships of each row: what the agent's ``row`` holds (``messages``: the prompt's)."""
    sets_prompts = True
    """The call's rows come back with the prompts the agent sent (its first request's), not the dataset's."""

    def key(self) -> tuple[Any, ...]:
        """What a worker's agent processes depend on (a new key: new processes)."""
        return (self.agent, self.memory_mb, self.processes)


def endpoint_spec(agent: Any, root: str | Path = ".") -> EndpointAgentSpec:
    """The spec of params.yaml ``rollout.agent`` (an ``AgentConfig``) with loop ``openai``, the agent's path made
    absolute against ``root``."""
    (entry,) = agent.agents
    return EndpointAgentSpec(agent=ToolRef(str((Path(root) / entry.path).resolve()), entry.name), parser=agent.parser,
                             max_requests=agent.max_turns, timeout_s=agent.agent_timeout_s, memory_mb=agent.memory_mb,
                             processes=agent.processes, on_failure=agent.on_failure,
                             failure_reward=agent.failure_reward, kv_cache_mb=agent.kv_cache_mb)
