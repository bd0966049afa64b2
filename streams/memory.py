"""An in-memory bus with the interface the stage loop uses, for fast unit tests of stage
logic (:mod:`relax.streams.stage`): :class:`MemoryProducer` and :class:`MemoryConsumer`
stand in for :class:`~relax.streams.producer.BatchProducer` and
:class:`~relax.streams.consumer.BatchConsumer`.

What is the same as on a broker: tables are keyed by their schema's key column and a
key always lands in the same partition; a send becomes visible only at
:meth:`MemoryProducer.flush` (the acknowledgement); a consumer group's committed offset
is the next one to read, and commits follow the same rule (the finished prefix,
:class:`~relax.streams.offsets.OffsetTracker`); error rows go to ``<topic>.errors``.
What is not: no bytes (tables are kept as tables, nothing is encoded or validated), no
rebalances (one consumer per group owns every partition), no network. Tests of the bus
itself, of delivery under failures and of every stage end to end talk to a real broker.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field

import pyarrow as pa

from relax.schemas import topics as topic_names
from relax.streams.codec import group_by_key
from relax.streams.consumer import Delivery
from relax.streams.errors import error_batch
from relax.streams.offsets import OffsetTracker
from relax.streams.producer import KEY_COLUMNS


@dataclass
class MemoryBus:
    """Topics as lists of deliveries: ``topics[topic][partition]`` in offset order, and the
    committed offsets ``committed[(group, topic, partition)]``.

    Args:
        partitions: partitions of a topic created by its first send.
    """

    partitions: int = 1
    topics: dict[str, list[list[Delivery]]] = field(default_factory=dict)
    committed: dict[tuple[str, str, int], int] = field(default_factory=dict)

    def create(self, topic: str, partitions: int | None = None) -> None:
        """Create ``topic`` with ``partitions`` (default :attr:`partitions`) if missing."""
        self.topics.setdefault(topic, [[] for _ in range(partitions or self.partitions)])

    def table(self, topic: str) -> pa.Table | None:
        """Every row of ``topic`` (partition by partition, in offset order), or None when
        it holds nothing."""
        tables = [d.table for part in self.topics.get(topic, []) for d in part]
        return pa.concat_tables(tables) if tables else None


class MemoryProducer:
    """Queues tables for a :class:`MemoryBus`; :meth:`flush` makes them visible.

    Attributes:
        fail_flush: when set, the next :meth:`flush` raises it and drops what was queued
            (an unacknowledged send), to test that nothing is committed after it.
    """

    def __init__(self, bus: MemoryBus):
        self.bus = bus
        self._queued: list[tuple[str, int | None, bytes | None, pa.Table, dict]] = []
        self.fail_flush: Exception | None = None

    def send(self, topic: str, batch: pa.RecordBatch | pa.Table, *, schema: str | None = None,
             key: str | bytes | None = None, partition: int | None = None,
             headers: list[tuple[str, bytes]] | None = None) -> int:
        """Queue ``batch`` (``[N rows]``) like :meth:`BatchProducer.send`: one message per
        key of the schema's key column; returns the messages queued."""
        schema = schema or topic_names.schema_for_topic(topic)
        table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
        if table.num_rows == 0:
            return 0
        key_col = KEY_COLUMNS.get(schema)
        parts = [(key, table)] if key is not None or key_col is None else group_by_key(table, key_col)
        hdrs = {"relax-schema": schema.encode(), **dict(headers or [])}
        for k, part in parts:
            kb = k.encode() if isinstance(k, str) else k
            self._queued.append((topic, partition, kb, part, hdrs))
        return len(parts)

    def send_value(self, topic: str, value: bytes, key: bytes | None = None,
                   headers: list[tuple[str, bytes]] | None = None,
                   partition: int | None = None) -> None:
        """Queue a raw value as a one-row table of column ``value`` (markers, state)."""
        self._queued.append((topic, partition, key, pa.table({"value": [value]}),
                             dict(headers or [])))

    def send_errors(self, topic: str, rows: list[dict]) -> None:
        """Queue error rows to ``<topic>.errors``."""
        for row in rows:
            self.send(topic_names.errors_topic(topic), error_batch([row]), schema="errors",
                      key=row.get("key"))

    def flush(self, timeout_s: float = 60.0, every_thread: bool = False) -> int:
        """Append what was queued to the bus; returns the messages appended.

        Raises:
            :attr:`fail_flush`, once, when set (what was queued is lost).
        """
        queued, self._queued = self._queued, []
        if self.fail_flush is not None:
            err, self.fail_flush = self.fail_flush, None
            raise err
        for topic, partition, key, table, headers in queued:
            self.bus.create(topic)
            parts = self.bus.topics[topic]
            p = partition if partition is not None else (
                zlib.crc32(key) % len(parts) if key is not None else 0)
            parts[p].append(Delivery(topic, p, len(parts[p]), key, table, headers,
                                     int(time.time() * 1000)))
        return len(queued)

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush."""
        self.flush()


class MemoryConsumer:
    """A consumer group's only member on a :class:`MemoryBus`: reads every partition of
    ``topics`` from the group's committed offsets (0 when none).

    Args:
        bus: the bus.
        group_id: the consumer group.
        topics: topics to read.
        stage: unused (the interface's).
    """

    def __init__(self, bus: MemoryBus, group_id: str, topics: list[str], *, stage: str = ""):
        self.bus, self.group, self.topics_ = bus, group_id, list(topics)
        self._tracker = OffsetTracker()
        self._next: dict[tuple[str, int], int] = {}

    def poll(self, timeout_s: float = 0.0, max_records: int | None = None) -> list[Delivery]:
        """The next deliveries (up to ``max_records``), in flight until :meth:`done`."""
        out: list[Delivery] = []
        for t in self.topics_:
            self.bus.create(t)
            for p, part in enumerate(self.bus.topics[t]):
                pos = self._next.setdefault((t, p), self.bus.committed.get((self.group, t, p), 0))
                for d in part[pos:]:
                    if max_records is not None and len(out) >= max_records:
                        return out
                    self._tracker.received((t, p), d.offset)
                    self._next[(t, p)] = d.offset + 1
                    out.append(d)
        return out

    def done(self, deliveries: Delivery | list[Delivery]) -> None:
        """Mark deliveries finished."""
        for d in deliveries if isinstance(deliveries, list) else [deliveries]:
            self._tracker.done((d.topic, d.partition), d.offset)

    def commit(self) -> dict:
        """Commit the finished prefix of each partition; returns ``{(topic, partition):
        next offset}`` of what moved."""
        offsets = self._tracker.committable()
        for (t, p), o in offsets.items():
            self.bus.committed[(self.group, t, p)] = o
        self._tracker.mark_committed(offsets)
        return offsets

    def close(self) -> None:
        """Nothing to release."""
