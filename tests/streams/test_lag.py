"""Record counts and committed offsets through :class:`relax.streams.lag.LagProbe`: the
same answers as the one-off functions over one admin client, and a new client after the
broker went away."""

from __future__ import annotations

import pyarrow as pa
import pytest
from kafka.errors import KafkaError

from relax.infra.broker.local import LocalBroker
from relax.schemas import topics
from relax.schemas.v1 import METRICS
from relax.streams.client import BusConfig, ensure_topics
from relax.streams.consumer import BatchConsumer
from relax.streams.lag import LagProbe, group_offsets, high_watermarks
from relax.streams.producer import BatchProducer

ROW = pa.RecordBatch.from_pylist([{"ts": 0, "component": "c", "name": "x", "value": 1.0,
                                   "policy_version": None}], schema=METRICS)


def _write(bus: BusConfig, topic: str, counts: dict[int, int]) -> None:
    """``counts[p]`` one-row records to partition ``p`` of ``topic``."""
    p = BatchProducer(bus)
    for part, n in counts.items():
        for _ in range(n):
            p.send(topic, ROW, partition=part)
    p.flush()
    p.close()


def test_probe_answers_as_the_one_off_functions_over_one_client(bus, unique):
    a, b = topics.run_topic(f"{unique}a", "metrics"), topics.run_topic(unique, "metrics")
    ensure_topics(bus, {a: 2, b: 1})
    _write(bus, a, {0: 3, 1: 1})
    _write(bus, b, {0: 2})
    group = topics.group(unique, "lag")
    c = BatchConsumer(bus, group, [b], stage="lag")
    seen = []
    while len(seen) < 2:
        ds = c.poll(1.0)
        seen += ds
        c.done(ds)
    c.commit()
    c.close()

    probe = LagProbe(bus)
    try:
        ends = probe.high_watermarks([a, b])
        client = probe._admin
        assert ends == {(a, 0): 3, (a, 1): 1, (b, 0): 2} == high_watermarks(bus, [a, b])
        assert probe.group_offsets(group) == {(b, 0): 2} == group_offsets(bus, group)
        assert probe.topic_partitions([a, b, "absent"]) == {a: 2, b: 1}
        assert {a, b} <= set(probe.list_topics()) and group in probe.list_groups()
        _write(bus, a, {1: 2})  # a later question sees the new records
        assert probe.high_watermarks([a])[(a, 1)] == 3
        assert probe._admin is client  # every question went through the one client
    finally:
        probe.close()
    assert probe._admin is None


def test_probe_drops_its_client_when_the_broker_goes_and_answers_after_it_is_back(
        tmp_path, unique):
    topic = topics.run_topic(unique, "metrics")
    with LocalBroker() as first:
        bus = BusConfig(bootstrap_servers=first.bootstrap)
        ensure_topics(bus, {topic: 1})
        probe = LagProbe(bus)
        assert probe.high_watermarks([topic]) == {(topic, 0): 0}
    # the broker is gone: the question fails at once and the client is dropped
    with pytest.raises(KafkaError):
        probe.topic_partitions([topic])
    assert probe._admin is None
    port = int(first.bootstrap.rsplit(":", 1)[1])
    with LocalBroker(port=port):
        try:  # a new broker on the same address: a new client, which sees its (empty) state
            assert probe.topic_partitions([topic]) == {}
            ensure_topics(bus, {topic: 1})
            _write(bus, topic, {0: 1})
            assert probe.high_watermarks([topic]) == {(topic, 0): 1}
        finally:
            probe.close()
