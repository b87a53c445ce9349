"""Tools and environments for the agent tests: well-behaved ones, hostile ones (the issue's: sleep forever, print
10 MB, raise, exit the process) and broken definitions. Each runs in a tool process (rlcore.agents.sandbox)."""

import os
import socket
import time


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def echo(text: str, times: int = 1) -> str:
    """Repeat a text.

    Args:
        text: What to repeat.
        times: How often.
    """
    return text * times


def sleep_forever() -> str:
    """Never return."""
    while True:
        time.sleep(60)


def print_10mb() -> None:
    """Print ten megabytes."""
    print("x" * (10 << 20))


def raise_error(message: str) -> str:
    """Raise.

    Args:
        message: The exception's message.
    """
    raise ValueError(message)


def exit_process() -> str:
    """Leave the process."""
    os._exit(7)


def connect() -> str:
    """Open an internet connection."""
    socket.create_connection(("192.0.2.1", 80), timeout=2)
    return "connected"


def allocate(megabytes: int) -> int:
    """Allocate memory.

    Args:
        megabytes: How much.
    """
    return len(bytearray(megabytes << 20))


def no_hints(a):
    """A tool without type hints."""
    return a


class Counter:
    """Counts the model's turns; the episode ends at its limit, or when the model says "stop"."""

    def reset(self, row):
        self.limit = int(row.get("extra_info", {}).get("limit", 2))
        self.steps, self.truth = 0, row.get("ground_truth")

    def step(self, action):
        self.steps += 1
        if "stop" in action:
            return None
        return f"step {self.steps}", 0.5, self.steps >= self.limit

    def reward(self):
        return float(self.steps) + (10.0 if self.truth == "bonus" else 0.0)


def spawn_and_hang(pid_file: str) -> str:
    """Start a child process, write its pid, then hang.

    Args:
        pid_file: Where the child's pid goes.
    """
    import subprocess

    child = subprocess.Popen(["sleep", "1000"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    while True:
        time.sleep(60)
