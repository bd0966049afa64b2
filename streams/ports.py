"""TCP ports on this host: one that is free now, and whether one accepts connections.

Used by whatever starts a listener without a fixed port (a local broker, a DDP rank 0's
store, a test's server) and by whatever waits for one to come up.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago: the one the kernel gives a
    socket bound to port 0. Another process may take it before the caller listens on it,
    which callers that retry on ``EADDRINUSE`` (or tests) accept.

    Raises:
        OSError: ``host`` is not an address of this machine.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout_s`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
