"""Record batches onto topics: keyed, chunked, with schema headers; failures are loud.

Every row is sent under its key (``group_id`` on per-run topics, ``prompt_id``
on prompt topics, ``component`` on metrics), so all rows of a GRPO group land
in one partition of every co-partitioned topic. Rows of one key keep their
order. Headers: ``relax-schema`` (name), ``relax-schema-version``,
``relax-producer`` (producer id).

Delivery: :meth:`BatchProducer.flush` waits for every send of the calling thread
and raises :class:`DeliveryError` with counts if any failed (public case C28: an
oversize record is reported as failed, never as sent). A stage commits its input
only after ``flush`` returned.

Size: a value is never larger than :meth:`BatchProducer.limit` of its topic, the
smaller of ``max_message_bytes`` and what the topic's own ``max.message.bytes`` leaves
for a value (asked of the cluster once per topic), so every broker gives the same answer
(some brokers store a record over a topic's limit; Kafka refuses it). Batches are split under
it; a row that alone is over it raises :class:`~relax.streams.codec.RecordTooLarge` at
:meth:`~BatchProducer.send` naming the row, its key, the topic and the limit, and is
neither queued nor counted; a raw value over it (:meth:`~BatchProducer.send_value`)
fails in :meth:`~BatchProducer.flush` like any refused send. Neither is ever counted
delivered. The stage then stops (failures are loud); its input is not committed. One producer may be shared by threads (the trainer's
main thread sends metrics while the weight publisher's thread announces): each
thread's ``flush`` answers for that thread's sends; :meth:`BatchProducer.close`
for everyone's.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from relax.schemas import topics as topic_names
from relax.schemas.v1 import SCHEMA_VERSION
from relax.streams.blobs import BlobStore
from relax.streams.client import (
    BusConfig,
    ensure_topics,
    producer_kwargs,
    topic_message_limits,
    topic_partitions,
)
from relax.streams.codec import RecordTooLarge, encode_messages, group_by_key
from relax.streams.errors import error_batch

log = logging.getLogger(__name__)

_UNDESCRIBED: set[str] = set()
"""``bootstrap_servers`` of clusters whose DescribeConfigs failed in this process: not asked
again (kafka-python logs three ERROR lines each time), so :meth:`BatchProducer.limit` is ``max_message_bytes`` there."""

KEY_COLUMNS: dict[str, str | None] = {
    "prompts": "prompt_id",
    "rollouts": "group_id",
    "rewards": "group_id",
    "ref_logprobs": "group_id",
    "teacher_logprobs": "group_id",
    "train_samples": "group_id",
    "metrics": "component",
    "progress": None,
    "weights": None,
    "reward_changes": None,
    "errors": None,
}
"""Kafka key column of each schema (None = no key). Every schema of
:data:`relax.schemas.v1.SCHEMAS` is here (``tests/streams/test_producer.py``): a schema
the aggregator joins must be keyed by group_id, or its rows land in other partitions
than their group's rollouts."""


class DeliveryError(RuntimeError):
    """Some sends failed. ``failed`` / ``delivered`` count messages; ``errors`` holds
    the first few exceptions."""

    def __init__(self, failed: int, delivered: int, errors: list[BaseException]):
        self.failed, self.delivered, self.errors = failed, delivered, errors
        first = f": {errors[0]!r}" if errors else ""
        super().__init__(f"{failed} message(s) failed, {delivered} delivered{first}")


@dataclass
class ProducerStats:
    """Counters since the producer started: rows, messages, value bytes (before
    Kafka compression), delivered and failed messages."""

    rows: int = 0
    messages: int = 0
    bytes: int = 0
    delivered: int = 0
    failed: int = 0
    per_topic_rows: dict[str, int] = field(default_factory=dict)


