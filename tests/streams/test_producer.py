"""BatchProducer shared by several threads (the trainer's main thread sends metrics while
the weight publisher's thread sends announcements), on the real broker."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pytest

from relax.streams.read import read_table
from relax.schemas import topics
from relax.schemas.v1 import METRICS
from relax.streams.client import ensure_topics
from relax.streams.producer import BatchProducer, DeliveryError


def _metric_rows(component: str, start: int, n: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(
        [{"ts": 0, "component": component, "name": "x", "value": float(i), "policy_version": None}
         for i in range(start, start + n)], schema=METRICS)


@pytest.fixture
def often_switching_threads():
    """Switch threads every microsecond, so unlocked bookkeeping races show up."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def test_sends_and_flushes_from_four_threads(bus, unique, often_switching_threads):
    topic = topics.run_topic(unique, "metrics")
    ensure_topics(bus, {topic: 1})
    p = BatchProducer(bus)
    n_threads, sends, rows_per_send = 4, 60, 3
    start = threading.Barrier(n_threads)

    def worker(w: int) -> int:
        start.wait()
        delivered = 0
        for i in range(sends):
            p.send(topic, _metric_rows(f"w{w}", i * rows_per_send, rows_per_send))
            if i % 7 == 6:
                delivered += p.flush(timeout_s=30)
        return delivered + p.flush(timeout_s=30)

    with ThreadPoolExecutor(n_threads) as pool:
        delivered = list(pool.map(worker, range(n_threads), timeout=120))
    assert delivered == [sends] * n_threads  # each thread's flushes count its own sends
    assert p.stats.messages == p.stats.delivered == n_threads * sends
    assert p.stats.rows == p.stats.per_topic_rows[topic] == n_threads * sends * rows_per_send
    t = read_table(bus, topic)
    for w in range(n_threads):
        values = [r["value"] for r in t.to_pylist() if r["component"] == f"w{w}"]
        assert values == [float(i) for i in range(sends * rows_per_send)]
    p.close()


def test_flush_reports_the_calling_threads_failures(bus, unique):
    """Thread A's failed send is raised by A's flush, not by thread B's: B's flush returns
    once B's own messages are delivered, and A does not go on as if all were sent."""
    topic = topics.run_topic(unique, "metrics")
    ensure_topics(bus, {topic: 1})
    p = BatchProducer(bus)
    a, b = ThreadPoolExecutor(1), ThreadPoolExecutor(1)  # one thread each

    def send_and_flush() -> int:
        p.send(topic, _metric_rows("b", 0, 2))
        return p.flush()

    a.submit(p.send_value, topic, b"\x01" * (2 * bus.max_message_bytes), b"k").result()
    assert b.submit(send_and_flush).result() == 1
    with pytest.raises(DeliveryError) as e:
        a.submit(p.flush).result()
    assert e.value.failed == 1 and e.value.delivered == 0
    a.shutdown()
    b.shutdown()
    assert p.stats.delivered == 1 and p.stats.failed == 1
    p.close()


def test_every_schema_has_a_key_column_and_joined_ones_are_keyed_by_group():
    """A schema missing from KEY_COLUMNS would be sent without a key: its rows would land
    in any partition, away from their group's rollouts in the aggregator's join."""
    from relax.schemas.v1 import SCHEMAS
    from relax.streams.producer import KEY_COLUMNS

    assert set(KEY_COLUMNS) == set(SCHEMAS)
    for joined in ("rollouts", "rewards", "ref_logprobs", "teacher_logprobs"):
        assert KEY_COLUMNS[joined] == "group_id", joined
