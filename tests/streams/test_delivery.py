"""Delivery contract on Apache Kafka: C28 (oversize records), C29
(commit = next offset)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from relax.schemas import topics
from relax.schemas.v1 import METRICS, ROLLOUTS
from relax.streams.client import BusConfig, ensure_topics
from relax.streams.codec import RecordTooLarge
from relax.streams.consumer import BatchConsumer
from relax.streams.lag import group_lag, group_offsets
from relax.streams.producer import BatchProducer, DeliveryError

from testdata import rollout_rows

MiB = 1 << 20


def test_c28_oversize_record_is_reported_failed_never_sent(broker, unique):
    topic = f"{unique}.rollouts"
    # request 1 MiB
    small = BusConfig(bootstrap_servers=broker, max_message_bytes=MiB - 64 * 1024)
    ensure_topics(small, {topic: 1})
    p = BatchProducer(small)
    p.send_value(topic, b"\x01" * (3 * MiB), key=b"k")
    with pytest.raises(DeliveryError) as e:
        p.flush()
    assert e.value.failed == 1 and e.value.delivered == 0
    assert "MessageSizeTooLarge" in repr(e.value.errors[0])
    assert p.stats.delivered == 0 and p.stats.failed == 1
    p.close()


def test_row_over_the_limit_fails_at_send_naming_row_key_and_limit(broker, unique):
    """On both brokers: a row that alone is over the limit raises at send, naming its row
    in the batch, its key, the topic and the limit; it is never queued nor delivered, and
    the keys before it are."""
    topic = topics.run_topic(unique, "rollouts")
    cfg = BusConfig(bootstrap_servers=broker, max_message_bytes=64 * 1024)
    ensure_topics(cfg, {topic: 1})
    rows = rollout_rows(6, group_size=2)  # keys g0000 (rows 0, 1), g0001 (2, 3), g0002
    rows[3] = rollout_rows(1, tokens=30_000)[0] | {k: rows[3][k] for k in (
        "rollout_id", "group_id", "prompt_id", "sample_index", "group_size")}
    p = BatchProducer(cfg)
    with pytest.raises(RecordTooLarge) as e:
        p.send(topic, pa.RecordBatch.from_pylist(rows, schema=ROLLOUTS))
    assert e.value.row == 3 and e.value.limit == 64 * 1024
    msg = str(e.value)
    for part in ("row 3 encodes to", "over max_message_bytes=65536", "key 'g0001'", topic):
        assert part in msg, (part, msg)
    assert p.flush() == 1  # g0000's message; nothing of g0001 (nor after it) was queued
    assert p.stats.delivered == 1 and p.stats.failed == 0 and p.stats.rows == 2
    p.close()
    from relax.streams.read import read_table

    assert read_table(cfg, topic).column("rollout_id").to_pylist() == ["g0000/0", "g0000/1"]


@pytest.mark.kafka
def test_a_topics_own_smaller_limit_is_the_limit(broker, unique):
    """A topic made with a smaller max.message.bytes than this producer's (another run's
    settings, another tool): the producer splits under the topic's limit and refuses at
    send what Kafka would refuse, naming the limit; never counted delivered."""
    topic = topics.run_topic(unique, "rollouts")
    ensure_topics(BusConfig(bootstrap_servers=broker, max_message_bytes=256 * 1024),
                  {topic: 1})  # max.message.bytes = 320 KiB
    p = BatchProducer(BusConfig(bootstrap_servers=broker))  # max_message_bytes 1 MiB
    assert p.limit(topic) == 256 * 1024
    big = rollout_rows(1, tokens=40_000)  # ~480 KiB encoded
    with pytest.raises(RecordTooLarge) as e:
        p.send(topic, pa.RecordBatch.from_pylist(big, schema=ROLLOUTS))
    assert e.value.row == 0 and e.value.limit == 256 * 1024
    assert "the topic's max.message.bytes (327680) less 65536 bytes of framing=262144" \
        in str(e.value), str(e.value)
    p.send_value(topic, b"\x01" * (2 * MiB), key=b"k")
    with pytest.raises(DeliveryError) as d:
        p.flush()
    assert d.value.failed == 1 and d.value.delivered == 0
    assert "MessageSizeTooLarge" in repr(d.value.errors[0]) and "262144" in str(d.value.errors[0])
    # a batch over the topic's limit, of rows under it: split under it, every row delivered
    rows = rollout_rows(4, group_size=4, tokens=8_000)  # one key, ~4 x 96 KiB
    n = p.send(topic, pa.RecordBatch.from_pylist(rows, schema=ROLLOUTS))
    assert n >= 2 and p.flush() == n
    assert p.stats.delivered == n and p.stats.failed == 1
    p.close()
    from relax.streams.read import read_table

    assert read_table(BusConfig(bootstrap_servers=broker), topic).column(
        "rollout_id").to_pylist() == [r["rollout_id"] for r in rows]


def test_c28_big_record_delivered_to_consumer_with_small_fetch_size(broker, unique):
    run = unique
    topic = topics.run_topic(run, "rollouts")
    big = BusConfig(bootstrap_servers=broker, max_message_bytes=5 * MiB)
    ensure_topics(big, {topic: 1})
    p = BatchProducer(big)
    batch = pa.RecordBatch.from_pylist(rollout_rows(1, tokens=3 * MiB // 9), schema=ROLLOUTS)
    assert p.send(topic, batch) == 1
    assert p.flush() == 1
    p.close()
    small = BusConfig(bootstrap_servers=broker, max_message_bytes=MiB - 64 * 1024)
    c = BatchConsumer(small, topics.group(run, "c28"), [topic], stage="c28")
    assert c.kafka.config["max_partition_fetch_bytes"] == MiB
    got = []
    for _ in range(30):
        got += c.poll(1.0)
        if got:
            break
    assert len(got) == 1 and got[0].table.num_rows == 1
    assert len(got[0].table.column("response_ids")[0]) == 3 * MiB // 9
    c.close()


def test_arrow_batch_over_limit_is_split_not_lost(bus, unique):
    topic = topics.run_topic(unique, "rollouts")
    ensure_topics(bus, {topic: 1})
    p = BatchProducer(bus)
    rows = rollout_rows(64, group_size=64, tokens=4096)  # one key, ~3 MiB
    n = p.send(topic, pa.RecordBatch.from_pylist(rows, schema=ROLLOUTS))
    assert n >= 3 and p.flush() == n
    from relax.streams.read import read_table

    t = read_table(bus, topic)
    assert t.column("rollout_id").to_pylist() == [r["rollout_id"] for r in rows]
    p.close()


def _metric_rows(n, start=0):
    return pa.RecordBatch.from_pylist(
        [{"ts": 0, "component": "c", "name": "x", "value": float(i), "policy_version": None}
         for i in range(start, start + n)], schema=METRICS)


def test_c29_commit_is_next_offset_and_restart_resumes_there(bus, unique):
    run = unique
    topic = topics.run_topic(run, "metrics")
    ensure_topics(bus, {topic: 1})
    p = BatchProducer(bus)
    for i in range(42):  # 42 messages at offsets 0..41
        p.send(topic, _metric_rows(1, i))
    p.flush()
    group = topics.group(run, "c29")
    c = BatchConsumer(bus, group, [topic], stage="c29")
    seen = []
    while len(seen) < 42:
        ds = c.poll(1.0)
        seen += [d.offset for d in ds]
        c.done(ds)
    assert seen == list(range(42))
    committed = c.commit()
    assert list(committed.values()) == [42]
    c.close()
    assert group_offsets(bus, group) == {(topic, 0): 42}
    assert group_lag(bus, group, [topic]) == {(topic, 0): 0}
    p.send(topic, _metric_rows(1, 42))
    p.flush()
    c2 = BatchConsumer(bus, group, [topic], stage="c29")
    first = []
    for _ in range(30):
        first = c2.poll(1.0)
        if first:
            break
    assert first[0].offset == 42 and first[0].table.column("value").to_pylist() == [42.0]
    c2.close()
    p.close()


def test_finishing_deliveries_of_a_revoked_partition_is_harmless(bus, unique):
    """A stage that finishes work from a partition a rebalance took away (a second member
    joined meanwhile) neither crashes nor commits for it: the new owner reads it again."""
    import time as _time

    from relax.streams.consumer import BatchConsumer
    from relax.streams.producer import BatchProducer

    topic = unique + ".rollouts"
    ensure_topics(bus, {topic: 2})
    p = BatchProducer(bus)
    rows = rollout_rows(8, group_size=2)  # 4 groups over the 2 partitions
    p.send(topic, pa.RecordBatch.from_pylist(rows, schema=ROLLOUTS))
    p.close()
    a = BatchConsumer(bus, unique + ".g", [topic], stage="a")
    got, deadline = [], _time.monotonic() + 30
    while len({d.partition for d in got}) < 2 and _time.monotonic() < deadline:
        got += a.poll(0.5)
    assert {d.partition for d in got} == {0, 1}
    b = BatchConsumer(bus, unique + ".g", [topic], stage="b")
    deadline = _time.monotonic() + 60
    while len(a.kafka.assignment()) != 1 and _time.monotonic() < deadline:
        a.poll(0.2)  # the rebalance runs inside the polls of both members
        b.poll(0.2)
    assert len(a.kafka.assignment()) == 1
    a.done(got)  # one partition's deliveries are from before the rebalance
    mine = {tp.partition for tp in a.kafka.assignment()}
    assert {tp.partition for tp in a.commit()} <= mine
    a.close()
    b.close()


def test_a_partition_kept_through_a_rebalance_is_read_again_from_the_committed_offset(bus, unique):
    """The group rebalances eagerly: every partition is revoked, then assigned. A member
    that gets one of its partitions straight back reads it again from the group's
    committed offset, as a new owner would (its queued records were dropped with the
    revocation; kafka-python 3.0 kept the fetch position after them, and a rollout that
    kept its prompt partition never sampled the prompts it had queued)."""
    import time as _time

    topic = unique + ".rollouts"
    ensure_topics(bus, {topic: 2})
    p = BatchProducer(bus)
    p.send(topic, pa.RecordBatch.from_pylist(rollout_rows(8, group_size=2), schema=ROLLOUTS))
    p.close()
    a = BatchConsumer(bus, unique + ".g", [topic], stage="a")
    got, deadline = [], _time.monotonic() + 30
    while len({d.partition for d in got}) < 2 and _time.monotonic() < deadline:
        got += a.poll(0.5)  # in flight, never done: nothing committed
    first = {q: sorted(d.offset for d in got if d.partition == q) for q in (0, 1)}
    assert first[0] and first[1]
    b = BatchConsumer(bus, unique + ".g", [topic], stage="b")
    again, deadline = [], _time.monotonic() + 60
    while len(a.kafka.assignment()) != 1 and _time.monotonic() < deadline:
        again += a.poll(0.2)
        b.poll(0.2)
    assert len(a.kafka.assignment()) == 1
    kept = next(iter(a.kafka.assignment())).partition
    deadline = _time.monotonic() + 30
    while sorted(d.offset for d in again if d.partition == kept) != first[kept] \
            and _time.monotonic() < deadline:
        again += a.poll(0.2)
        b.poll(0)
    assert sorted(d.offset for d in again if d.partition == kept) == first[kept]
    assert {d.generation for d in again} == {1}  # after the revocation
    a.done(again)
    assert {tp.partition: o for tp, o in a.commit().items()} == {kept: first[kept][-1] + 1}
    a.close()
    b.close()


def test_poll_rides_through_a_broker_outage_for_a_while_then_raises(bus, unique, monkeypatch):
    """kafka-python 3.0 raises a failed metadata refresh (``KafkaConnectionError``) out of
    ``KafkaConsumer.poll`` while the group coordinator is away (a CI run restarted a reward
    stage so during a Kafka restart): the stage's poll is empty instead, for up to
    ``OUTAGE_S``; then, and at once for a non-retriable error, it raises."""
    import time as _time

    from kafka.errors import KafkaConnectionError, TopicAuthorizationFailedError

    from relax.streams import consumer as consumer_mod

    topic = unique + ".rollouts"
    ensure_topics(bus, {topic: 1})
    p = BatchProducer(bus)
    p.send(topic, pa.RecordBatch.from_pylist(rollout_rows(2, group_size=2), schema=ROLLOUTS))
    p.close()
    c = BatchConsumer(bus, unique + ".g", [topic], stage="t")
    real = c.kafka.poll
    failing: list[BaseException] = [KafkaConnectionError("111 ECONNREFUSED")]

    def poll(**kw):
        if failing:
            raise failing[0]
        return real(**kw)

    monkeypatch.setattr(c.kafka, "poll", poll)
    assert c.poll(0.05) == [] and c.poll(0.05) == []  # the broker away: empty polls
    monkeypatch.setattr(consumer_mod, "OUTAGE_S", 0.01)
    _time.sleep(0.02)
    with pytest.raises(KafkaConnectionError):
        c.poll(0.05)  # away for longer than OUTAGE_S
    failing.clear()
    got, deadline = [], _time.monotonic() + 30
    while not got and _time.monotonic() < deadline:
        got = c.poll(0.5)  # back: the rows come, and the outage clock is reset
    assert sum(d.table.num_rows for d in got) == 2
    failing.append(KafkaConnectionError("111 ECONNREFUSED"))
    assert c.poll(0.05) == []
    failing[0] = TopicAuthorizationFailedError()
    with pytest.raises(TopicAuthorizationFailedError):
        c.poll(0.05)  # not retriable: at once
    c.close()
