"""Agent programs for tests/agents/test_openai_loop.py: plain Python against the official openai client, as a user
writes them (no rlcore import). The scripted policy (tests/agents/scripted.py ScriptedChatEngine) answers
"call add" with a call of ``add``, a tool result with "5", "malformed" with a call it cannot read, anything else
with "hi"."""

import asyncio
import json
import os
import random
import socket
import time

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


async def react(client, row):
    """Thought, action, observation until the model answers without a call."""
    messages = list(row["messages"])
    for _ in range(4):
        response = await client.chat.completions.create(model="any", messages=messages, tools=[ADD])
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return {"score": float(message.content == "5"), "turns": len(messages)}
        for call in message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    return 0.0


async def edit_history(client, row):
    """A second conversation that keeps only a summary of the first."""
    first = await client.chat.completions.create(model="any", messages=row["messages"])
    summary = [{"role": "user", "content": "summary: " + first.choices[0].message.content}]
    second = await client.chat.completions.create(model="any", messages=summary)
    return 0.5 if second.choices[0].message.content == "hi" else 0.0


async def malformed(client, row):
    """A call the model writes but no one can read comes back as plain content, without tool_calls."""
    response = await client.chat.completions.create(model="any", messages=row["messages"], tools=[ADD])
    message = response.choices[0].message
    return float(message.tool_calls is None and message.content.startswith("<tool_call>")
                 and response.choices[0].finish_reason == "stop")


async def chatty(client, row):
    """Two turns with pauses of random length before each request, and the answer's length as the reward."""
    messages = list(row["messages"])
    for _ in range(2):
        await asyncio.sleep(random.random() * 0.05)
        response = await client.chat.completions.create(model="any", messages=messages, max_tokens=10)
        messages += [response.choices[0].message, {"role": "user", "content": "more"}]
    return float(len(response.choices[0].message.content or ""))


async def misbehave(client, row):
    """What ``row["extra_info"]["behavior"]`` says."""
    behavior = row["extra_info"]["behavior"]
    ask = client.chat.completions.create
    if behavior == "raise":
        raise ValueError("the agent's own bug")
    if behavior == "sleep":
        await asyncio.sleep(3600)
    if behavior == "bad_return":
        return "yes"
    if behavior == "bad_request":
        await ask(model="any", messages=row["messages"], n=2)
    if behavior == "budget":
        await ask(model="any", messages=[{"role": "user", "content": "x" * 600}])
    if behavior == "max_turns":
        for _ in range(10):
            await ask(model="any", messages=row["messages"])
    if behavior == "no_call":
        return 1.0
    if behavior == "network":
        try:
            socket.create_connection(("1.1.1.1", 80), timeout=2).close()
            return 0.0
        except OSError:
            pass  # no network here but the endpoint
    await ask(model="any", messages=row["messages"])
    return 1.0


async def block(client, row):
    """Row 0 holds the loop (time.sleep, no await) past its time limit; the others wait for the model."""
    if row["extra_info"]["index"] == 0:
        time.sleep(3600)
    await asyncio.sleep(0.5)
    await client.chat.completions.create(model="any", messages=row["messages"])
    return 1.0


async def exits(client, row):
    """Row 0 ends its process."""
    if row["extra_info"]["index"] == 0:
        os._exit(1)
    await asyncio.sleep(3600)


def plain(client, row):
    """Not async."""
    return 1.0


async def graded(client, row):
    """One request; a reward and an accuracy of its own, whatever the model wrote."""
    await client.chat.completions.create(model="any", messages=row["messages"], max_tokens=4)
    return {"score": 0.25, "acc": 1.0}
