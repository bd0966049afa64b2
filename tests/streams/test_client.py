"""Topic settings and client settings (streams/client.py); what Apache Kafka enforces."""

from __future__ import annotations

import time

import pyarrow as pa
import pytest

from relax.schemas import topics
from relax.schemas.v1 import METRICS
from relax.streams.client import (
    RECONNECT_BACKOFF_MAX_MS,
    BusConfig,
    consumer_kwargs,
    ensure_topics,
    producer_kwargs,
    topic_settings,
)
from relax.streams.producer import BatchProducer

MiB = 1 << 20


def test_topic_settings_fit_the_cluster():
    cfg = BusConfig(bootstrap_servers="x:1", max_message_bytes=4 * MiB)
    assert topic_settings(cfg, "r.rollouts", brokers=1) == (
        1, {"max.message.bytes": str(4 * MiB + 64 * 1024), "min.insync.replicas": "1"})
    rf, conf = topic_settings(cfg, "r.rollouts", brokers=5)
    assert rf == 3 and conf["min.insync.replicas"] == "2" and "cleanup.policy" not in conf
    epochs = topics.rollout_state_topic("r")
    assert topic_settings(cfg, epochs, 3)[1]["cleanup.policy"] == "compact"
    # a delta changelog, an errors topic of a compacted topic and a data set are not compacted
    for t in (topics.changelog_topic("r"), topics.errors_topic(epochs),
              topics.prompts_topic("rollout_state")):
        assert "cleanup.policy" not in topic_settings(cfg, t, 3)[1], t
    pinned = BusConfig(bootstrap_servers="x:1", replication_factor=2, min_insync_replicas=2)
    assert topic_settings(pinned, "r.metrics", 3) == (
        2, {"max.message.bytes": str(pinned.request_bytes), "min.insync.replicas": "2"})
    with pytest.raises(ValueError, match="cluster has 1 broker"):
        topic_settings(pinned, "r.metrics", 1)
    with pytest.raises(ValueError, match="exceeds replication_factor"):
        BusConfig(bootstrap_servers="x:1", replication_factor=1, min_insync_replicas=2)


def test_producers_are_idempotent_with_acks_all():
    kw = producer_kwargs(BusConfig(bootstrap_servers="x:1"))
    assert kw["acks"] == "all" and kw["enable_idempotence"] is True


def test_producers_and_consumers_retry_a_lost_broker_every_second():
    cfg = BusConfig(bootstrap_servers="x:1")
    assert RECONNECT_BACKOFF_MAX_MS <= 1000
    assert producer_kwargs(cfg)["reconnect_backoff_max_ms"] == RECONNECT_BACKOFF_MAX_MS
    assert consumer_kwargs(cfg, "g")["reconnect_backoff_max_ms"] == RECONNECT_BACKOFF_MAX_MS


@pytest.mark.kafka
def test_kafka_gets_the_topic_settings(broker, unique):
    from kafka.admin import ConfigResource, ConfigResourceType

    from relax.streams.client import admin

    cfg = BusConfig(bootstrap_servers=broker, max_message_bytes=3 * MiB,
                    retention_ms=3_600_000)
    data, epochs = topics.run_topic(unique, "rollouts"), topics.rollout_state_topic(unique)
    ensure_topics(cfg, {data: 2, epochs: 1})
    a = admin(cfg)
    try:
        res = a.describe_configs([ConfigResource(ConfigResourceType.TOPIC, t)
                                  for t in (data, epochs)], config_filter="all")
    finally:
        a.close()
    got = {t: {k: v["value"] for k, v in conf.items()} for t, conf in res["topic"].items()}
    assert got[data]["max.message.bytes"] == str(cfg.request_bytes)
    assert got[data]["min.insync.replicas"] == "1"
    assert got[data]["cleanup.policy"] == "delete"
    assert got[data]["retention.ms"] == "3600000"  # recipe key bus.retention_ms
    assert got[epochs]["cleanup.policy"] == "compact"
    assert got[epochs]["retention.ms"] != "3600000"  # compacted state is kept


