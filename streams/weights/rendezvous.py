"""Rendezvous and process groups of the weight channel.

Rendezvous: the publisher hosts a ``torch.distributed.TCPStore`` at ``host:port`` (the
announcement's ``rendezvous``), reachable across machines. Keys: ``relax/membership``
(the join/leave log), ``<group>/members`` (member ids, one per line; rank = line index
+ 1), ``<group>/ready/<member>``. Each group is a standalone
``ProcessGroupGloo``/``ProcessGroupNCCL`` on ``PrefixStore('<group>/pg/')``: it never
touches the process's default group (the trainer's DDP group stays its own). A member
that does not show up within ``join_timeout_s`` is dropped from the next group; that
version's broadcast is skipped for everyone in the failed group (they catch up at the
next version or from the checkpoint). A group is re-formed only when membership
changed; otherwise every version reuses it.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch

MEMBERSHIP_KEY = "relax/membership"

CONNECT_S = 10.0
"""Seconds a subscriber tries to reach a publisher's rendezvous store before it takes the
publisher for gone (a trainer that died; its successor announces a new rendezvous)."""


def local_ip_towards(host: str, port: int) -> str:
    """The local address this machine uses to reach ``host:port`` (gloo binds its device
    to it, so the group works across machines); ``127.0.0.1`` for loopback."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def _make_group(
    store, group: str, rank: int, size: int, device: torch.device, host: str, timeout_s: float
):
    """A standalone process group (not the default one) over ``PrefixStore(group/)``."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"{group}/pg/", store)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, size, opts)


def _broadcast(pg, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()


def _members(raw: bytes) -> list[str]:
    return [m for m in raw.decode().split("\n") if m]


def replay_membership(log_bytes: bytes) -> list[str]:
    """Members after replaying a join/leave log (``+id`` / ``-id`` lines), in join order."""
    out: list[str] = []
    for line in _members(log_bytes):
        op, mid = line[0], line[1:]
        if op == "+" and mid not in out:
            out.append(mid)
        elif op == "-" and mid in out:
            out.remove(mid)
    return out


def parse_rendezvous(uri: str) -> tuple[str, int]:
    """``tcp://host:port`` -> ``(host, port)``.

    Raises:
        ValueError: for any other form.
    """
    if not uri or not uri.startswith("tcp://") or ":" not in uri[6:]:
        raise ValueError(f"rendezvous must look like tcp://host:port, got {uri!r}")
    host, _, port = uri[6:].rpartition(":")
    return host, int(port)
