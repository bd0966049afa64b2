"""Kafka client settings and topic administration (kafka-python).

Works against any Kafka cluster, tested on Apache Kafka 4.4 (the local broker of every
run and test). Clients: short session timeout and heartbeat (a stage that dies is out of
its consumer group within 6 s), client size limits raised to the message size, crc32c
for speed, idempotent producers with ``acks=all``.

Topics are created explicitly (Kafka runs with ``auto.create.topics.enable=false``: a
produce to a missing topic blocks for ``max_block_ms``, 60 s, then fails), each with
its partition count and the settings real Kafka enforces (:func:`topic_settings`):
``max.message.bytes`` from ``BusConfig.max_message_bytes``, replication factor and
``min.insync.replicas`` fitting the cluster, ``cleanup.policy=compact`` for the keyed
state topics of :data:`relax.schemas.topics.COMPACTED`.

Reads that must see every record up to now (lag, record counts, state recovery) take
the *fetch* high watermark (``streams/lag.py``, ``streams/read.py::read_partition``),
which is right on every Kafka; commit metadata is not relied on (the rollout epoch lives
on ``<run>.rollout_state``).

Security: ``BusConfig.security_protocol`` (PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL), the
SASL mechanism and user, the CA and client certificate files; every client relax makes
takes them from :func:`security_kwargs`. The password is never a setting: it is read
from ``sasl_password_file`` (else ``$RELAX_BUS_SASL_PASSWORD``) each time a client is
made (:func:`sasl_password`), so it is in no recipe copy, stage spec, log or error.
:func:`relax.streams.bus_check.check_bus` says in one line why a cluster cannot be
reached with these settings.
"""

from __future__ import annotations

import importlib.util
import os
import time
import uuid
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from relax.schemas import topics as topic_names
from relax.streams import kafka_join

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20

FETCH_WAIT_MS = 200
"""Default longest time the broker holds an empty fetch (``fetch_max_wait_ms``, ms;
``BusConfig.fetch_wait_ms``, the recipe's ``bus.fetch_wait_ms``). An idle kafka-python
consumer polls the broker again after each empty fetch, so short waits burn CPU that
co-located stages need (measured on 2 cores, one idle consumer: 10.5 % of a core at
20 ms, 1.7 % at 200 ms, 0.8 % at 500 ms). Apache Kafka answers a fetch already waiting as
soon as a record arrives, so a longer wait costs no latency. A reader polled only on
demand takes a short wait of its own (``TopicReader(fetch_wait_ms=...)``)."""

RECONNECT_BACKOFF_MAX_MS = 1000
"""Longest wait between a client's attempts to reach a broker it lost (ms; every relax
client's ``reconnect_backoff_max_ms``; the Java client's default). kafka-python's own
default, 30000, doubles the wait from 50 ms after each refused attempt, so a client tries
at about 25.5 s, 51 s and 81 s after losing the broker (each wait +-20 %): a Kafka that
took 28 s to come back on a busy 2-core machine was found by the stages only 48-51 s
after it died, against the 60 s a stage rides through an outage for
(``streams/consumer.py::OUTAGE_S``, ``BatchProducer.flush``); a restart a little later,
or a late draw of the jitter, failed a stage (issue 59). At 1 s a client finds the broker
within about 1.2 s of its return, for one refused connection a second while it is away."""

PASSWORD_ENV = "RELAX_BUS_SASL_PASSWORD"
"""Environment variable with the SASL password when ``BusConfig.sasl_password_file`` is
not set (read by every process that makes a client: a stage on another host needs it
in its own environment; a file every host mounts is simpler)."""

TLS_PROTOCOLS = frozenset({"SSL", "SASL_SSL"})
SASL_PROTOCOLS = frozenset({"SASL_PLAINTEXT", "SASL_SSL"})