def test_errors_topic_is_created_where_first_written(bus, unique):
    """Kafka does not create topics on produce (a send would wait 60 s for metadata, then
    fail): ``send_errors`` creates ``<topic>.errors`` the first time it writes there."""
    from relax.streams.errors import error_row
    from relax.streams.read import read_table

    topic = topics.run_topic(unique, "metrics")
    ensure_topics(bus, {topic: 1})
    p = BatchProducer(bus)
    t0 = time.monotonic()
    p.send(topic, pa.RecordBatch.from_pylist(
        [{"ts": 0, "component": "c", "name": "x", "value": 1.0, "policy_version": None}],
        schema=METRICS))
    p.send_errors(topic, [error_row(source_topic=topic, source_partition=0, source_offset=0,
                                    stage="test", error="bad", key=b"k", value=b"v")])
    assert p.flush() == 2 and time.monotonic() - t0 < 20
    p.close()
    errs = read_table(bus, topics.errors_topic(topic)).to_pylist()
    assert [(e["stage"], e["error"]) for e in errs] == [("test", "bad")]


def _metrics_row(value: float) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(
        [{"ts": 0, "component": "c", "name": "x", "value": value, "policy_version": None}],
        schema=METRICS)


@pytest.mark.kafka
def test_clients_find_a_killed_kafka_within_seconds_of_its_return(tmp_path, unique):
    """A producer and a group consumer that lost their Kafka for over 25 s (SIGKILL, then
    started again from its log dirs) reach it within seconds of its return. With
    kafka-python's default backoff (up to 30 s between attempts) they came back 15-17 s
    after it did, and the stages of a run 48-51 s after the kill, near the 60 s they ride
    through an outage for (issue 59; ``RECONNECT_BACKOFF_MAX_MS``)."""
    import os
    import signal

    from relax.infra.broker.kafka import kafka_missing, start_kafka
    from relax.infra.broker.local import stop_broker
    from relax.streams.consumer import BatchConsumer

    reason = kafka_missing()
    if reason:
        pytest.skip(reason)
    handles = [start_kafka(tmp_path / "kafka")]
    try:
        cfg = BusConfig(bootstrap_servers=handles[0].bootstrap)
        topic = topics.run_topic(unique, "metrics")
        ensure_topics(cfg, {topic: 1})
        p = BatchProducer(cfg)
        c = BatchConsumer(cfg, topics.group(unique, "reader"), [topic], stage="test")
        p.send(topic, _metrics_row(1.0))
        p.flush()
        got = []
        while not got:
            got = c.poll(0.5)
        c.done(got)
        c.commit()
        killed = time.monotonic()
        for pid in handles[0].pids:
            os.kill(pid, signal.SIGKILL)
        p.send(topic, _metrics_row(2.0))  # queued: the producer retries it
        while time.monotonic() - killed < 15.0:  # the clients back off while it is away
            assert c.poll(0.5) == []
        handles.append(start_kafka(tmp_path / "kafka"))  # same log dirs and ports
        back = time.monotonic()
        p.flush()
        produced_s = time.monotonic() - back
        values, committed = [], {}
        while not committed and time.monotonic() - back < 60:
            got = c.poll(0.5)  # the group forgot this member while it was away: it rejoins
            values += [r["value"] for d in got for r in d.table.to_pylist()]
            c.done(got)
            committed = c.commit()
        consumed_s = time.monotonic() - back
        c.close()
        p.close()
    finally:
        for h in handles:
            stop_broker(h)
    took = (f"Kafka away {back - killed:.0f}s; after its return the producer delivered in "
            f"{produced_s:.1f}s, the consumer read and committed in {consumed_s:.1f}s")
    print(took)
    assert committed and set(values) == {2.0}, (committed, values, took)
    assert produced_s < 8 and consumed_s < 8, took
