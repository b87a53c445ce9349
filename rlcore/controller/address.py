"""Where ``ray.address`` points and whether anything answers there: plain sockets, no Ray, so that a stage finds a
cluster that is not there before its heavy imports (:func:`rlcore.stage.frame.stage_config`)."""

from __future__ import annotations

import os
import socket

from rlcore.errors import ConfigError

# ray.init to an address where nothing listens retries for minutes; a TCP connect answers in this many seconds.
REACH_TIMEOUT_S = 5.0


def host_port(address: str) -> tuple[str, int] | None:
    """``host:port`` or ``ray://host:port`` -> (host, port); None for what does not parse (``local``, ``auto``)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def unreachable(address: str, timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """Why nothing answers at ``address`` (``nothing answers at host:port (reason)``), or None: something listens
    there, or the address is not a host and port."""
    hp = host_port(address)
    if hp is None:
        return None
    try:
        socket.create_connection(hp, timeout=timeout_s).close()
    except OSError as err:
        return f"nothing answers at {hp[0]}:{hp[1]} ({err.strerror or err})"
    return None


def check_reachable(address: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Fail in seconds, naming ``ray.address``, when nothing listens where it (or, for ``auto``, the
    ``RAY_ADDRESS`` variable) points; an address that does not parse is left to Ray."""
    target = (os.environ.get("RAY_ADDRESS") or address) if address == "auto" else address
    if why := unreachable(target, timeout_s):
        port = host_port(target)[1]  # type: ignore[index]  # parsed, or nothing would be unreachable
        raise ConfigError(f"ray.address {address!r}: {why}; start the head node there (ray start --head --port "
                          f"{port}) or set ray.address: local")
