"""Rendezvous and process groups of the weight channel.

Rendezvous: the publisher hosts a ``torch.distributed.TCPStore`` at ``host:port`` (the
announcement's ``rendezvous``), reachable across machines. Keys: ``relax/membership``
(the join/leave log), ``<group>/members`` (member ids, one per line; rank = line index
+ 1), ``<group>/ready/<member>``. Each group is a standalone
``ProcessGroupGloo``/``ProcessGroupNCCL`` on the store keys of
``init_custom_process_group`` (:func:`group_store`), so an inference server that joins
groups that way (SGLang's ``/init_weights_update_group``; veRL, slime and OpenRLHF use
the same function) can be a member; it never touches the process's default group (the
trainer's DDP group stays its own). A member
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


def group_store(store, group: str, device: torch.device):
    """The prefixed store a group's backend rendezvouses on: the keys of SGLang's
    ``init_custom_process_group(init_method="tcp://<rendezvous>", group_name=group)``
    (``python/sglang/srt/utils``: ``PrefixStore(group_name, store)``, then torch's
    ``_new_process_group_helper`` adds ``<group>/`` and ``<device type>/``, as in the
    torch relax pins; a server on another torch release may lay its keys out otherwise).

    Args:
        store: the publisher's ``TCPStore`` (or a client of it).
        group: the group name (announced as ``group_name``).
        device: ``cuda`` -> nccl's ``cuda/`` keys; anything else -> gloo's ``cpu/``.
    """
    import torch.distributed as dist

    kind = "cuda" if device.type == "cuda" else "cpu"
    sglang = dist.PrefixStore(group, store)  # init_custom_process_group's own prefix
    return dist.PrefixStore(f"{kind}/", dist.PrefixStore(f"{group}/", sglang))


def make_group(
    store, group: str, rank: int, size: int, device: torch.device, host: str, timeout_s: float
):
    """A standalone process group (not the default one) on :func:`group_store`: NCCL on a
    CUDA ``device``, else gloo on ``host``'s interface; rank 0 is the publisher, ``size``
    counts it. Its sequence number is set as torch's ``_new_process_group_helper`` sets it.

    Raises:
        RuntimeError / torch.distributed.DistError: the group did not form within
            ``timeout_s`` seconds (a member never came).
    """
    import torch.distributed as dist

    prefixed = group_store(store, group, device)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        pg = dist.ProcessGroupGloo(prefixed, rank, size, opts)
    pg._set_sequence_number_for_group()
    return pg


def broadcast(pg, tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` (any shape and dtype, on the group's device) from rank 0 of
    ``pg`` in place, waiting for it to finish.

    Raises:
        RuntimeError: a member died or timed out mid-broadcast.
    """
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()


def member_lines(raw: bytes) -> list[str]:
    """The non-empty lines of a store value (a group's member list, the membership log)."""
    return [m for m in raw.decode().split("\n") if m]


def replay_membership(log_bytes: bytes) -> list[str]:
    """Members after replaying a join/leave log (``+id`` / ``-id`` lines), in join order."""
    out: list[str] = []
    for line in member_lines(log_bytes):
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
