"""Loopback ports for the local stack: pick a free one, tell whether one is free, tell which process
holds one. The stack, its tests and the benchmarks pick ports here, one way for the whole project."""

from __future__ import annotations

import os
import secrets
import socket

from tandem.errors import ConfigError


def free_port(low: int | None = None, high: int | None = None) -> int:
    """A free TCP port on loopback: any (the OS's pick), or a free one in [low, high), searched
    from a random start so that two stacks started together rarely pick the same one (the
    engine's readiness probe tells the rest apart: probes.engine_ready)."""
    if low is None or high is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    start: int = low + secrets.randbelow(high - low)
    ports: list[int] = list(range(start, high)) + list(range(low, start))
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ConfigError(f"no free port between {low} and {high}")


def port_free(port: int) -> bool:
    """Whether nothing listens on loopback's `port` (a bind with SO_REUSEADDR fails only then)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds a listening TCP socket on `port`, from Linux's /proc; None where
    that cannot be told (no /proc)."""
    inodes: set[str] = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                        inodes.add(fields[9])
        fds = os.listdir(f"/proc/{pid}/fd")
    except (OSError, IndexError, ValueError):
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False