class BusConfig(BaseModel):
    """How to reach the bus and how large its messages may be.

    Attributes:
        bootstrap_servers: ``host:port[,host:port...]`` of any Kafka-protocol cluster.
        max_message_bytes: largest Kafka message value relax produces (bytes);
            batches are split under it, larger single values go to the blob store.
        blob_store: folder or ``pyarrow.fs`` URI for values over the limit (None = off).
        session_timeout_ms / heartbeat_interval_ms: consumer-group liveness (ms): a
            member that stops heartbeating is out of its group after 6 s.
        compression: Kafka-level producer compression (``zstd``, ``lz4``, ``gzip``, None).
        linger_ms: producer batching delay (ms).
        fetch_wait_ms: longest time the broker holds an empty fetch of a reader that
            loops on ``poll`` (``fetch_max_wait_ms``, ms; :data:`FETCH_WAIT_MS`).
        replication_factor: replicas of each topic relax creates; None = one per broker,
            at most 3.
        min_insync_replicas: ``min.insync.replicas`` of each topic relax creates (with
            ``acks=all``, a write needs this many replicas); None = 2 when the
            replication factor is 3 or more, else 1.
        retention_ms: ``retention.ms`` of each non-compacted topic relax creates (ms; -1 =
            keep forever); None = the broker's default (Kafka: 7 days).
        security_protocol: ``PLAINTEXT``, ``SSL`` (TLS), ``SASL_PLAINTEXT`` or
            ``SASL_SSL`` (user and password over TLS: what managed Kafkas ask for).
        sasl_mechanism: ``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512`` (SASL_* only,
            and then required).
        sasl_username: the SASL user (SASL_* only, and then required).
        sasl_password_file: a file holding the SASL password (one line; mode 600 is
            advised); None = ``$RELAX_BUS_SASL_PASSWORD`` (:data:`PASSWORD_ENV`).
        ssl_cafile: PEM file of the CA(s) that signed the brokers' certificates (SSL and
            SASL_SSL only); None = the system's CAs.
        ssl_certfile / ssl_keyfile: PEM client certificate and its key, for brokers that
            ask for one (mutual TLS); the key may be inside the certificate file.
        ssl_check_hostname: the broker's certificate must name the host connected to.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    bootstrap_servers: str
    max_message_bytes: int = Field(DEFAULT_MAX_MESSAGE_BYTES, ge=1024)
    blob_store: str | None = None
    session_timeout_ms: int = Field(6000, ge=1000)
    heartbeat_interval_ms: int = Field(2000, ge=100)
    compression: str | None = "zstd"
    linger_ms: int = Field(5, ge=0)
    fetch_wait_ms: int = Field(FETCH_WAIT_MS, ge=1, le=30_000)
    replication_factor: int | None = Field(None, ge=1)
    min_insync_replicas: int | None = Field(None, ge=1)
    retention_ms: int | None = Field(None, ge=-1)
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password_file: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_check_hostname: bool = True

    @model_validator(mode="after")
    def _check_replicas(self):
        rf, isr = self.replication_factor, self.min_insync_replicas
        if rf is not None and isr is not None and isr > rf:
            raise ValueError(f"min_insync_replicas {isr} exceeds replication_factor {rf}: "
                             f"no write could succeed")
        return self

    @model_validator(mode="after")
    def _check_security(self):
        proto = self.security_protocol
        sasl = {k: getattr(self, k) for k in ("sasl_mechanism", "sasl_username",
                                              "sasl_password_file")}
        tls = {k: getattr(self, k) for k in ("ssl_cafile", "ssl_certfile", "ssl_keyfile")}
        if proto in SASL_PROTOCOLS:
            missing = [k for k in ("sasl_mechanism", "sasl_username") if not sasl[k]]
            if missing:
                raise ValueError(f"security_protocol {proto} needs {' and '.join(missing)} "
                                 f"(mechanism: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512)")
        else:
            given = [k for k, v in sasl.items() if v]
            if given:
                raise ValueError(f"{', '.join(given)} set but security_protocol is {proto}: "
                                 f"SASL settings need SASL_PLAINTEXT or SASL_SSL")
        if proto not in TLS_PROTOCOLS:
            given = [k for k, v in tls.items() if v]
            if given:
                raise ValueError(f"{', '.join(given)} set but security_protocol is {proto}: "
                                 f"TLS settings need SSL or SASL_SSL")
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError("ssl_keyfile set without ssl_certfile (the client certificate)")
        return self

    @property
    def request_bytes(self) -> int:
        """Client request/fetch size limit: message size plus framing headroom (bytes)."""
        return self.max_message_bytes + 64 * 1024


def _check_crc32c() -> None:
    if importlib.util.find_spec("crc32c") is None:
        raise RuntimeError("the 'crc32c' package is required: without it kafka-python checks "
                           "record CRCs in pure Python at ~3 MB/s instead of ~42 MB/s")


def sasl_password(cfg: BusConfig) -> str:
    """The SASL password of ``cfg``: the first line of ``sasl_password_file``, else
    ``$RELAX_BUS_SASL_PASSWORD``.

    Raises:
        ValueError: the file cannot be read or is empty, or neither is given (the
            message names the setting, never the password).
    """
    if cfg.sasl_password_file:
        path = Path(cfg.sasl_password_file).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise ValueError(f"bus.sasl_password_file {str(path)!r}: cannot read it "
                             f"({e.strerror})") from None
        if not lines or not lines[0]:
            raise ValueError(f"bus.sasl_password_file {str(path)!r}: its first line is empty")
        return lines[0]
    password = os.environ.get(PASSWORD_ENV)
    if not password:
        raise ValueError(f"security_protocol {cfg.security_protocol} needs a password: set "
                         f"bus.sasl_password_file (a file holding it) or ${PASSWORD_ENV}")
    return password


def security_kwargs(cfg: BusConfig) -> dict:
    """kafka-python's security keyword arguments from ``cfg`` (every relax client takes
    them): ``security_protocol``, and as it needs, ``sasl_mechanism``,
    ``sasl_plain_username``, ``sasl_plain_password`` (:func:`sasl_password`),
    ``ssl_cafile``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_check_hostname``.

    Raises:
        ValueError: a SASL password cannot be found (:func:`sasl_password`).
    """
    kw: dict = {"security_protocol": cfg.security_protocol}
    if cfg.security_protocol in SASL_PROTOCOLS:
        kw.update(sasl_mechanism=cfg.sasl_mechanism, sasl_plain_username=cfg.sasl_username,
                  sasl_plain_password=sasl_password(cfg))
    if cfg.security_protocol in TLS_PROTOCOLS:
        kw.update(ssl_cafile=cfg.ssl_cafile, ssl_certfile=cfg.ssl_certfile,
                  ssl_keyfile=cfg.ssl_keyfile, ssl_check_hostname=cfg.ssl_check_hostname)
    return kw


def producer_kwargs(cfg: BusConfig, client_id: str | None = None) -> dict:
    """Keyword arguments for ``kafka.KafkaProducer`` from a :class:`BusConfig`
    (security from :func:`security_kwargs`)."""
    _check_crc32c()
    return dict(
        **security_kwargs(cfg),
        bootstrap_servers=cfg.bootstrap_servers.split(","),
        client_id=client_id or f"relax-{uuid.uuid4().hex[:8]}",
        compression_type=cfg.compression,
        max_request_size=cfg.request_bytes,
        linger_ms=cfg.linger_ms,
        batch_size=min(cfg.request_bytes, 1 << 20),
        acks="all",
        reconnect_backoff_max_ms=RECONNECT_BACKOFF_MAX_MS,
        # the broker drops a retried batch it already wrote; explicit, so a
        # setting that conflicts (acks, retries, in-flight requests) raises instead of
        # silently turning it off
        enable_idempotence=True,
    )


def consumer_kwargs(cfg: BusConfig, group_id: str | None, client_id: str | None = None,
                    from_beginning: bool = True) -> dict:
    """Keyword arguments for ``kafka.KafkaConsumer``: manual commits, reading from the
    earliest offset when the group has none (``from_beginning``), fetch limits at
    least one message, security from :func:`security_kwargs`. Applies
    :func:`relax.streams.kafka_join.apply` (group joins that finish between polls are
    kept)."""
    _check_crc32c()
    kafka_join.apply()
    return dict(
        **security_kwargs(cfg),
        bootstrap_servers=cfg.bootstrap_servers.split(","),
        client_id=client_id or f"relax-{uuid.uuid4().hex[:8]}",
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest" if from_beginning else "latest",
        session_timeout_ms=cfg.session_timeout_ms,
        heartbeat_interval_ms=cfg.heartbeat_interval_ms,
        max_partition_fetch_bytes=cfg.request_bytes,
        fetch_max_bytes=max(cfg.request_bytes, 52428800),
        max_poll_interval_ms=600_000,
        fetch_max_wait_ms=cfg.fetch_wait_ms,
        reconnect_backoff_max_ms=RECONNECT_BACKOFF_MAX_MS,
    )


def admin(cfg: BusConfig):
    """A ``kafka.KafkaAdminClient`` for the configured cluster, security from
    :func:`security_kwargs` (caller closes it)."""
    from kafka import KafkaAdminClient

    return KafkaAdminClient(**security_kwargs(cfg),
                            bootstrap_servers=cfg.bootstrap_servers.split(","),
                            client_id=f"relax-admin-{uuid.uuid4().hex[:6]}",
                            reconnect_backoff_max_ms=RECONNECT_BACKOFF_MAX_MS)


def topic_settings(cfg: BusConfig, topic: str, brokers: int) -> tuple[int, dict[str, str]]:
    """``(replication factor, topic configs)`` relax creates ``topic`` with on a cluster of
    ``brokers`` brokers:

    - ``max.message.bytes``: ``cfg.request_bytes`` (``max_message_bytes`` plus 64 KiB for
      the record batch, key and headers; Kafka's default of about 1 MB refuses bigger);
    - replication factor ``cfg.replication_factor`` or ``min(3, brokers)``, and
      ``min.insync.replicas`` ``cfg.min_insync_replicas`` or 2 from 3 replicas, else 1;
    - ``cleanup.policy=compact`` for :func:`relax.schemas.topics.compacted` topics; the
      others keep the broker's delete policy, with ``retention.ms`` from
      ``cfg.retention_ms`` when set (else the broker's retention), except
      :func:`relax.schemas.topics.kept` logs: ``retention.ms=-1``.

    Raises:
        ValueError: the replication factor asked for exceeds ``brokers``.
    """
    rf = cfg.replication_factor or min(3, brokers)
    if rf > brokers:
        raise ValueError(f"replication_factor {rf} for {topic!r}, but the cluster has "
                         f"{brokers} broker(s)")
    isr = cfg.min_insync_replicas or (2 if rf >= 3 else 1)
    configs = {"max.message.bytes": str(cfg.request_bytes), "min.insync.replicas": str(isr)}
    if topic_names.compacted(topic):
        configs["cleanup.policy"] = "compact"
    elif topic_names.kept(topic):
        configs["retention.ms"] = "-1"
    elif cfg.retention_ms is not None:
        configs["retention.ms"] = str(cfg.retention_ms)
    return rf, configs


def ensure_topics(cfg: BusConfig, partitions: dict[str, int], timeout_s: float = 30.0) -> list[str]:
    """Create the topics that do not exist yet, each with its partition count and
    :func:`topic_settings`, and wait until their metadata is visible.

    Args:
        partitions: ``{topic: partition count}``.

    Returns:
        The topics that were created (existing ones are left as they are).

    Raises:
        ValueError: an existing topic has a different partition count than asked
            (co-partitioned topics must match; relax never repartitions).
        TimeoutError: the topics did not appear within ``timeout_s`` seconds.
    """
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    a = admin(cfg)
    try:
        existing = set(a.list_topics())
        todo = [t for t in partitions if t not in existing]
        brokers = len(a.describe_cluster()["brokers"]) if todo else 0
        for t in todo:
            rf, configs = topic_settings(cfg, t, brokers)
            try:
                a.create_topics([NewTopic(t, partitions[t], rf, topic_configs=configs)])
            except TopicAlreadyExistsError:
                pass
        deadline = time.monotonic() + timeout_s
        while True:
            counts = topic_partitions(cfg, list(partitions), _admin=a)
            if all(counts.get(t) for t in partitions):
                break
            if time.monotonic() > deadline:
                missing = [t for t in partitions if not counts.get(t)]
                raise TimeoutError(f"topics not visible after {timeout_s}s: {missing}")
            time.sleep(0.1)
        for t, n in partitions.items():
            if counts[t] != n:
                raise ValueError(f"topic {t!r} exists with {counts[t]} partitions, expected {n}")
        return todo
    finally:
        a.close()


def topic_partitions(cfg: BusConfig, topics: list[str] | None = None, _admin=None) -> dict[str, int]:
    """``{topic: partition count}`` from cluster metadata (all topics if ``topics`` is None)."""
    a = _admin or admin(cfg)
    try:
        meta = a.describe_topics(topics) if topics else a.describe_topics()
        return {m["name"]: len(m["partitions"]) for m in meta
                if m.get("error_code", 0) == 0 and m["partitions"]}
    finally:
        if _admin is None:
            a.close()


def list_topics(cfg: BusConfig, _admin=None) -> list[str]:
    """Every topic name on the cluster, sorted (``_admin``: an open admin client to ask
    with, else a new one)."""
    a = _admin or admin(cfg)
    try:
        return sorted(a.list_topics())
    finally:
        if _admin is None:
            a.close()


def delete_topics(cfg: BusConfig, topics: list[str]) -> None:
    """Delete topics (those that do not exist are ignored)."""
    from kafka.errors import UnknownTopicOrPartitionError

    a = admin(cfg)
    try:
        existing = set(a.list_topics())
        todo = [t for t in topics if t in existing]
        if todo:
            try:
                a.delete_topics(todo)
            except UnknownTopicOrPartitionError:
                pass
    finally:
        a.close()


def topic_message_limits(cfg: BusConfig, topics: list[str], _admin=None) -> dict[str, int]:
    """``{topic: max.message.bytes}`` the cluster enforces on each of ``topics`` (bytes: the
    topic's own setting, else the broker's default; Kafka refuses a record batch larger).

    Topics the cluster does not describe (missing ones) are left out.

    Raises:
        kafka.errors.KafkaError: the request failed (``KafkaConnectionError`` from a
            broker that keeps no topic configs).
    """
    from kafka.admin import ConfigResource, ConfigResourceType

    a = _admin or admin(cfg)
    try:
        res = a.describe_configs([ConfigResource(ConfigResourceType.TOPIC, t,
                                                 configs=["max.message.bytes"])
                                  for t in topics], config_filter="all")
    finally:
        if _admin is None:
            a.close()
    out = {}
    for t, configs in res.get("topic", {}).items():
        value = configs.get("max.message.bytes", {}).get("value")
        if value is not None:
            out[t] = int(value)
    return out
