"""Reading one partition of a topic to its end: recovery of partition-local state.

Stages with state (the aggregator) write every state change to a changelog
topic partition that mirrors their input partition, and rebuild the state of a
partition when the consumer group assigns it to them by reading that changelog
partition from the start to its high watermark. The end is the *fetch* high
watermark, which is right on every broker; faust's table recovery reads to
``end_offsets`` (ListOffsets), which Tansu answers with the last record batch's
base offset + 1, so it would stop early and lose state (measured: 7 records in
one batch -> end_offsets 1, fetch high watermark 7).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

from relax.streams.client import BusConfig, consumer_kwargs
from relax.streams.lag import high_watermarks


def read_partition(cfg: BusConfig, topic: str, partition: int, start: int = 0,
                   timeout_s: float = 60.0) -> Iterator:
    """Yield the kafka-python ConsumerRecords of ``topic[partition]`` from ``start`` up to
    the high watermark at call time, in offset order.

    Raises:
        TimeoutError: the partition could not be read to its end within ``timeout_s``.
    """
    from kafka import KafkaConsumer, TopicPartition

    end = high_watermarks(cfg, [topic]).get((topic, partition), 0)
    if end <= start:
        return
    tp = TopicPartition(topic, partition)
    c = KafkaConsumer(**consumer_kwargs(cfg, None, f"relax-changelog-{uuid.uuid4().hex[:6]}"))
    try:
        c.assign([tp])
        c.seek(tp, start)
        deadline = time.monotonic() + timeout_s
        while c.position(tp) < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic}[{partition}] to offset {end}: at "
                                   f"{c.position(tp)} after {timeout_s}s")
            for m in c.poll(timeout_ms=200).get(tp, []):
                if m.offset < end:
                    yield m
    finally:
        c.close(autocommit=False)
