"""Losses to retention are never silent (issue 53): records deleted below a consumer
group's committed offset give a WARNING naming topic, partition, committed offset, log
start and count, the ``lost_to_retention`` counter and metric row, and the group reads
the rest exactly once."""

from __future__ import annotations

import logging
import time

import pyarrow as pa
import pytest

from relax.schemas import metric_names as M
from relax.schemas import topics
from relax.schemas.v1 import ROLLOUTS
from relax.streams.client import BusConfig, admin, ensure_topics
from relax.streams.consumer import BatchConsumer
from relax.streams.lag import group_offsets
from relax.streams.metrics import MetricsWriter
from relax.streams.producer import BatchProducer
from relax.streams.read import read_table
from relax.streams.retention import RetentionLoss, lost_to_retention

from testdata import rollout_rows


def test_lost_to_retention_counts_offsets_below_the_log_start():
    assert lost_to_retention(3, 7) == 4
    assert lost_to_retention(7, 7) == 0
    assert lost_to_retention(9, 7) == 0          # ahead of the log start: nothing lost
    assert lost_to_retention(None, 7) == 0       # never committed: nothing of it lost
    msg = RetentionLoss("r.rollouts", 0, 3, 7, 4).message("trainer", "r.trainer")
    for part in ("r.rollouts[0]", "committed offset 3", "log start 7", "4 record(s)",
                 "r.trainer", "trainer"):
        assert part in msg
    assert "position 3" in RetentionLoss("r.rollouts", 0, 3, 7, 4, committed=False).message(
        "trainer", "r.trainer")


def _produce(cfg: BusConfig, topic: str, n: int) -> None:
    """``n`` messages of one rollout each (one group per row: one message per key)."""
    p = BatchProducer(cfg)
    assert p.send(topic, pa.RecordBatch.from_pylist(rollout_rows(n, group_size=1),
                                                    schema=ROLLOUTS)) == n
    assert p.flush() == n
    p.close()


def _drain(c: BatchConsumer, want: int, timeout_s: float = 60.0, quiet_s: float = 3.0):
    """Poll until ``want`` deliveries came and then ``quiet_s`` passed with none."""
    got, deadline, last = [], time.monotonic() + timeout_s, time.monotonic()
    while time.monotonic() < deadline:
        new = c.poll(0.5)
        if new:
            got += new
            last = time.monotonic()
        elif len(got) >= want and time.monotonic() - last > quiet_s:
            break
    return got


@pytest.mark.kafka
def test_records_deleted_below_a_committed_offset_are_reported_and_the_rest_read_once(
        broker, unique, caplog):
    from kafka import TopicPartition

    cfg = BusConfig(bootstrap_servers=broker)
    run, n, k, m = unique, 12, 3, 8
    topic = topics.run_topic(run, topics.ROLLOUTS)
    group = topics.group(run, "reader")
    ensure_topics(cfg, {topic: 1})
    _produce(cfg, topic, n)

    c = BatchConsumer(cfg, group, [topic], stage="reader")
    got = _drain(c, n, quiet_s=0.5)
    assert [d.offset for d in got] == list(range(n))
    c.done(got[:k])
    assert c.commit() == {TopicPartition(topic, 0): k}
    assert c.lost_to_retention == 0
    c.close()

    a = admin(cfg)
    try:
        a.delete_records({TopicPartition(topic, 0): m})
    finally:
        a.close()

    producer = BatchProducer(cfg)
    metrics = MetricsWriter(producer, run, "reader")
    c = BatchConsumer(cfg, group, [topic], stage="reader", metrics=metrics)
    with caplog.at_level(logging.WARNING, logger="relax.streams.consumer"):
        got = _drain(c, n - m)
    warnings = [r.getMessage() for r in caplog.records if "lost to retention" in r.getMessage()]
    assert len(warnings) == 1, warnings
    for part in (f"{topic}[0]", f"committed offset {k}", f"log start {m}",
                 f"{m - k} record(s)", group):
        assert part in warnings[0], (part, warnings[0])
    assert c.lost_to_retention == m - k
    # the rest, exactly once: offsets m..n-1, each once, then nothing more
    assert [d.offset for d in got] == list(range(m, n))
    ids = [r for d in got for r in d.table.column("rollout_id").to_pylist()]
    assert ids == [r["rollout_id"] for r in rollout_rows(n, group_size=1)[m:]]
    c.done(got)
    c.commit()
    assert producer.flush() == 1  # the metric row
    c.close()
    producer.close()
    assert group_offsets(cfg, group) == {(topic, 0): n}
    rows = read_table(cfg, topics.run_topic(run, topics.METRICS)).to_pylist()
    assert [(r["component"], r["name"], r["value"]) for r in rows] == \
        [("reader", M.LOST_TO_RETENTION, float(m - k))]

    # the group starts again past every record: nothing more is read, nothing is reported
    caplog.clear()
    c = BatchConsumer(cfg, group, [topic], stage="reader")
    with caplog.at_level(logging.WARNING, logger="relax.streams.consumer"):
        assert _drain(c, 0, timeout_s=10.0, quiet_s=2.0) == []
    assert c.lost_to_retention == 0
    assert not [r for r in caplog.records if "lost to retention" in r.getMessage()]
    c.close()


@pytest.mark.kafka
def test_records_deleted_ahead_of_a_reading_consumer_are_reported(broker, unique, caplog):
    """A consumer that falls behind while it reads: retention deletes records past its
    position, kafka-python resets it to the log start, and the jump is counted."""
    from kafka import TopicPartition

    cfg = BusConfig(bootstrap_servers=broker)
    run, n, m = unique, 12, 8
    topic = topics.run_topic(run, topics.ROLLOUTS)
    ensure_topics(cfg, {topic: 1})
    p = BatchProducer(BusConfig(bootstrap_servers=broker, compression=None))
    for row in rollout_rows(n, group_size=1, tokens=3000):  # ~36 KB, one batch each
        p.send(topic, pa.RecordBatch.from_pylist([row], schema=ROLLOUTS))
        assert p.flush() == 1
    p.close()
    # fetches of at most 65 KiB a partition: one message each, so the client holds at
    # most a fetch or two ahead of what it handed out
    small = BusConfig(bootstrap_servers=broker, max_message_bytes=1024)
    c = BatchConsumer(small, topics.group(run, "slow"), [topic], stage="slow")
    first = []
    for _ in range(60):
        first += c.poll(0.5, max_records=1)
        if first:
            break
    assert [d.offset for d in first] == [0]
    a = admin(cfg)
    try:
        a.delete_records({TopicPartition(topic, 0): m})
    finally:
        a.close()
    with caplog.at_level(logging.WARNING, logger="relax.streams.consumer"):
        rest = _drain(c, n - m)
    read = [d.offset for d in first + rest]
    j = read.index(m)  # offsets 0..j-1 were read before the jump (fetched ahead of it)
    assert read == list(range(j)) + list(range(m, n)), read
    assert c.lost_to_retention == m - j, read
    assert j < m, read
    warnings = [r.getMessage() for r in caplog.records if "lost to retention" in r.getMessage()]
    assert len(warnings) == 1, warnings
    for part in (f"{topic}[0]", f"position {j}", f"log start {m}", f"{m - j} record(s)"):
        assert part in warnings[0], (part, warnings[0])
    c.close()
