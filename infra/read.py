"""Reading rows back from a topic for people: ``relax tail``, ``relax errors``, tests.

Group-less (no commits): partitions are assigned and read between an offset and
the high watermark, so it works the same on every broker.
"""

from __future__ import annotations

import time
import uuid

import pyarrow as pa

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
        try:
            tables.append(decode(m.value, name))
        except (DecodeError, ValueError):
            continue
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
        try:
            rows.extend(decode(m.value, name).to_pylist())
        except (DecodeError, ValueError):
            rows.append({"offset": m.offset, "partition": m.partition,
                         "undecodable_bytes": len(m.value)})
    return rows[-n:] if n else rows
