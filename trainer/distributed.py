"""The process group of the trainer's data-parallel ranks.

``resources.trainer.processes: N`` runs N trainer processes; each one calls
:func:`init_data_parallel` with its rank before it builds its back end, so that
:class:`relax.trainer.backends.torch_backend.TorchBackend` finds an initialised
default process group and wraps its forward in DDP. The collective back end is
``nccl`` when CUDA is available (one GPU per rank, ``cuda:<local rank>``), else
``gloo`` on the CPU. Rank 0 is the one that saves checkpoints and publishes
weights; every rank holds the same weights after each step.

Rendezvous is TCP on ``master_addr:master_port`` (rank 0 listens there): every rank
must be given the same address and port. :func:`relax.streams.ports.free_port` picks one on loopback
for single-host runs and tests. Ranks on several hosts (``resources.trainer.rank_hosts``)
use rank 0's routable address; gloo then binds each rank's device to the interface
that reaches it (:func:`gloo_interface`), not to whatever the host name resolves to.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist


def default_backend() -> str:
    """``"nccl"`` when a CUDA device is visible, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def node_address() -> str:
    """The address other hosts reach this process at: the Ray node's IP when this process
    is a Ray worker (the address the cluster's nodes registered with), else 127.0.0.1."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def interface_of(ip: str) -> str | None:
    """The name of the network interface holding address ``ip`` (None: none here)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return None


def gloo_interface(master_addr: str, master_port: int) -> None:
    """Point gloo (``GLOO_SOCKET_IFNAME``) at the interface this host reaches
    ``master_addr`` through, unless it is loopback or already set: gloo otherwise binds
    to the address of the host name, which on a host with several interfaces (or a
    network namespace) may be one the other ranks cannot reach."""
    import os

    from relax.streams.weights.rendezvous import local_ip_towards

    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    ip = local_ip_towards(master_addr, master_port)
    name = None if ip.startswith("127.") else interface_of(ip)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def init_data_parallel(rank: int, world_size: int, master_addr: str = "127.0.0.1",
                       master_port: int = 29500, *, backend: str | None = None,
                       local_rank: int | None = None, timeout_s: float = 600.0,
                       check: Callable[[], None] | None = None) -> str:
    """Join the default process group as ``rank`` of ``world_size`` trainer ranks.

    Blocks until all ``world_size`` ranks have joined (or ``timeout_s``). On ``nccl``
    the rank's GPU becomes the current CUDA device (``local_rank``, default
    ``rank % device_count``), so tensors on ``"cuda"`` land on it.

    Args:
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of trainer processes (>= 1).
        master_addr, master_port: TCP rendezvous of rank 0, the same on every rank.
        backend: ``"gloo"`` or ``"nccl"`` (default: :func:`default_backend`).
        local_rank: GPU index on this host (nccl only).
        timeout_s: rendezvous and collective timeout (seconds).
        check: called about every 0.1 s while this rank waits for the others to check
            in on the rendezvous store (rank 0 passes one that raises when a child rank
            has exited: a rank that never comes is seen at once, not at the timeout).

    Returns:
        the torch device string for the back end: ``"cuda:<local_rank>"`` or ``"cpu"``.

    Raises:
        ValueError: a bad rank / world size, or nccl without CUDA.
        RuntimeError: a process group is already initialised in this process.
        TimeoutError: with ``check``, not every rank checked in within ``timeout_s``.
        whatever ``check`` raises.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world_size {world_size}: need 0 <= rank < world_size")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already initialised "
                           "(call destroy_data_parallel() first)")
    backend = backend or default_backend()
    device = "cpu"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs a CUDA device; use 'gloo' on the CPU")
        local = rank % torch.cuda.device_count() if local_rank is None else local_rank
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if backend == "gloo":
        gloo_interface(master_addr, master_port)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=False)
    store.set(f"relax/joined/{rank}", "1")
    if check is not None:
        keys = [f"relax/joined/{r}" for r in range(world_size)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"data-parallel rendezvous: not all {world_size} ranks "
                                   f"joined within {timeout_s}s")
            time.sleep(0.1)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    return device


def destroy_data_parallel() -> None:
    """Leave and destroy the default process group (no-op when there is none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: ``(0, 1)`` without a process group."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
