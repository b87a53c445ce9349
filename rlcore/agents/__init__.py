"""Multi-turn agents in the rollout: the tool loop (tool-call parsers, tools and environments from files, the sandboxed
tool processes; docs/how-to/tools.md) and the openai loop (your own agent program behind an OpenAI-compatible
endpoint; docs/how-to/openai-agents.md), chosen by ``rollout.agent.loop``.

* :mod:`rlcore.agents.loop`: the tool loop over an engine's turn-by-turn rows (:mod:`rlcore.rollout.turns`);
* :mod:`rlcore.agents.openai_loop`: the openai loop: :mod:`~rlcore.agents.endpoint` (the endpoint and what it
  records), :mod:`~rlcore.agents.agent_pool` and :mod:`~rlcore.agents.agent_process` (where agents run);
* :mod:`rlcore.agents.tools` and :mod:`rlcore.agents.sandbox`: where tools run, and every way a call fails;
* :mod:`rlcore.agents.parsers`: a turn's text -> its calls (``rollout.agent.parser``);
* :mod:`rlcore.agents.template`: the chat template as token ids between turns;
* :mod:`rlcore.agents.schema`: a tool's OpenAI schema from its type hints and docstring.

This package's ``__init__`` stays light (the tool processes import it): the registry of loops only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from rlcore.agents.spec import AgentSpec, EndpointAgentSpec, ToolRef, endpoint_spec, tool_spec
from rlcore.registry import Registry

# rollout.agent.loop -> the generation call's spec (None: one response per prompt, the engines' own generate)
LOOPS: Registry[Callable[..., AgentSpec | EndpointAgentSpec | None]] = Registry("agent loop")
LOOPS.add("single_turn", lambda agent, root=".": None)
LOOPS.add("tool", tool_spec)
LOOPS.add("openai", endpoint_spec)


def agent_spec(agent: Any, root: str | Path = ".") -> AgentSpec | EndpointAgentSpec | None:
    """What params.yaml ``rollout.agent`` asks of every generation call (None: single-turn)."""
    return LOOPS.get(agent.loop)(agent, root)


__all__ = ["LOOPS", "AgentSpec", "EndpointAgentSpec", "ToolRef", "agent_spec"]
