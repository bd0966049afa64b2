"""Several topics on one :class:`relax.streams.follow.Follower`: each view gets its own
partitions' records, every one once, a later view of a partition gets it from the
beginning, and a thread waiting on one view is woken by another thread's fetch."""

from __future__ import annotations

import threading
import time

import pyarrow as pa

from relax.schemas import topics
from relax.schemas.v1 import METRICS
from relax.streams.client import BusConfig, ensure_topics
from relax.streams.follow import Follower, follow
from relax.streams.producer import BatchProducer


def _row(value: float) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([{"ts": 0, "component": "c", "name": "x", "value": value,
                                        "policy_version": None}], schema=METRICS)


def _write(bus: BusConfig, topic: str, values: list[float]) -> None:
    p = BatchProducer(bus)
    for v in values:
        p.send(topic, _row(v))
    p.flush()
    p.close()


def _read(view, n: int, timeout_s: float = 30.0) -> list[tuple[int, int]]:
    """``(partition, offset)`` of the records ``view`` returns until it has ``n`` (then one
    more short poll, which must bring nothing)."""
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += [(m.partition, m.offset) for m in view.poll(0.5)]
    got += [(m.partition, m.offset) for m in view.poll(0.3)]
    return got


def test_views_get_their_own_records_once_and_a_later_view_from_the_beginning(bus, unique):
    a, b = topics.run_topic(unique, "metrics"), topics.run_topic(f"{unique}b", "metrics")
    ensure_topics(bus, {a: 1, b: 2})
    _write(bus, a, [1, 2, 3])
    f = Follower(bus, "test")
    try:
        va = f.follow(a, 1)
        vb = f.follow(b, 2)
        assert _read(va, 3) == [(0, 0), (0, 1), (0, 2)]
        assert _read(vb, 0, 1.0) == []
        _write(bus, b, [4])
        _write(bus, a, [5])
        assert len(_read(vb, 1)) == 1
        late = f.follow(a, 1)  # a second reader of a: all four records, the first one none again
        assert _read(late, 4) == [(0, 0), (0, 1), (0, 2), (0, 3)]
        assert _read(va, 1) == [(0, 3)]
        late.close()
        _write(bus, a, [6])
        assert _read(va, 1) == [(0, 4)]
        assert late.poll(0.2) == []
    finally:
        f.close()
    assert va.poll(0.1) == []  # closed: nothing, no error


def test_a_thread_waiting_on_one_view_gets_its_record_while_another_thread_fetches(bus, unique):
    a, b = topics.run_topic(unique, "metrics"), topics.run_topic(f"{unique}b", "metrics")
    ensure_topics(bus, {a: 1, b: 1})
    f = Follower(bus, "test")
    va, vb = f.follow(a, 1), f.follow(b, 1)
    got: list = []

    def wait_on_b():
        t0 = time.monotonic()
        got.extend(vb.poll(60.0))
        got.append(time.monotonic() - t0)

    try:
        t = threading.Thread(target=wait_on_b)
        t.start()
        stop = time.monotonic() + 60
        _write(bus, b, [1.0])
        while t.is_alive() and time.monotonic() < stop:
            assert va.poll(0.5) == []  # the main thread fetches for both, half the time
        t.join(1)
        assert not t.is_alive()
        assert [m.offset for m in got[:-1]] == [0] and got[-1] < 30
    finally:
        f.close()


def test_a_view_made_without_a_follower_closes_its_own_client(bus, unique):
    a = topics.run_topic(unique, "metrics")
    ensure_topics(bus, {a: 1})
    _write(bus, a, [1, 2])
    view = follow(bus, a, 1, "test")
    assert _read(view, 2) == [(0, 0), (0, 1)]
    view.close()
    assert view.follower.closed
