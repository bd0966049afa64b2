"""Record batches off topics, in a consumer group, with commits that never run ahead.

Contract (at-least-once):

* :meth:`BatchConsumer.poll` decodes each Kafka message into a
  :class:`Delivery` (an Arrow table plus its origin). A message whose bytes do
  not decode or whose schema does not match is routed to ``<topic>.errors``
  (with the bytes, topic, partition, offset and reason) and never reaches the
  caller; the stage goes on.
* The caller marks deliveries finished with :meth:`done` after their outputs
  were flushed; :meth:`commit` flushes routed error records, then commits per
  partition one past the longest finished prefix (the NEXT offset to read,
  public case C29), so nothing still in flight is ever skipped on restart.
* On a rebalance the state of revoked partitions is forgotten; a stage commits
  after every poll, so only unfinished records are redelivered to the new owner
  (downstream is idempotent by rollout_id).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pyarrow as pa

from relax.schemas import topics as topic_names
from relax.schemas.validate import SchemaError, validate
from relax.streams.client import BusConfig, consumer_kwargs
from relax.streams.codec import DecodeError, decode
from relax.streams.errors import error_row
from relax.streams.offsets import OffsetTracker
from relax.streams.producer import BatchProducer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Delivery:
    """One decoded Kafka message.

    Attributes:
        topic, partition, offset: origin of the message.
        key: Kafka key bytes (e.g. the group_id), or None.
        table: the decoded rows, with the canonical v1 schema.
        headers: Kafka headers as a dict.
        timestamp_ms: broker/producer timestamp (ms since epoch).
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    table: pa.Table
    headers: dict[str, bytes]
    timestamp_ms: int