class BatchProducer:
    """Sends Arrow record batches to Kafka topics; safe to share between threads.

    Sends of each thread are tracked apart: :meth:`flush` checks those of the calling
    thread (a message queued by another thread is that thread's to check), so a thread
    that commits after its ``flush`` never commits past another thread's failure, nor
    past its own message that another thread happens to be waiting on.

    Args:
        cfg: bus settings (bootstrap servers, max_message_bytes, blob store).
        producer_id: written to the ``relax-producer`` header (default: random).
        kafka_producer: an existing ``kafka.KafkaProducer`` to use (tests, sharing).
    """

    def __init__(self, cfg: BusConfig, producer_id: str | None = None, kafka_producer=None):
        from kafka import KafkaProducer

        self.cfg = cfg
        self.producer_id = producer_id or f"relax-{uuid.uuid4().hex[:8]}"
        self._kp = kafka_producer or KafkaProducer(**producer_kwargs(cfg, self.producer_id))
        self._blobs = BlobStore(cfg.blob_store) if cfg.blob_store else None
        self._lock = threading.Lock()  # guards _futures and stats, never held while waiting
        self._futures: dict[int, list] = {}  # thread id -> futures (or send errors) unchecked
        self._errors_topics: set[str] = set()  # <topic>.errors known to exist
        # topic -> (largest value sent to it, the topic's max.message.bytes or None), bytes
        self._limits: dict[str, tuple[int, int | None]] = {}
        self.stats = ProducerStats()

    def _headers(self, schema: str) -> list[tuple[str, bytes]]:
        return [("relax-schema", schema.encode()),
                ("relax-schema-version", str(SCHEMA_VERSION).encode()),
                ("relax-producer", self.producer_id.encode())]

    def send(self, topic: str, batch: pa.RecordBatch | pa.Table, *, schema: str | None = None,
             key: str | bytes | None = None, partition: int | None = None,
             headers: list[tuple[str, bytes]] | None = None) -> int:
        """Queue ``batch`` for ``topic``; returns the number of messages queued.

        Rows are grouped by the schema's key column (:data:`KEY_COLUMNS`) unless an
        explicit ``key`` is given, then split under the topic's :meth:`limit`.

        Args:
            topic: destination topic (its schema is inferred from the name unless given).
            batch: ``[N rows]`` with the v1 schema of the topic.
            schema: v1 schema name, when the topic name does not tell it.
            key: one key for every row (overrides the key column).
            partition: send to this partition instead of the key's (state changelogs).
            headers: extra Kafka headers.

        Raises:
            relax.streams.codec.RecordTooLarge: a row does not fit in a message of the
                topic (:meth:`limit`); ``row`` is its index in ``batch`` and the message
                names it, its key, the topic and the limit. Nothing of its key is
                queued; the messages of the keys before it stay queued, and counted in
                ``stats``.
        """
        schema = schema or topic_names.schema_for_topic(topic)
        if batch.num_rows == 0:
            return 0
        limit = self.limit(topic)
        headers = self._headers(schema) + list(headers or [])
        key_col = KEY_COLUMNS.get(schema)
        if key is not None or key_col is None:
            parts = [(key, batch)]
        else:
            parts = group_by_key(batch, key_col)
        n = 0
        for k, part in parts:
            kb = k.encode() if isinstance(k, str) else k
            try:
                values = encode_messages(part, limit, self._blobs)
            except RecordTooLarge as e:
                grouped = key is None and key_col is not None
                row = _row_of(batch, key_col, k, e.row) if grouped else e.row
                raise RecordTooLarge(row, e.nbytes, limit, e.detail + self._where(topic, k),
                                     self._limit_name(topic)) from None
            for value in values:
                self._send(topic, value, kb, headers, partition)
                n += 1
            with self._lock:  # counted once queued: a RecordTooLarge later leaves them counted
                self.stats.rows += part.num_rows
                self.stats.per_topic_rows[topic] = (self.stats.per_topic_rows.get(topic, 0)
                                                    + part.num_rows)
        return n

    def send_value(self, topic: str, value: bytes, key: bytes | None = None,
                   headers: list[tuple[str, bytes]] | None = None,
                   partition: int | None = None) -> None:
        """Queue one raw message value (no Arrow); failures surface in :meth:`flush`,
        a value over the topic's :meth:`limit` among them (a ``MessageSizeTooLargeError``
        naming the topic, key, size and limit; never sent)."""
        from kafka.errors import MessageSizeTooLargeError

        limit = self.limit(topic)
        if len(value) > limit:
            self._send(topic, value, key, headers or [], partition, refused=(
                MessageSizeTooLargeError(f"a value of {len(value)} bytes, over "
                                         f"{self._limit_name(topic)}={limit}"
                                         f"{self._where(topic, key)}; not sent")))
            return
        self._send(topic, value, key, headers or [], partition)

    def limit(self, topic: str) -> int:
        """The largest message value this producer sends to ``topic`` (bytes):
        ``max_message_bytes``, or what the topic's own ``max.message.bytes`` leaves for
        a value (less the framing headroom of :attr:`BusConfig.request_bytes`) where that
        is smaller: a topic made by a run with a smaller ``max_message_bytes``, or by
        someone else. Asked of the cluster at the first send to the topic; a cluster that
        does not answer leaves ``max_message_bytes`` (Kafka's refusal at :meth:`flush` stays the check where the cluster is away), for
        every topic of it from then on (:data:`_UNDESCRIBED`)."""
        from kafka.errors import KafkaError

        with self._lock:
            known = self._limits.get(topic)
        if known is not None:
            return known[0]
        limit, topic_limit = self.cfg.max_message_bytes, None
        if self.cfg.bootstrap_servers not in _UNDESCRIBED:
            try:
                topic_limit = topic_message_limits(self.cfg, [topic]).get(topic)
            except KafkaError as e:  # the fallback: the limit relax creates topics with
                _UNDESCRIBED.add(self.cfg.bootstrap_servers)
                log.info("the cluster did not describe topic configs (%r): values up to "
                         "max_message_bytes=%d are sent to its topics", e, limit)
        framing = self.cfg.request_bytes - self.cfg.max_message_bytes
        if topic_limit is not None and topic_limit - framing < limit:
            limit = topic_limit - framing
        else:
            topic_limit = None  # max_message_bytes is the limit
        with self._lock:
            self._limits[topic] = (limit, topic_limit)
        return limit

    def _limit_name(self, topic: str) -> str:
        """Which limit :meth:`limit` gave for ``topic``, for an error message."""
        topic_limit = self._limits[topic][1]
        if topic_limit is None:
            return "max_message_bytes"
        framing = self.cfg.request_bytes - self.cfg.max_message_bytes
        return f"the topic's max.message.bytes ({topic_limit}) less {framing} bytes of framing"

    @staticmethod
    def _where(topic: str, key) -> str:
        """The end of a size error: the topic and the key."""
        k = key.decode(errors="replace") if isinstance(key, bytes) else key
        return f": key {k!r} of topic {topic}"

    def _send(self, topic, value, key, headers, partition=None, refused=None) -> None:
        """Queue one value (or, with ``refused``, count it as a failed send)."""
        from kafka.errors import KafkaError

        future = refused
        if future is None:
            try:  # may block while the client's buffer is full: outside the lock
                future = self._kp.send(topic, value=value, key=key, headers=headers,
                                       partition=partition)
            except KafkaError as e:  # kafka-python raises size errors synchronously
                future = e
        with self._lock:
            self.stats.messages += 1
            self.stats.bytes += len(value)
            self._futures.setdefault(threading.get_ident(), []).append(future)

    def send_errors(self, topic: str, rows: list[dict]) -> None:
        """Queue error rows (from :func:`relax.streams.errors.error_row`) to
        ``<topic>.errors``, keyed by the bad record's key. The errors topic is created
        (1 partition) the first time this producer writes to it, if it is missing: a
        send to a missing topic blocks the producer (for 60 s on a Kafka without
        auto-create) and the stage with it."""
        etopic = topic_names.errors_topic(topic)
        if etopic not in self._errors_topics:
            if not topic_partitions(self.cfg, [etopic]).get(etopic):
                ensure_topics(self.cfg, {etopic: 1})
            with self._lock:
                self._errors_topics.add(etopic)
        for row in rows:
            self.send(etopic, error_batch([row]), schema="errors", key=row.get("key"))

    def flush(self, timeout_s: float = 60.0, every_thread: bool = False) -> int:
        """Wait until every message the calling thread queued is acknowledged.

        Args:
            timeout_s: how long to wait for the client's buffer to drain, then for each
                acknowledgement (seconds).
            every_thread: answer for the sends of every thread, not only the caller's
                (a consumer's error records are sent by its reading thread and must be
                acknowledged before another thread commits).

        Returns:
            the number of this thread's messages delivered since its last flush.

        Raises:
            DeliveryError: if any of them failed (counts of failed and delivered).
            kafka.errors.KafkaTimeoutError: the buffer did not drain within ``timeout_s``.
        """
        with self._lock:
            if every_thread:
                futures = [f for fs in self._futures.values() for f in fs]
                self._futures.clear()
            else:
                futures = self._futures.pop(threading.get_ident(), [])
        return self._check(futures, timeout_s)

    def _check(self, futures: list, timeout_s: float) -> int:
        """Wait for ``futures`` (no lock held), count them in ``stats``, raise on failures."""
        from kafka.errors import KafkaError

        if not futures:
            return 0
        self._kp.flush(timeout=timeout_s)
        errors: list[BaseException] = []
        delivered = 0
        for f in futures:
            if isinstance(f, BaseException):
                errors.append(f)
                continue
            try:
                f.get(timeout=timeout_s)
                delivered += 1
            except KafkaError as e:
                errors.append(e)
        with self._lock:
            self.stats.delivered += delivered
            self.stats.failed += len(errors)
        if errors:
            raise DeliveryError(len(errors), delivered, errors[:5])
        return delivered

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush what every thread queued (raising :class:`DeliveryError` on failures) and
        close the client. Call it once no other thread sends."""
        with self._lock:
            futures = [f for fs in self._futures.values() for f in fs]
            self._futures.clear()
        try:
            self._check(futures, timeout_s)
        finally:
            self._kp.close(timeout=timeout_s)


def _row_of(batch: pa.RecordBatch | pa.Table, key_col: str, key, i: int) -> int:
    """Index in ``batch`` of the ``i``-th row whose ``key_col`` is ``key``."""
    col = batch.column(key_col)
    hits = pc.is_null(col) if key is None else pc.fill_null(pc.equal(col, key), False)
    return int(np.flatnonzero(hits.to_numpy(zero_copy_only=False))[i])
