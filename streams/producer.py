"""Record batches onto topics: keyed, chunked, with schema headers; failures are loud.

Every row is sent under its key (``group_id`` on per-run topics, ``prompt_id``
on prompt topics, ``component`` on metrics), so all rows of a GRPO group land
in one partition of every co-partitioned topic. Rows of one key keep their
order. Headers: ``relax-schema`` (name), ``relax-schema-version``,
``relax-producer`` (producer id).

Delivery: :meth:`BatchProducer.flush` waits for every send and raises
:class:`DeliveryError` with counts if any failed (public case C28: an oversize
record is reported as failed, never as sent). A stage commits its input only
after ``flush`` returned.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import pyarrow as pa

from relax.schemas import topics as topic_names
from relax.schemas.v1 import SCHEMA_VERSION
from relax.streams.blobs import BlobStore
from relax.streams.client import BusConfig, producer_kwargs
from relax.streams.codec import encode_messages, group_by_key
from relax.streams.errors import error_batch

KEY_COLUMNS: dict[str, str | None] = {
    "prompts": "prompt_id",
    "rollouts": "group_id",
    "rewards": "group_id",
    "ref_logprobs": "group_id",
    "train_samples": "group_id",
    "metrics": "component",
    "weights": None,
    "errors": None,
}
"""Kafka key column of each schema (None = no key)."""


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
    """Sends Arrow record batches to Kafka topics.

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
        self._futures: list = []
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
        explicit ``key`` is given, then split under ``max_message_bytes``.

        Args:
            topic: destination topic (its schema is inferred from the name unless given).
            batch: ``[N rows]`` with the v1 schema of the topic.
            schema: v1 schema name, when the topic name does not tell it.
            key: one key for every row (overrides the key column).
            partition: send to this partition instead of the key's (state changelogs).
            headers: extra Kafka headers.

        Raises:
            relax.streams.codec.RecordTooLarge: a row does not fit in a message.
        """
        schema = schema or topic_names.schema_for_topic(topic)
        if batch.num_rows == 0:
            return 0
        headers = self._headers(schema) + list(headers or [])
        key_col = KEY_COLUMNS.get(schema)
        if key is not None or key_col is None:
            parts = [(key, batch)]
        else:
            parts = group_by_key(batch, key_col)
        n = 0
        for k, part in parts:
            kb = k.encode() if isinstance(k, str) else k
            for value in encode_messages(part, self.cfg.max_message_bytes, self._blobs):
                self._send(topic, value, kb, headers, partition)
                n += 1
        self.stats.rows += batch.num_rows
        self.stats.per_topic_rows[topic] = self.stats.per_topic_rows.get(topic, 0) + batch.num_rows
        return n

    def send_value(self, topic: str, value: bytes, key: bytes | None = None,
                   headers: list[tuple[str, bytes]] | None = None,
                   partition: int | None = None) -> None:
        """Queue one raw message value (no Arrow); failures surface in :meth:`flush`."""
        self._send(topic, value, key, headers or [], partition)

    def _send(self, topic, value, key, headers, partition=None) -> None:
        from kafka.errors import KafkaError

        self.stats.messages += 1
        self.stats.bytes += len(value)
        try:
            self._futures.append(self._kp.send(topic, value=value, key=key, headers=headers,
                                               partition=partition))
        except KafkaError as e:  # kafka-python raises size errors synchronously
            self._futures.append(e)

    def send_errors(self, topic: str, rows: list[dict]) -> None:
        """Queue error rows (from :func:`relax.streams.errors.error_row`) to
        ``<topic>.errors``, keyed by the bad record's key."""
        for row in rows:
            self.send(topic_names.errors_topic(topic), error_batch([row]), schema="errors",
                      key=row.get("key"))

    def flush(self, timeout_s: float = 60.0) -> int:
        """Wait until every queued message is acknowledged.

        Returns:
            the number of messages delivered since the last flush.

        Raises:
            DeliveryError: if any message failed (counts of failed and delivered).
        """
        from kafka.errors import KafkaError

        futures, self._futures = self._futures, []
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
        self.stats.delivered += delivered
        self.stats.failed += len(errors)
        if errors:
            raise DeliveryError(len(errors), delivered, errors[:5])
        return delivered

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush what is queued (raising on failures) and close the client."""
        try:
            self.flush(timeout_s)
        finally:
            self._kp.close(timeout=timeout_s)
