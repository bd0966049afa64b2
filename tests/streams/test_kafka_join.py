"""Group joins that finish while no poll waits are kept (``streams/kafka_join.py``)."""

from __future__ import annotations

import time

import pytest

from relax.streams.client import BusConfig, consumer_kwargs, ensure_topics


def test_a_join_that_finishes_between_polls_is_kept(bus, unique):
    """Polls that never wait (timeout 0) with pauses longer than the broker's JoinGroup
    hold between them: every JoinGroup finishes while no poll waits. kafka-python 3.0
    alone schedules a new JoinGroup on each poll and never gets an assignment."""
    from kafka import KafkaConsumer

    topic = unique + ".rollouts"
    ensure_topics(bus, {topic: 2})
    c = KafkaConsumer(**consumer_kwargs(bus, unique + ".g"))
    c.subscribe([topic])
    try:
        for _ in range(8):  # coordinator lookup, member id round trip, the join, spares
            c.poll(timeout_ms=0)
            if len(c.assignment()) == 2:
                break
            time.sleep(4.0)  # longer than a JoinGroup is held: it finishes between polls
        assert {tp.partition for tp in c.assignment()} == {0, 1}
    finally:
        c.close()


def test_two_members_polling_in_turn_settle(bus, unique):
    """Two members of one group that poll in turn (0.2 s each) split two partitions
    within 30 s (two JoinGroup holds are 6 s: the rest is for a loaded machine), three
    times in a row (before the fix: 13 of 19 such rebalances had not settled after 40 s,
    on the broker of the time)."""
    from kafka import KafkaConsumer

    topic = unique + ".rollouts"
    ensure_topics(bus, {topic: 2})
    for i in range(3):
        a = KafkaConsumer(**consumer_kwargs(bus, f"{unique}.g{i}"))
        a.subscribe([topic])
        b = KafkaConsumer(**consumer_kwargs(bus, f"{unique}.g{i}"))
        b.subscribe([topic])
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (
                    len(a.assignment()) == 1 and len(b.assignment()) == 1):
                a.poll(timeout_ms=200)
                b.poll(timeout_ms=200)
            assert {tp.partition for tp in a.assignment() | b.assignment()} == {0, 1}
            assert len(a.assignment()) == 1 and len(b.assignment()) == 1
        finally:
            a.close()
            b.close()


@pytest.mark.kafka
def test_a_leader_join_started_by_new_metadata_is_kept(broker, tmp_path, unique):
    """The leader's rejoin after new partition metadata (its first assignment found no
    partitions: the topic came later) finishes while no poll waits. The leader's
    assignment records the metadata it used, so kafka-python 3.0 alone sees no more
    reason to rejoin, never collects the finished join and keeps no partitions (the
    restarted trainer of ``test_seeded_chaos_run[11]`` waited 300 s for data)."""
    from kafka import KafkaConsumer
    from kafka.coordinator.base import MemberState

    bus = BusConfig(bootstrap_servers=broker, blob_store=str(tmp_path / "blobs"))
    topic = unique + ".train_samples"
    c = KafkaConsumer(**consumer_kwargs(bus, unique + ".g"))
    c.subscribe([topic])  # before the topic exists: the first join assigns nothing
    try:
        coordinator = c._coordinator
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not coordinator.stable():
            c.poll(timeout_ms=100)
        assert coordinator.state is MemberState.STABLE and c.assignment() == set()
        ensure_topics(bus, {topic: 2})
        c._client.cluster.request_update()
        deadline = time.monotonic() + 20  # poll without waiting until the rejoin starts
        while time.monotonic() < deadline and coordinator._join_task is None:
            c.poll(timeout_ms=0)
            time.sleep(0.01)
        assert coordinator._join_task is not None, "the new partitions started no rejoin"
        time.sleep(5.0)  # JoinGroup and the leader's SyncGroup finish while no poll waits
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(c.assignment()) < 2:
            c.poll(timeout_ms=100)
        assert {tp.partition for tp in c.assignment()} == {0, 1}
    finally:
        c.close()
