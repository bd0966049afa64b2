"""OffsetTracker: the committed offset is the next to read, never past one in flight."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from relax.streams.offsets import OffsetTracker


def test_c29_next_offset_after_processing_0_to_41():
    t = OffsetTracker()
    for o in range(42):
        t.received("p0", o)
    for o in range(42):
        t.done("p0", o)
    assert t.committable() == {"p0": 42}
    assert t.committable()["p0"] != 41


def test_in_flight_record_holds_commit_back():
    t = OffsetTracker()
    for o in range(5):
        t.received("p", o)
    for o in (0, 1, 3, 4):
        t.done("p", o)
    assert t.committable() == {"p": 2}
    assert t.in_flight() == 1
    t.done("p", 2)
    assert t.committable() == {"p": 5}


def test_committable_only_reports_movement():
    t = OffsetTracker()
    t.received("p", 0)
    t.done("p", 0)
    c = t.committable()
    t.mark_committed(c)
    assert t.committable() == {}


def test_errors():
    t = OffsetTracker()
    t.received("p", 5)
    with pytest.raises(ValueError, match="must increase"):
        t.received("p", 5)
    with pytest.raises(KeyError, match="not in flight"):
        t.done("p", 4)


@given(st.lists(st.integers(1, 3), min_size=1, max_size=40), st.randoms())
def test_commit_is_one_past_longest_done_prefix(gaps, rnd):
    offsets, o = [], 0
    for g in gaps:  # offsets need not be contiguous
        o += g
        offsets.append(o)
    t = OffsetTracker()
    for x in offsets:
        t.received("p", x)
    done = set()
    order = offsets[:]
    rnd.shuffle(order)
    for x in order:
        t.done("p", x)
        done.add(x)
        prefix = 0
        while prefix < len(offsets) and offsets[prefix] in done:
            prefix += 1
        want = offsets[prefix - 1] + 1 if prefix else None
        got = t.committable().get("p")
        assert got == want
