"""The controller's look at ``rollout.agent`` before anything heavy starts: each tool file imports in a tool
process, each function has a schema, an environment stands alone (a stage gets the function schemas for the chat
template, ``tools=``, so every stage renders the same prompts the model is trained and evaluated on); the openai
loop's agent file imports and defines its agent function (:func:`check_agent_program`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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

    if agent.loop != "tool":
        return None
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


_LOAD = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); sys.dont_write_bytecode = True\n"
         "try:\n    from rlcore.agents.agent_process import load_agent\nexcept ImportError as err:\n"
         "    print(f'the agent processes cannot start: {err} (the openai package is a dependency of rlcore)')\n"
         "    raise SystemExit(1)\n"
         "try:\n    load_agent(sys.argv[2], sys.argv[3])\nexcept ValueError as err:\n"
         "    print(err); raise SystemExit(1)\n"
         "except BaseException as err:\n"
         "    print(f'agent file {sys.argv[2]}: importing it raised {type(err).__name__}: {err}'); raise SystemExit(1)\n")


def check_agent_program(agent: Any, root: str | Path = ".", timeout_s: float = 120.0) -> None:
    """For params.yaml ``rollout.agent`` with loop ``openai``: the agent file exists, imports (in a short-lived
    process of its own, as the agent processes will import it: no bytecode written beside it) and defines the agent
    function with its signature, ``async def run(client, row)``. Raises :class:`ConfigError` in one line otherwise:
    before Ray starts. Nothing for the other loops."""
    if agent.loop != "openai":
        return
    (entry,) = agent.agents
    path = Path(root) / entry.path
    if not path.is_file():
        raise ConfigError(f"rollout.agent.agents[0].path: agent file {entry.path} not found")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        done = subprocess.run([sys.executable, "-c", _LOAD, json.dumps(sys.path), str(path.resolve()), entry.name],
                              capture_output=True, text=True, timeout=timeout_s, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"rollout.agent.agents[0]: importing agent file {entry.path} took more than "
                          f"{timeout_s:g} s") from None
    if done.returncode:
        lines = (done.stdout.strip() or done.stderr.strip() or f"exit code {done.returncode}").splitlines()
        raise ConfigError(f"rollout.agent.agents[0]: {lines[-1]}")
