"""`ray start` nodes for tests, each in a session of its own and killed by session, never by `ray stop` (which would
stop every Ray on the machine): the two-node cluster of tests/test_ray_cluster.py and the single-node head the
end-to-end pipeline's stages join (tests/conftest.py's ``ray_head``)."""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

RAY = str(Path(sys.executable).parent / "ray")


def private_env(**extra: str) -> dict[str, str]:
    """This process's environment for a cluster of a test's own: no ``RAY_ADDRESS`` of another, an auth token of its
    own, no usage reports; ``extra`` on top."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), RAY_USAGE_STATS_ENABLED="0", **extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def session_pids(sid: int) -> list[int]:
    """Every live process of session ``sid`` (a ``ray start`` begun in a session of its own, and all it
    spawned); zombies, already dead, are not counted."""
    pids = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                pids.append(pid)
        except (OSError, psutil.Error):  # gone meanwhile
            pass
    return pids


def command_line(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:  # gone meanwhile
        return []


def kill_session(sid: int, within_s: float = 15.0) -> list[int]:
    """SIGKILL session ``sid`` until none of its processes is left; returns those still there after ``within_s``."""
    deadline = time.monotonic() + within_s
    while (pids := session_pids(sid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.1)
    return session_pids(sid)


class Nodes:
    """The ``ray start`` calls of one cluster, each in a session of its own (recorded before it can fail)."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.sids: dict[str, int] = {}
        self.stopping = threading.Event()
        self.lock = threading.Lock()

    def start(self, name: str, *args: str, tries: int = 3) -> str:
        """``ray start`` of one node. Ray gives a node fixed times to come up (30 s for its raylet to register, which
        waits for the dashboard agent; a deadline for the head's dashboard), Python processes that are slow to
        import on a loaded machine: a node that did not come up is killed and started again, as rlcore's own local
        start does (``rlcore.controller.resource_pool``)."""
        ports = ["--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                 "--metrics-export-port"]
        for attempt in range(1, tries + 1):
            cmd = [RAY, "start", "--disable-usage-stats", *[a for p in ports for a in (p, str(free_port()))], *args]
            with self.lock:  # never a new node once teardown began
                assert not self.stopping.is_set(), "the cluster is being torn down"
                proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
                self.sids[name] = proc.pid
            out, _ = proc.communicate(timeout=90)
            if proc.returncode == 0 or attempt == tries:
                break
            kill_session(proc.pid)  # the try's raylet, GCS and agents: their session is the ray start's
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{out}"
        return out

    def start_head(self, tmp: Path, *args: str) -> str:
        """``ray start --head`` on free ports, its files under ``tmp`` (short: Ray's socket paths live there), and
        ``args``: the address other nodes and drivers join it at."""
        port = free_port()
        out = self.start("head", "--head", "--port", str(port), "--temp-dir", str(tmp), "--ray-client-server-port",
                         str(free_port()), *args)
        ip = re.search(r"ray start --address='([^']+):\d+'", out)
        assert ip, out
        return f"{ip.group(1)}:{port}"

    def kill_all(self) -> dict[str, list[int]]:
        with self.lock:
            self.stopping.set()
        return {name: kill_session(sid) for name, sid in self.sids.items()}
