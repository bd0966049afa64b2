"""Record batches off topics, in a consumer group, with commits that never run ahead.

Contract (at-least-once):

* :meth:`BatchConsumer.poll` decodes each Kafka message into a
  :class:`Delivery` (an Arrow table plus its origin, with the schema of its
  topic). A message a stage cannot use is routed to ``<topic>.errors`` (with
  the bytes, key, headers, topic, partition, offset and a reason naming
  ``topic[partition]@offset`` and what was expected), is marked finished and
  never reaches the caller; the stage goes on. Unusable means: a null value (a
  tombstone) or an empty one; bytes that are not a valid Arrow IPC stream
  (buffers are fully validated, so corrupt bytes cannot crash a stage later);
  a ``relax-schema`` header that is not UTF-8, names no v1 schema, or names a
  schema the topic does not carry; no header on a topic that carries several
  schemas; an Arrow schema other than the expected one (e.g. a ``rewards``
  batch on ``<run>.rollouts``); rows that fail :func:`relax.schemas.validate`.
* Which schemas a topic carries: :func:`topic_schemas` (one per topic from
  :func:`relax.schemas.topics.schema_for_topic`; the aggregator's changelog
  carries its input schemas, so its messages need the header).
* The caller marks deliveries finished with :meth:`done` after their outputs
  were flushed; :meth:`commit` flushes routed error records, then commits per
  partition one past the longest finished prefix (the NEXT offset to read,
  public case C29), so nothing still in flight is ever skipped on restart.
* On a rebalance the state of revoked partitions is forgotten; a stage commits
  after every poll, so only unfinished records are redelivered to the new owner
  (downstream is idempotent by rollout_id).
* Losses are never silent: records deleted by retention before they were read (the
  consumer group's committed offset below the partition's log start when the partition
  is handed to this consumer, or a jump past deleted records while it reads) are
  counted (:attr:`BatchConsumer.lost_to_retention`), logged as a WARNING naming topic,
  partition, committed offset, log start and count, and written as the metric
  ``lost_to_retention`` (:mod:`relax.streams.retention`). The consumer goes on from
  the log start.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import pyarrow as pa

from relax.schemas import metric_names as M
from relax.schemas import topics as topic_names
from relax.schemas.v1 import SCHEMAS, schema_name
from relax.schemas.validate import SchemaError, validate
from relax.streams.client import BusConfig, consumer_kwargs
from relax.streams.codec import DecodeError, decode
from relax.streams.errors import error_row
from relax.streams.offsets import OffsetTracker
from relax.streams.producer import BatchProducer
from relax.streams.retention import RetentionLoss, lost_to_retention

log = logging.getLogger(__name__)

SCHEMA_HEADER = "relax-schema"

OUTAGE_S = 60.0
"""How long :meth:`BatchConsumer.commit` retries, and :meth:`BatchConsumer.poll` rides
through, a retriable error (the broker or the group coordinator unreachable: a Kafka
node restarting takes ~10 s here) before it raises. The trainer commits with its
checkpoint; a commit that fails during an outage would otherwise restart the stage
after a checkpoint whose step's metrics were not yet written. kafka-python 3.0 raises a
failed metadata refresh (``KafkaConnectionError``) out of ``KafkaConsumer.poll`` while it
looks for the group coordinator (a CI run restarted a reward stage so)."""

_CHANGELOG_SCHEMAS = (topic_names.ROLLOUTS, topic_names.REWARDS, topic_names.REF_LOGPROBS)
"""Schemas of ``<run>.aggregate_changelog``: the aggregator's input rows (its ``emitted``
markers are not Arrow: the changelog is read by ``streams/read.py::read_partition``, not here)."""


def topic_schemas(topic: str) -> tuple[str, ...] | None:
    """The v1 schema names messages on ``topic`` may have.

    Returns:
        ``(name,)`` for a relax topic (:func:`relax.schemas.topics.schema_for_topic`),
        the aggregator's input schemas for ``<run>.aggregate_changelog``, and None for a
        topic whose name tells no schema (its messages must name one in the header).
    """
    if topic.endswith("." + topic_names.AGGREGATE_CHANGELOG):
        return _CHANGELOG_SCHEMAS
    try:
        return (topic_names.schema_for_topic(topic),)
    except ValueError:
        return None


class Unusable(ValueError):
    """A message a stage cannot use; the text names ``topic[partition]@offset``, what is
    wrong and what was expected (it becomes the ``error`` of the error record)."""


@dataclass(frozen=True)
class Delivery:
    """One decoded Kafka message.

    Attributes:
        topic, partition, offset: origin of the message.
        key: Kafka key bytes (e.g. the group_id), or None.
        table: the decoded rows, with the canonical v1 schema.
        headers: Kafka headers as a dict.
        timestamp_ms: broker/producer timestamp (ms since epoch).
        generation: how many times its partition had been revoked from this consumer when
            it was handed out (a delivery of an older generation belongs to another owner
            now: finishing it changes nothing).
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    table: pa.Table
    headers: dict[str, bytes]
    timestamp_ms: int
    generation: int = 0


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
        metrics: the stage's :class:`~relax.streams.metrics.MetricsWriter`: a loss to
            retention becomes a ``lost_to_retention`` row (queued on its producer, sent
            with the stage's next flush); None writes none (the WARNING and
            :attr:`lost_to_retention` stay).

    Attributes:
        routed_errors: messages routed to ``<topic>.errors`` so far.
        lost_to_retention: records deleted by retention before this consumer read them
            (Kafka offsets, summed over partitions; module docstring).
    """

    def __init__(self, cfg: BusConfig, group_id: str | None, topics: list[str] | None = None, *,
                 stage: str, from_beginning: bool = True, validate_rows: bool = True,
                 error_producer: BatchProducer | None = None, client_id: str | None = None,
                 on_assign=None, on_revoke=None, metrics=None):
        from kafka import KafkaConsumer

        self.cfg, self.stage, self.validate_rows = cfg, stage, validate_rows
        self.group_id, self._metrics = group_id, metrics
        self._kc = KafkaConsumer(**consumer_kwargs(cfg, group_id, client_id, from_beginning))
        self._from_beginning = from_beginning
        self._tracker = OffsetTracker()
        self._errors = error_producer
        self._own_errors = error_producer is None
        self.routed_errors = 0
        self._topic_schemas: dict[str, tuple[str, ...] | None] = {}
        self.on_assign, self.on_revoke = on_assign, on_revoke
        self._revocations: dict = {}  # TopicPartition -> times revoked from this consumer
        self._away_since: float | None = None  # monotonic time of the first failed poll
        self.lost_to_retention = 0
        self._next: dict = {}  # TopicPartition -> next offset to read, where known
        self._handed: set = set()  # partitions handed over, committed offset not yet checked
        # partitions revoked by the rebalance in progress, and those it handed straight
        # back (kept): read again from the committed offset (:meth:`_check_handed`)
        self._revoking: set = set()
        self._kept: set = set()
        self._handed_lock = threading.Lock()  # the listener adds on the client's I/O thread
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
        """Fetch, decode and validate messages.

        Bad ones (see the module docstring) go to ``<topic>.errors`` and are marked
        finished; good ones are returned in offset order per partition, each table with
        the canonical v1 schema of its topic, and are in flight until :meth:`done`.
        Raises nothing for the content of a message; a retriable client error (the
        broker away) is an empty poll for up to :data:`OUTAGE_S`.

        Raises:
            kafka.errors.KafkaError: a non-retriable one, or the broker away for longer.
        """
        from kafka.errors import KafkaError

        try:
            records = self._kc.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        except KafkaError as e:
            now = time.monotonic()
            self._away_since = self._away_since or now
            if not e.retriable or now - self._away_since > OUTAGE_S:
                raise
            log.warning("poll failed (%s); an empty poll (the broker away for %.0fs)", e,
                        now - self._away_since)
            time.sleep(min(timeout_s, 1.0))  # what the poll would have waited
            return []
        self._away_since = None
        withheld = self._check_handed()
        if withheld:  # fetched from a kept partition's old position: they come again
            records = {tp: msgs for tp, msgs in records.items() if tp not in withheld}
        for tp, msgs in records.items():
            if msgs:
                self._check_gap(tp, msgs[0].offset)
                self._next[tp] = msgs[-1].offset + 1
        decoded: list[tuple] = []
        for tp, msgs in records.items():
            for m in msgs:
                self._tracker.received(tp, m.offset)
                headers = {k: v for k, v in (m.headers or [])}
                try:
                    name = self._schema_of(m, headers)
                    decoded.append((tp, m, name, headers, _decode(m, name)))
                except Unusable as e:
                    self._route(m, str(e))
                    self._tracker.done(tp, m.offset)
        if self.validate_rows:
            decoded = self._validated(decoded)
        return [Delivery(m.topic, m.partition, m.offset, m.key, table, headers, m.timestamp,
                         self._revocations.get(tp, 0))
                for tp, m, name, headers, table in decoded]

    def _check_handed(self) -> set:
        """For partitions handed to this consumer since the last poll: compare the
        group's committed offset with the log start (records below it were deleted by
        retention before the group read them), and place each *kept* partition (revoked
        by a rebalance and handed straight back) at the group's committed offset.

        Why: the group rebalances eagerly (every partition revoked, then assigned), and
        relax reads a revoked partition as gone: the consumer forgets its offsets in
        flight, :meth:`done` ignores its old deliveries, stages drop what they queued
        from it (the rollout its prompt queue), and the records come again from the
        committed offset. kafka-python 3.0 keeps a kept partition's fetch position
        instead, so those records never came again to this consumer: a rollout that
        kept its prompt partition through a rebalance sampled none of the prompts it
        had queued (``test_a_fast_instance_takes_the_credit_a_slow_one_leaves``: 0 of
        8 groups; the CI failure of stop 61), and later commits could pass them.

        Returns:
            the kept partitions whose records fetched by this poll must be dropped
            (read again from the committed offset). A retriable error (the broker away)
            leaves the checks for the next poll, and withholds the kept partitions
            until then.
        """
        from kafka.errors import KafkaError

        assigned = self._kc.assignment()
        with self._handed_lock:
            handed, self._handed = self._handed, set()
            kept, self._kept = self._kept & assigned, set()
        tps = sorted((handed | kept) & assigned)
        if not tps:
            return set()
        try:
            committed = {tp: self._kc.committed(tp) for tp in tps}
            starts = self._kc.beginning_offsets(tps)
        except KafkaError as e:
            if not e.retriable:
                raise
            log.warning("could not compare committed offsets with log starts (%s); "
                        "trying again at the next poll", e)
            with self._handed_lock:
                self._handed |= handed
                self._kept |= kept
            return kept
        for tp in tps:
            c, start = committed[tp], starts[tp]
            self._report(tp, c, start, committed=True)
            if c is not None:
                self._next[tp] = max(c, start)
        for tp in kept:
            c = committed[tp]
            if c is not None:
                self._kc.seek(tp, max(c, starts[tp]))
            elif self._from_beginning:
                self._kc.seek_to_beginning(tp)
            else:
                self._kc.seek_to_end(tp)
            log.info("%s: %s[%d] kept through a rebalance: read again from %s", self.stage,
                     tp.topic, tp.partition, "the start" if c is None else f"offset {c}")
        return kept

    def _check_gap(self, tp, first: int) -> None:
        """Records of ``tp`` start at ``first``, past the next offset this consumer was to
        read: if the log start moved past that offset, retention deleted the records in
        between (kafka-python reset the position to the log start). A gap of a compacted
        topic, or a seek, leaves the log start where it was: nothing is counted."""
        from kafka.errors import KafkaError

        expected = self._next.get(tp)
        if expected is None or first <= expected:
            return
        try:
            start = self._kc.beginning_offsets([tp])[tp]
        except KafkaError as e:
            if not e.retriable:
                raise
            log.warning("could not read the log start of %s[%d] after a jump from offset %d "
                        "to %d (%s): not counted", tp.topic, tp.partition, expected, first, e)
            return
        self._report(tp, expected, min(start, first), committed=False)

    def _report(self, tp, next_offset: int | None, log_start: int, *, committed: bool) -> None:
        """Count, log and write (as a metric) the records of ``tp`` between
        ``next_offset`` (the group's committed offset, or the position) and
        ``log_start``, if any."""
        lost = lost_to_retention(next_offset, log_start)
        if not lost:
            return
        loss = RetentionLoss(tp.topic, tp.partition, next_offset, log_start, lost, committed)
        self.lost_to_retention += lost
        log.warning("%s", loss.message(self.stage, self.group_id))
        if self._metrics is not None:
            self._metrics.add(M.LOST_TO_RETENTION, lost)
            self._metrics.flush()

    def _schema_of(self, m, headers: dict[str, bytes]) -> str:
        """The schema a message must have: the ``relax-schema`` header if it names one the
        topic carries, else the topic's only schema.

        Raises:
            Unusable: null or empty value, or a header the topic cannot carry.
        """
        allowed = self._topic_schemas.get(m.topic, False)
        if allowed is False:
            allowed = self._topic_schemas[m.topic] = topic_schemas(m.topic)
        where = f"{m.topic}[{m.partition}]@{m.offset}"
        expected = _expected(allowed)
        if m.value is None:
            raise Unusable(f"{where}: null value (a tombstone): expected an Arrow IPC stream "
                           f"of schema {expected}")
        if not m.value:
            raise Unusable(f"{where}: empty value: expected an Arrow IPC stream of schema "
                           f"{expected}")
        raw = headers.get(SCHEMA_HEADER)
        if not raw:
            if allowed is None or len(allowed) > 1:
                why = "names no schema" if allowed is None else "carries several schemas"
                raise Unusable(f"{where}: no {SCHEMA_HEADER} header: topic {m.topic} {why}, "
                               f"expected a header naming {expected}")
            return allowed[0]
        try:
            name = raw.decode()
        except UnicodeDecodeError:
            raise Unusable(f"{where}: {SCHEMA_HEADER} header {raw!r} is not UTF-8: expected "
                           f"{expected}") from None
        if name not in SCHEMAS:
            raise Unusable(f"{where}: {SCHEMA_HEADER} header names an unknown schema {name!r}: "
                           f"expected {expected}; known schemas: {', '.join(SCHEMAS)}")
        if allowed is not None and name not in allowed:
            what = "the schema" if len(allowed) == 1 else "a schema"
            raise Unusable(f"{where}: schema header {name!r} is not {what} of topic {m.topic}: "
                           f"expected {expected}")
        return name

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
                    self._route(m, f"{m.topic}[{m.partition}]@{m.offset}: rows fail the "
                                   f"{name!r} checks: {e}", row=e.row)
                    self._tracker.done(tp, m.offset)
                    continue
            good.append(item)
        return good

    def _route(self, m, reason: str, row: int | None = None) -> None:
        self.routed_errors += 1
        log.warning("routing %s[%d]@%d to %s: %s", m.topic, m.partition, m.offset,
                    topic_names.errors_topic(m.topic), reason)
        self._error_producer().send_errors(m.topic, [error_row(
            source_topic=m.topic, source_partition=m.partition, source_offset=m.offset,
            row=row, stage=f"{self.stage}/decode", error=reason, key=m.key, value=m.value,
            headers=list(m.headers or []))])

    def done(self, deliveries: Delivery | list[Delivery]) -> None:
        """Mark deliveries finished (their outputs are flushed); those of a partition
        revoked since they were handed out are ignored (see :attr:`Delivery.generation`).

        Raises:
            KeyError: a delivery of a current generation that is not in flight.
        """
        from kafka import TopicPartition

        for d in deliveries if isinstance(deliveries, list) else [deliveries]:
            tp = TopicPartition(d.topic, d.partition)
            if d.generation != self._revocations.get(tp, 0):
                # its partition was revoked since: the new owner reads it again from the
                # committed offset, so there is nothing of it left to commit here
                continue
            self._tracker.done(tp, d.offset)

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
            ``{TopicPartition: committed next offset}`` (empty if nothing moved, or the
            group rebalanced).

        Raises:
            kafka.errors.KafkaError: a non-retriable error, or a retriable one (the
                broker unreachable) that lasted past :data:`OUTAGE_S`.
        """
        from kafka.errors import CommitFailedError, KafkaError, RebalanceInProgressError
        from kafka.structs import OffsetAndMetadata

        if self._errors is not None:  # routed by whichever thread polled
            self._errors.flush(every_thread=True)
        offsets = self._tracker.committable()
        assigned = self._kc.assignment()
        offsets = {tp: o for tp, o in offsets.items() if tp in assigned}
        if not offsets:
            return {}
        deadline = time.monotonic() + OUTAGE_S
        while True:
            try:
                self._kc.commit({tp: OffsetAndMetadata(o, "", -1) for tp, o in offsets.items()})
                break
            except CommitFailedError as e:  # group rebalanced: the new owner re-reads them
                log.warning("commit failed after a rebalance (records will be redelivered): %s",
                            e)
                return {}
            except RebalanceInProgressError as e:
                # a member joined or left (a broker answers a commit with this while the
                # group rebalances; kafka-python raises it as not retriable): the offsets stay
                # committable, for the next commit once this member holds its partitions
                # again, or the new owner re-reads them
                log.warning("commit skipped: the group is rebalancing (%s)", e)
                return {}
            except KafkaError as e:  # a broker restarting: its log is durable, wait for it
                if not e.retriable or time.monotonic() > deadline:
                    raise
                log.warning("commit failed (%s); retrying for up to %.0fs more", e,
                            deadline - time.monotonic())
                time.sleep(1.0)
        self._tracker.mark_committed(offsets)
        return offsets

    def close(self) -> None:
        """Close the Kafka client (does not commit) and the error producer it owns."""
        self._kc.close(autocommit=False)
        if self._own_errors and self._errors is not None:
            self._errors.close()


def _expected(allowed: tuple[str, ...] | None) -> str:
    if allowed is None:
        return "one of " + ", ".join(repr(n) for n in SCHEMAS)
    if len(allowed) == 1:
        return repr(allowed[0])
    return "one of " + ", ".join(repr(n) for n in allowed)


def _decode(m, name: str) -> pa.Table:
    """The value of message ``m`` as a table of schema ``name``, every buffer validated.

    Raises:
        Unusable: the bytes are not a valid Arrow IPC stream, or its schema is not ``name``.
    """
    where = f"{m.topic}[{m.partition}]@{m.offset}"
    try:
        return decode(m.value, name)  # every buffer validated there
    except SchemaError as e:
        reason = e
    except DecodeError as e:
        raise Unusable(f"{where}: undecodable bytes: {type(e).__name__}: {e}; expected an "
                       f"Arrow IPC stream of schema {name!r}") from None
    got = _stream_schema_name(m.value)
    other = f", got a {got!r} batch" if got and got != name else ""
    raise Unusable(f"{where}: the Arrow schema does not match: expected {name!r}{other} "
                   f"({reason})")


def _stream_schema_name(value: bytes) -> str | None:
    """The ``relax.schema`` name in the schema message of an IPC stream, or None."""
    try:
        return schema_name(pa.ipc.open_stream(pa.py_buffer(value)).schema)
    except (pa.ArrowException, OSError, UnicodeDecodeError):
        return None


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
                with owner._handed_lock:
                    owner._handed -= set(revoked)
                    owner._revoking |= set(revoked)
                    for tp in revoked:
                        owner._next.pop(tp, None)
                for tp in revoked:
                    owner._revocations[tp] = owner._revocations.get(tp, 0) + 1
                if owner.on_revoke is not None:
                    owner.on_revoke(list(revoked))

        def on_partitions_assigned(self, assigned):
            with owner._handed_lock:  # checked after the poll (it must not block here)
                owner._handed |= set(assigned)
                owner._kept |= set(assigned) & owner._revoking
                owner._revoking = set()
            if assigned and owner.on_assign is not None:
                owner.on_assign(list(assigned))

    return Listener()
