"""Reading rows back from a topic for people: ``relax tail``, ``relax errors``, tests.

Group-less (no commits): partitions are assigned and read between an offset and
the high watermark, so it works the same on every broker. Messages that do not
decode (null values included) are skipped or shown as such, never raised.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid

import pyarrow as pa
import pyarrow.compute as pc

from relax.schemas import topics as topic_names
from relax.streams.client import BusConfig, consumer_kwargs
from relax.streams.codec import DecodeError, decode
from relax.streams.lag import high_watermarks


def read_messages(cfg: BusConfig, topic: str, start: dict[int, int] | None = None,
                  timeout_s: float = 30.0):
    """Every message of ``topic`` from ``start`` (``{partition: offset}``, default 0) up
    to the high watermark at call time, as kafka-python ConsumerRecords sorted by
    (timestamp, partition, offset)."""
    from kafka import KafkaConsumer, TopicPartition

    ends = {p: hw for (t, p), hw in high_watermarks(cfg, [topic]).items()}
    start = start or {}
    todo = {p: hw for p, hw in ends.items() if hw > start.get(p, 0)}
    if not todo:
        return []
    c = KafkaConsumer(**consumer_kwargs(cfg, None, f"relax-read-{uuid.uuid4().hex[:6]}"))
    out = []
    try:
        tps = [TopicPartition(topic, p) for p in todo]
        c.assign(tps)
        for tp in tps:
            c.seek(tp, start.get(tp.partition, 0))
        deadline = time.monotonic() + timeout_s
        while todo:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic}: partitions {sorted(todo)} not read to the end "
                                   f"in {timeout_s}s")
            for tp, msgs in c.poll(timeout_ms=200).items():
                for m in msgs:
                    if m.offset < ends[tp.partition]:
                        out.append(m)
                if c.position(tp) >= ends[tp.partition]:
                    todo.pop(tp.partition, None)
    finally:
        c.close(autocommit=False)
    out.sort(key=lambda m: (m.timestamp, m.partition, m.offset))
    return out


def read_table(cfg: BusConfig, topic: str, schema: str | None = None) -> pa.Table:
    """Every row of ``topic`` (up to the high watermark now) as one table; messages that
    do not decode are skipped (they are in the error topic of whoever consumed them)."""
    name = schema or topic_names.schema_for_topic(topic)
    tables = []
    for m in read_messages(cfg, topic):
        table = _decoded(m, name)
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
        table = _decoded(m, name)
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
        table = _decoded(m, "rewards")
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


def _decoded(m, name: str) -> pa.Table | None:
    """Message ``m`` as a table of schema ``name``, or None if it does not decode (null or
    empty value, a ``relax-schema`` header naming another schema, not Arrow, another
    schema): a message the stages route to ``<topic>.errors`` is no row here either."""
    if not m.value:
        return None
    header = dict(m.headers or []).get("relax-schema")
    if header and header != name.encode():
        return None
    try:
        table = decode(m.value, name)
        table.validate(full=True)  # corrupt buffers would crash to_pylist, not raise
        return table
    except (DecodeError, ValueError, KeyError, pa.ArrowException):
        return None
