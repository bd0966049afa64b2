"""Reading topics group-less (no consumer group, no commits): :class:`TopicReader`,
the one group-less client of relax, and what is built on it: ``relax tail``,
``relax errors``, changelog recovery (:func:`read_partition`), the followers of
``<run>.weights``, ``<run>.progress`` and ``<run>.metrics``, the monitor, the archive.

Bounded reads go between an offset and the fetch high watermark, so they work the
same on every broker. Messages that do not decode (null values included) are
skipped or shown as such, never raised.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from relax.schemas import topics as topic_names
from relax.streams.client import BusConfig, consumer_kwargs
from relax.streams.codec import DecodeError, decode
from relax.streams.lag import high_watermarks


class TopicReader:
    """One group-less Kafka client for reading relax topics (no group, no commits): a
    bounded read of partition ranges (:meth:`read_range`), or following partitions as
    they grow (:meth:`follow` then :meth:`poll`). The one place the stages, the
    launcher, the monitor and the tools build a group-less consumer.

    Args:
        cfg: bus settings.
        name: part of the client id (``relax-<name>-<random>``), for the broker's logs.
        fetch_wait_ms: longest time the broker holds an empty fetch (default
            ``cfg.fetch_wait_ms``). A reader polled only when it needs an answer (not
            in a loop) loses nothing by a short one.
    """

    def __init__(self, cfg: BusConfig, name: str = "read", fetch_wait_ms: int | None = None):
        from kafka import KafkaConsumer

        kw = consumer_kwargs(cfg, None, f"relax-{name}-{uuid.uuid4().hex[:6]}")
        if fetch_wait_ms is not None:
            kw["fetch_max_wait_ms"] = fetch_wait_ms
        self._kc = KafkaConsumer(**kw)

    def read_range(self, todo: dict[tuple[str, int], tuple[int, int]],
                   timeout_s: float = 30.0) -> Iterator:
        """Yield the records of each ``(topic, partition)`` from ``start`` up to ``end``
        (exclusive; ``{(topic, partition): (start, end)}``), in offset order within a
        partition.

        Raises:
            TimeoutError: no record arrived for ``timeout_s`` while some partition was
                not yet read to its end (names them).
        """
        from kafka import TopicPartition

        left = {TopicPartition(t, p): end for (t, p), (start, end) in todo.items() if end > start}
        if not left:
            return
        c = self._kc
        c.assign(list(left))
        c.resume(*left)  # kafka-python keeps a paused state when the assignment is unchanged
        for tp in left:
            c.seek(tp, todo[(tp.topic, tp.partition)][0])
        deadline = time.monotonic() + timeout_s
        while left:
            if time.monotonic() > deadline:
                names = sorted(f"{tp.topic}[{tp.partition}]" for tp in left)
                raise TimeoutError(f"reading {', '.join(names)}: no record for {timeout_s}s "
                                   f"before the end")
            polled = c.poll(timeout_ms=200)
            if polled:
                deadline = time.monotonic() + timeout_s
            for tp, msgs in polled.items():
                end = left.get(tp)
                if end is None:
                    continue
                for m in msgs:
                    if m.offset < end:
                        yield m
                if c.position(tp) >= end:
                    left.pop(tp)
                    c.pause(tp)

    def follow(self, topic: str, partitions: int, from_beginning: bool = True) -> None:
        """Read partitions ``0..partitions-1`` of ``topic`` from the start (or the end) on
        every later :meth:`poll`."""
        from kafka import TopicPartition

        tps = [TopicPartition(topic, p) for p in range(partitions)]
        self._kc.assign(tps)
        self._kc.resume(*tps)  # paused by an earlier read_range of the same partitions
        if from_beginning:
            self._kc.seek_to_beginning(*tps)
        else:
            self._kc.seek_to_end(*tps)

    def log_end(self, topic: str, partition: int = 0, timeout_s: float = 10.0) -> int:
        """The partition's end offset from ListOffsets on this client's connection (~2 ms,
        no new client; but a broker answers a connection's requests in order, so on a
        client that also follows partitions it waits behind the pending fetch, up to
        ``cfg.fetch_wait_ms``: keep a separate, idle reader for it).

        Raises:
            kafka.errors.KafkaError: no answer within ``timeout_s`` (``KafkaTimeoutError``),
                or another client error.
        """
        from kafka import TopicPartition

        tp = TopicPartition(topic, partition)
        return int(self._kc.end_offsets([tp], timeout_ms=int(timeout_s * 1000))[tp])

    def poll(self, timeout_s: float = 0.0) -> list:
        """The records that arrived on the followed partitions (waiting up to
        ``timeout_s``), in offset order within a partition."""
        return [m for msgs in self._kc.poll(timeout_ms=int(timeout_s * 1000)).values()
                for m in msgs]

    def close(self) -> None:
        """Close the Kafka client."""
        self._kc.close(autocommit=False)


def read_messages(cfg: BusConfig, topic: str, start: dict[int, int] | None = None,
                  timeout_s: float = 30.0):
    """Every message of ``topic`` from ``start`` (``{partition: offset}``, default 0) up
    to the high watermark at call time, as kafka-python ConsumerRecords sorted by
    (timestamp, partition, offset).

    Raises:
        TimeoutError: see :meth:`TopicReader.read_range`.
    """
    start = start or {}
    todo = {(t, p): (start.get(p, 0), hw) for (t, p), hw in high_watermarks(cfg, [topic]).items()}
    reader = TopicReader(cfg)
    try:
        out = list(reader.read_range(todo, timeout_s))
    finally:
        reader.close()
    out.sort(key=lambda m: (m.timestamp, m.partition, m.offset))
    return out


def read_partition(cfg: BusConfig, topic: str, partition: int, start: int = 0,
                   timeout_s: float = 60.0) -> Iterator:
    """Yield the records of ``topic[partition]`` from ``start`` up to the high watermark
    at call time, in offset order: the recovery of partition-local state.

    Stages with state (the aggregator) write every state change to a changelog topic
    partition that mirrors their input partition, and rebuild the state of a partition
    when the consumer group assigns it to them by reading that changelog partition from
    the start to its high watermark. The end is the *fetch* high watermark, which is
    right on every broker; faust's table recovery reads to ``end_offsets``
    (ListOffsets), which some Kafka-protocol brokers answer with the last record batch's
    base offset + 1, so it would stop early and lose state (measured on one: 7 records in
    one batch -> end_offsets 1, fetch high watermark 7).

    Raises:
        TimeoutError: see :meth:`TopicReader.read_range`.
    """
    end = high_watermarks(cfg, [topic]).get((topic, partition), 0)
    reader = TopicReader(cfg, "changelog")
    try:
        yield from reader.read_range({(topic, partition): (start, end)}, timeout_s)
    finally:
        reader.close()


def decoded_rows(m, name: str, log_to: logging.Logger | None = None) -> list[dict]:
    """The rows of message ``m`` (schema ``name``), or [] when it does not decode (see
    :func:`decode_or_reason`); logged with its ``topic[partition]@offset`` and the reason
    when ``log_to`` is given."""
    table, why = decode_or_reason(m, name)
    if table is None:
        if log_to is not None:
            log_to.warning("skipping %s[%d]@%d: %s; expected a %r batch", m.topic, m.partition,
                           m.offset, why, name)
        return []
    return table.to_pylist()


def read_table(cfg: BusConfig, topic: str, schema: str | None = None) -> pa.Table:
    """Every row of ``topic`` (up to the high watermark now) as one table; messages that
    do not decode are skipped (they are in the error topic of whoever consumed them)."""
    name = schema or topic_names.schema_for_topic(topic)
    tables = []
    for m in read_messages(cfg, topic):
        table = decoded(m, name)
        if table is not None:
            tables.append(table)
    if not tables:
        from relax.schemas.v1 import get_schema

        return get_schema(name).empty_table()
    return pa.concat_tables(tables)


def read_last_rows(cfg: BusConfig, topic: str, n: int) -> list[dict]:
    """The last ``n`` rows of ``topic`` as Python dicts (oldest first). Reads at most the
    last ``n`` messages of each partition."""
    ends = {p: hw for (t, p), hw in high_watermarks(cfg, [topic]).items()}
    start = {p: max(0, hw - n) for p, hw in ends.items()}
    name = topic_names.schema_for_topic(topic)
    rows: list[dict] = []
    for m in read_messages(cfg, topic, start):
        table = decoded(m, name)
        if table is not None:
            rows.extend(table.to_pylist())
        else:
            rows.append({"offset": m.offset, "partition": m.partition,
                         "undecodable_bytes": None if m.value is None else len(m.value)})
    return rows[-n:] if n else rows


def read_reward_errors(cfg: BusConfig, topic: str, n: int | None = None) -> tuple[list[dict], int]:
    """The rows of a ``rewards`` topic whose ``error`` is set (exception, NaN, memory limit,
    timeout: the reward stage records them as rows, not in ``<topic>.errors``).

    Reads the whole topic (up to the high watermark now); messages that do not decode
    are skipped.

    Args:
        cfg: bus settings.
        topic: a ``<run>.rewards`` topic.
        n: keep the last ``n`` failed rows (None: all).

    Returns:
        ``(rows, total)``: ``rows`` oldest first (by message timestamp), each shaped like
        an ``errors`` record (``ts`` as a UTC datetime, ``source_topic``,
        ``source_partition``, ``source_offset``, ``row`` within the message, ``stage`` =
        ``reward.<reward_name>``, ``error``) plus ``rollout_id``, ``group_id`` and
        ``reward_name``; ``total`` counts every failed row of the topic.
    """
    rows: list[dict] = []
    for m in read_messages(cfg, topic):
        table = decoded(m, "rewards")
        if table is None:
            continue
        failed = pc.indices_nonzero(pc.is_valid(table.column("error"))).to_pylist()
        if not failed:
            continue
        ts = dt.datetime.fromtimestamp(m.timestamp / 1000, tz=dt.UTC)
        picked = table.take(pa.array(failed)).select(
            ["rollout_id", "group_id", "reward_name", "error"]).to_pylist()
        for i, r in zip(failed, picked):
            rows.append({"ts": ts, "source_topic": m.topic, "source_partition": m.partition,
                         "source_offset": m.offset, "row": i,
                         "stage": f"reward.{r['reward_name']}", "error": r["error"],
                         "rollout_id": r["rollout_id"], "group_id": r["group_id"],
                         "reward_name": r["reward_name"]})
    total = len(rows)
    return (rows[-n:] if n else rows), total


def decoded(m, name: str) -> pa.Table | None:
    """Message ``m`` as a table of schema ``name``, or None if it does not decode (see
    :func:`decode_or_reason`): a message the stages route to ``<topic>.errors`` is no
    row here either."""
    return decode_or_reason(m, name)[0]


def decode_or_reason(m, name: str) -> tuple[pa.Table | None, str | None]:
    """``(table, None)`` for a message that decodes as schema ``name``, else ``(None,
    why)``: a null value (a tombstone), an empty value, a ``relax-schema`` header naming
    another schema, not Arrow, another schema, corrupt buffers."""
    if m.value is None:
        return None, "null value (a tombstone)"
    if not m.value:
        return None, "empty value"
    header = dict(m.headers or []).get("relax-schema")
    if header and header != name.encode():
        return None, f"relax-schema header {header!r} is not {name!r}"
    try:
        table = decode(m.value, name)
        table.validate(full=True)  # corrupt buffers would crash to_pylist, not raise
        return table, None
    except (DecodeError, ValueError, KeyError, pa.ArrowException) as e:
        return None, f"{type(e).__name__}: {e}"
