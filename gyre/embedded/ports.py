"""Free TCP ports that stay free: chosen outside the kernel's ephemeral range.

A port is picked before the server that will use it starts (a restarted service must come back at
the address its peers were given, so the launcher fixes every port up front). A port the kernel
handed out by binding port 0 lies in its ephemeral range, the range it also draws the source port
of every outgoing connection from; on a busy machine one of those connections (a database client,
a bus client, a test's own servers) can take the port in the seconds before the server binds it,
and the server then fails with "address already in use" (seen in CI: a rollout service picked
127.0.0.1:38415 and found it taken 10 s later). `free_port` therefore draws from the ports below
and above that range, which the kernel never hands out on its own, and checks that the port can be
bound now. It falls back to binding port 0 only when the ephemeral range leaves no room.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10_000
"""Below this lie the well-known and registered ports of common servers (5432, 8080, ...)."""
HIGHEST_PORT = 65_535
_ATTEMPTS = 64


def ephemeral_port_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's (first, last) ephemeral port, inclusive; Linux's default when it cannot be read."""
    try:
        first, last = (int(x) for x in path.read_text().split()[:2])
    except (OSError, ValueError):
        return 32_768, 60_999
    return first, last


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port(host: str = "127.0.0.1", *, ephemeral: tuple[int, int] | None = None) -> int:
    """A TCP port of `host` that could be bound just now and that the kernel does not hand out as
    an outgoing connection's source port (outside `ephemeral`, default the kernel's range), picked
    at random so that concurrent callers rarely collide. Only when no port outside the range exists
    (or none of 64 tries is free) is it one the kernel picks, as before."""
    first, last = ephemeral if ephemeral is not None else ephemeral_port_range()
    candidates = [(LOWEST_PORT, first - 1), (last + 1, HIGHEST_PORT)]
    spans = [(a, b) for a, b in candidates if b >= a]
    total = sum(b - a + 1 for a, b in spans)
    rng = random.SystemRandom()
    for _ in range(_ATTEMPTS if total else 0):
        k = rng.randrange(total)
        for a, b in spans:
            if k <= b - a:
                port = a + k
                break
            k -= b - a + 1
        if _bindable(host, port):
            return port
    return _kernel_port(host)


__all__ = ["free_port", "ephemeral_port_range"]
