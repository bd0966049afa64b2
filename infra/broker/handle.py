"""A local Kafka's processes: :class:`BrokerHandle` (pids, address, logs, nodes, data
folder), whether a pid is alive, and stopping them (SIGTERM, then SIGKILL). Shared by
:mod:`relax.infra.broker.kafka` (starts the nodes) and :mod:`relax.infra.broker.local` (records
them)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists (and is not a zombie we own)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


@dataclass
class KafkaNode:
    """One node of a local Kafka cluster (a combined KRaft controller and broker)."""

    node_id: int
    port: int
    """client (PLAINTEXT) listener"""
    controller_port: int
    """KRaft controller listener"""
    pid: int = 0
    log_path: str = ""
    internal_port: int = 0
    """a ``--secure`` node's PLAINTEXT listener on 127.0.0.1, between brokers and for the
    readiness check (0: none; ``port`` is then the SASL_SSL client listener)"""


@dataclass
class BrokerHandle:
    """A running local Kafka: ``pid``, ``port`` and ``log_path`` are its first node's,
    ``nodes`` lists every node, ``data_dir`` holds their configs, logs and data.
    ``security`` is the client settings of a ``--secure`` broker (no secret: the password
    is in ``data_dir``'s ``client.password``), empty for a PLAINTEXT one."""

    pid: int
    host: str
    port: int
    log_path: str
    started_at: float
    nodes: list[KafkaNode] = field(default_factory=list)
    data_dir: str | None = None
    """the folder with the nodes' configs, logs and data (:func:`start_kafka`)"""
    security: dict = field(default_factory=dict)
    """a ``--secure`` broker's ``BusConfig`` settings (``security_protocol``,
    ``sasl_mechanism``, ``sasl_username``, ``sasl_password_file``, ``ssl_cafile``)"""

    def __post_init__(self):
        self.nodes = [n if isinstance(n, KafkaNode) else KafkaNode(**n) for n in self.nodes]

    @property
    def bootstrap(self) -> str:
        """``host:port[,host:port...]`` for ``bootstrap_servers`` (every node)."""
        ports = [n.port for n in self.nodes] or [self.port]
        return ",".join(f"{self.host}:{p}" for p in ports)

    @property
    def internal_bootstrap(self) -> str:
        """``bootstrap`` of the PLAINTEXT listeners on 127.0.0.1 of a ``--secure`` broker
        (the readiness check's), else ``bootstrap``."""
        if not self.nodes or not all(n.internal_port for n in self.nodes):
            return self.bootstrap
        return ",".join(f"127.0.0.1:{n.internal_port}" for n in self.nodes)

    @property
    def pids(self) -> list[int]:
        """Every process of the broker (one per node)."""
        return [n.pid for n in self.nodes] or [self.pid]

    @property
    def ports(self) -> list[int]:
        """Every client port of the broker (one per node)."""
        return [n.port for n in self.nodes] or [self.port]


def stop_broker(handle: BrokerHandle, timeout_s: float = 30.0) -> None:
    """SIGTERM every node of the broker, wait up to
    ``timeout_s`` seconds, then SIGKILL what is left; returns when all are gone."""
    stop_pids(handle.pids, timeout_s)


def stop_pids(pids: list[int], timeout_s: float) -> None:
    """SIGTERM ``pids``, then SIGKILL those still alive after ``timeout_s`` seconds."""
    alive = [p for p in pids if p and pid_alive(p)]
    _signal(alive, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    killed = False
    while alive := [p for p in alive if pid_alive(p)]:
        if time.monotonic() > deadline and not killed:
            _signal(alive, signal.SIGKILL)
            killed = True
        time.sleep(0.05)


def _signal(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:  # exited since it was seen alive
            pass
