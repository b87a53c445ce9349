"""The controller's look at ``rollout.agent.tools`` before anything heavy starts: each tool file imports in a tool
process, each function has a schema, an environment stands alone. A stage gets the function schemas for the chat
template (``tools=``), so every stage renders the same prompts the model is trained and evaluated on."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from rlcore.agents import agent_spec
from rlcore.agents.spec import AgentSpec
from rlcore.agents.tools import ToolPool
from rlcore.errors import ConfigError


@cache
def describe_tools(spec: AgentSpec) -> dict:
    """What each of ``spec.tools`` is, from a short-lived tool process (:meth:`ToolPool.describe`)."""
    pool = ToolPool(spec)
    try:
        return pool.describe()
    finally:
        pool.close()


def tool_schemas(agent: Any, root: str | Path = ".") -> list[dict] | None:
    """The OpenAI schemas of the function tools of params.yaml ``rollout.agent`` (an ``AgentConfig``), for the chat
    template's ``tools``; None for the single-turn loop or an environment. Reads only ``loop`` and ``tools`` (what
    the sft stage declares: the tool loop's limits change no schema), describing the tools under the default
    limits. Raises :class:`ConfigError` naming a tool file that is missing, does not import or defines no such
    function, or a function it cannot describe."""
    from rlcore.agents.loop import tool_kinds
    from rlcore.config import AgentConfig

    spec = agent_spec(AgentConfig(loop=agent.loop, tools=list(agent.tools)), root)
    if spec is None:
        return None
    for t in spec.tools:
        if not Path(t.path).is_file():
            raise ConfigError(f"rollout.agent.tools: tool file {t.path} not found")
    try:
        functions, _ = tool_kinds(describe_tools(spec))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return list(functions.values()) or None