class BatchConsumer:
    """Consumes Arrow record batches from topics in a consumer group.

    Args:
        cfg: bus settings.
        group_id: consumer group (e.g. ``<run>.rollout``); None for a group-less reader
            that only uses :meth:`assign_all`.
        topics: topics to subscribe to.
        stage: name written into error records (e.g. ``reward.gsm8k``).
        from_beginning: where a group with no committed offset starts.
        validate_rows: run the full row validator (:func:`relax.schemas.validate`)
            in addition to the field/type check.
        error_producer: producer for error records (default: one of its own).
        on_assign / on_revoke: callbacks ``fn(list[TopicPartition])`` run inside
            :meth:`poll`, on the client's I/O thread, when the group hands partitions to
            / takes them from this instance; they must not block (record the change and
            act on it after ``poll`` returns).
    """

    def __init__(self, cfg: BusConfig, group_id: str | None, topics: list[str] | None = None, *,
                 stage: str, from_beginning: bool = True, validate_rows: bool = True,
                 error_producer: BatchProducer | None = None, client_id: str | None = None,
                 on_assign=None, on_revoke=None):
        from kafka import KafkaConsumer

        self.cfg, self.stage, self.validate_rows = cfg, stage, validate_rows
        self._kc = KafkaConsumer(**consumer_kwargs(cfg, group_id, client_id, from_beginning))
        self._tracker = OffsetTracker()
        self._errors = error_producer
        self._own_errors = error_producer is None
        self.routed_errors = 0
        self.on_assign, self.on_revoke = on_assign, on_revoke
        if topics:
            self._kc.subscribe(topics, listener=_Listener(self))

    @property
    def kafka(self):
        """The underlying ``kafka.KafkaConsumer`` (assignment, positions, seeks)."""
        return self._kc

    def _error_producer(self) -> BatchProducer:
        if self._errors is None:
            self._errors = BatchProducer(self.cfg, producer_id=f"{self.stage}-errors")
        return self._errors

    def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[Delivery]:
        """Fetch, decode and validate messages. Bad ones go to ``<topic>.errors`` and are
        marked finished; good ones are returned in offset order per partition and are
        in flight until :meth:`done`."""
        records = self._kc.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        decoded: list[tuple] = []
        for tp, msgs in records.items():
            for m in msgs:
                self._tracker.received(tp, m.offset)
                headers = {k: v for k, v in (m.headers or [])}
                try:
                    name = headers.get("relax-schema", b"").decode() or \
                        topic_names.schema_for_topic(m.topic)
                    decoded.append((tp, m, name, headers, decode(m.value, name)))
                except (DecodeError, SchemaError, UnicodeDecodeError, ValueError) as e:
                    self._route(m, e)
                    self._tracker.done(tp, m.offset)
        if self.validate_rows:
            decoded = self._validated(decoded)
        return [Delivery(m.topic, m.partition, m.offset, m.key, table, headers, m.timestamp)
                for tp, m, name, headers, table in decoded]

    def _validated(self, decoded: list[tuple]) -> list[tuple]:
        """Row-validate all tables of one schema at once (the common, valid case costs
        one pass); only if that fails, message by message to route the bad ones."""
        by_schema: dict[str, list[pa.Table]] = {}
        for _, _, name, _, table in decoded:
            by_schema.setdefault(name, []).append(table)
        bad_schemas = set()
        for name, tables in by_schema.items():
            try:
                validate(pa.concat_tables(tables), name)
            except SchemaError:
                bad_schemas.add(name)
        if not bad_schemas:
            return decoded
        good = []
        for item in decoded:
            tp, m, name, _, table = item
            if name in bad_schemas:
                try:
                    validate(table, name)
                except SchemaError as e:
                    self._route(m, e)
                    self._tracker.done(tp, m.offset)
                    continue
            good.append(item)
        return good

    def _route(self, m, e: Exception) -> None:
        self.routed_errors += 1
        log.warning("routing %s[%d]@%d to %s: %s", m.topic, m.partition, m.offset,
                    topic_names.errors_topic(m.topic), e)
        self._error_producer().send_errors(m.topic, [error_row(
            source_topic=m.topic, source_partition=m.partition, source_offset=m.offset,
            row=getattr(e, "row", None), stage=f"{self.stage}/decode",
            error=f"{type(e).__name__}: {e}", key=m.key, value=m.value,
            headers=list(m.headers or []))])

    def done(self, deliveries: Delivery | list[Delivery]) -> None:
        """Mark deliveries finished (their outputs are flushed)."""
        from kafka import TopicPartition

        for d in deliveries if isinstance(deliveries, list) else [deliveries]:
            self._tracker.done(TopicPartition(d.topic, d.partition), d.offset)

    def positions(self) -> dict[tuple[str, int], int]:
        """``{(topic, partition): next offset}`` of the finished prefix of each partition
        (what :meth:`commit` would commit, whether or not it was committed)."""
        return {(tp.topic, tp.partition): o for tp, o in self._tracker.positions().items()}

    def in_flight(self) -> int:
        """Deliveries handed out and not yet :meth:`done`."""
        return self._tracker.in_flight()

    def commit(self) -> dict:
        """Flush routed error records, then commit the next offset of each partition
        whose finished prefix advanced.

        Returns:
            ``{TopicPartition: committed next offset}`` (empty if nothing moved).
        """
        from kafka.errors import CommitFailedError
        from kafka.structs import OffsetAndMetadata

        if self._errors is not None:
            self._errors.flush()
        offsets = self._tracker.committable()
        assigned = self._kc.assignment()
        offsets = {tp: o for tp, o in offsets.items() if tp in assigned}
        if not offsets:
            return {}
        try:
            self._kc.commit({tp: OffsetAndMetadata(o, "", -1) for tp, o in offsets.items()})
        except CommitFailedError as e:  # group rebalanced: the new owner re-reads them
            log.warning("commit failed after a rebalance (records will be redelivered): %s", e)
            return {}
        self._tracker.mark_committed(offsets)
        return offsets

    def close(self) -> None:
        """Close the Kafka client (does not commit) and the error producer it owns."""
        self._kc.close(autocommit=False)
        if self._own_errors and self._errors is not None:
            self._errors.close()


def _Listener(owner: BatchConsumer):
    """A kafka-python rebalance listener: forgets revoked partitions and calls the
    owner's callbacks. It runs on the client's I/O thread, so it never blocks on the
    consumer (kafka-python 3 refuses a blocking commit there): stages commit after every
    poll, so nothing finished is left uncommitted at a rebalance; what is in flight is
    redelivered to the new owner (the trainer, which commits only with checkpoints,
    relies on exactly that)."""
    from kafka import ConsumerRebalanceListener

    class Listener(ConsumerRebalanceListener):
        def on_partitions_revoked(self, revoked):
            if revoked:
                owner._tracker.forget(revoked)
                if owner.on_revoke is not None:
                    owner.on_revoke(list(revoked))

        def on_partitions_assigned(self, assigned):
            if assigned and owner.on_assign is not None:
                owner.on_assign(list(assigned))

    return Listener()
