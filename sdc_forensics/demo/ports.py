"""A rendezvous port for the demo's (and the tests') gloo processes, chosen so that it stays free.

Asking the kernel for port 0, closing the socket and letting rank 0 bind the number later leaves
a window in which another process can take it, and the kernel hands out that very range (the
ephemeral ports, ``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default) to every
outgoing connection, gloo's own among them: on a machine running several multi-process jobs at
once, a demo or a test then fails with "address already in use" once in a while and passes when
rerun. A port drawn at random *below* the ephemeral range is never given to an outgoing
connection, so only another job drawing the same number can collide (about one chance in ten
thousand per pair of concurrent jobs); the port is checked free by binding it before it is
returned. Where the range leaves no room below it, the kernel's choice is the fallback.
"""

from __future__ import annotations

import random
import socket

#: the lowest port drawn (above the well-known and registered services most machines run)
LOWEST = 20000
_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_low() -> int:
    """The first port the kernel hands to outgoing connections (32768 where it cannot be read)."""
    try:
        with open(_RANGE_FILE, encoding="ascii") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(tries: int = 64) -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range (see the module docstring)."""
    high = _ephemeral_low()
    draw = random.SystemRandom()
    if high - LOWEST >= 1000:
        for _ in range(tries):
            port = draw.randrange(LOWEST, high)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
