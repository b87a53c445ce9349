"""The event loop of the agent endpoint's thread and of the agent processes: uvloop's where it is installed (a
dependency of rlcore: each of the thousands of requests a step costs less of those processes' time), asyncio's
otherwise."""

from __future__ import annotations

import asyncio


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop  # here, not at the top: asyncio's loop where uvloop is not installed (a dependency, yet optional)
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
